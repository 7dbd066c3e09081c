"""Type introspection shared by the CLI, JSON parsing and the CRD schema.

Every engine setting is a typed dataclass field with an attribute docstring.
This module turns those fields into argparse arguments, validates JSON/dict
input against them, and reads their docstrings, so that the flag surface, the
``--*-config`` JSON, and the Kubernetes schema all come from one declaration.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import itertools
import json
import math
import re
import textwrap
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types

# Fields whose CLI values accept human-readable integers (2k, 2K, 1G, ...).
HUMAN_READABLE_INT_FIELDS = frozenset(
    {
        "max_num_batched_tokens",
        "kv_cache_memory_bytes",
        "kv_offload_bytes",
        "max_request_output_tokens",
        "max_schema_bytes",
        "max_grammar_chars",
        "grammar_cache_bytes",
        "max_grammar_memory_bytes",
    }
)

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_human_int(value: str) -> int:
    """Parse an integer that may carry a size suffix.

    Lowercase suffixes are decimal (``2k`` = 2000, ``1.5m`` = 1500000) and
    uppercase suffixes are binary (``2K`` = 2048, ``1G`` = 1073741824). Binary
    suffixes take whole numbers only.
    """
    text = str(value).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", text)
    if not match:
        raise ValueError(f"{value!r} is not an integer (suffixes k/m/g/t and K/M/G/T allowed)")
    number, suffix = match.groups()
    if not suffix:
        if "." in number:
            raise ValueError(f"{value!r} is not an integer")
        return int(number)
    if suffix in _BINARY:
        if "." in number:
            raise ValueError(f"{value!r}: binary suffix {suffix} needs a whole number")
        return int(number) * _BINARY[suffix]
    scaled = float(number) * _DECIMAL[suffix]
    if scaled != int(scaled):
        raise ValueError(f"{value!r} does not give a whole number")
    return int(scaled)


def parse_human_int_or_auto(value: str) -> int:
    """Like :func:`parse_human_int`; ``auto`` or ``-1`` mean "fit the KV cache" (-1)."""
    if str(value).strip().lower() in ("auto", "-1"):
        return -1
    return parse_human_int(value)


_JSON_STRING = re.compile(r'("(?:[^"\\]|\\.)*")')
_JSON_HUMAN_NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?[kKmMgGtT])(?![\w.])")


def expand_json_human_numbers(text: str) -> str:
    """Replace bare human-readable numbers (``80m``) in JSON with integers.

    Quoted strings are left alone, so ``{"name": "8k"}`` keeps its string.
    """
    parts = _JSON_STRING.split(text)
    for i in range(0, len(parts), 2):
        parts[i] = _JSON_HUMAN_NUMBER.sub(lambda m: str(parse_human_int(m.group(1))), parts[i])
    return "".join(parts)


def flatten_type(tp: Any) -> set[Any]:
    """The set of alternatives in a (possibly nested) Union/Optional type."""
    origin = get_origin(tp)
    if origin is typing.Annotated:
        return flatten_type(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        out: set[Any] = set()
        for arg in get_args(tp):
            out |= flatten_type(arg)
        return out
    return {tp}


def _has(hints: set[Any], kind: Any) -> bool:
    return any(h is kind or get_origin(h) is kind for h in hints)


def _get(hints: set[Any], kind: Any) -> Any:
    return next(h for h in hints if h is kind or get_origin(h) is kind)


def resolved_fields(cls: type) -> list[tuple[dataclasses.Field[Any], Any]]:
    """Dataclass fields with their annotations resolved to real types
    (``Annotated`` bounds stripped: see :func:`field_bounds` for those)."""
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if not f.name.startswith("_")]


# -- Bounds ------------------------------------------------------------------
#
# A setting's constant bound is stated once, on its dataclass field, as the
# ``annotated_types`` constraints pydantic reads (``Annotated[int, Ge(1)]``,
# ``Interval(gt=0, le=1)``; a list's items bounded through its item type,
# ``list[Annotated[int, Ge(1)]]``). The CRD's schema and the resource model's
# checks read them from here; the engine's own ``__post_init__`` checks are its
# runtime validation, and a test holds each bound to them.


@dataclass(frozen=True, slots=True)
class OneOf(annotated_types.BaseMetadata):
    """The value is one of ``values``: an enum of an int field whose type stays
    ``int`` (a ``Literal`` would make every assignment of a computed int a type
    error). The schema's ``enum``."""

    values: tuple[Any, ...]


def _bounds(tp: Any) -> list[Any]:
    """The ``annotated_types`` constraints on ``tp`` itself (through Optional),
    grouped ones (``Interval``) expanded."""
    out: list[Any] = []
    for alt in get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,):
        if get_origin(alt) is typing.Annotated:
            for m in alt.__metadata__:
                out += list(m) if isinstance(m, annotated_types.GroupedMetadata) else [m]
    return [m for m in out if isinstance(m, annotated_types.BaseMetadata)]


@dataclass(frozen=True)
class FieldBounds:
    """The constraints of one field: on its value, and on its list's items."""

    value: tuple[Any, ...] = ()
    items: tuple[Any, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.value or self.items)


# What the CRD's schema and the resource model's check both understand; any
# other annotated_types constraint on an engine field is refused rather than
# silently left out of both.
_SUPPORTED_BOUNDS = (
    OneOf,
    annotated_types.Gt,
    annotated_types.Ge,
    annotated_types.Lt,
    annotated_types.Le,
)


def bounds_of(tp: Any) -> FieldBounds:
    """The constraints an annotated type states, on the value and on list items."""
    items: list[Any] = []
    for alt in flatten_type(tp):
        if get_origin(alt) is list and get_args(alt):
            items += _bounds(get_args(alt)[0])
    bounds = FieldBounds(tuple(_bounds(tp)), tuple(items))
    for m in bounds.value + bounds.items:
        if not isinstance(m, _SUPPORTED_BOUNDS):
            raise TypeError(f"{m!r} in {tp!r}: not a bound the engine settings support")
    return bounds


_FIELD_BOUNDS: dict[type, dict[str, FieldBounds]] = {}


def field_bounds(cls: type) -> dict[str, FieldBounds]:
    """Field name -> the bounds its annotation states (fields without any left
    out). Computed once per class; do not modify the result."""
    if cls not in _FIELD_BOUNDS:
        hints = typing.get_type_hints(cls, include_extras=True)
        found = {f.name: bounds_of(hints[f.name]) for f in dataclasses.fields(cls)}
        _FIELD_BOUNDS[cls] = {name: b for name, b in found.items() if b}
    return _FIELD_BOUNDS[cls]


def bound_problem(constraints: tuple[Any, ...], value: Any) -> str | None:
    """Why a number breaks one of ``constraints``, or None (other values are
    the type check's)."""
    if not constraints or not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}"
    for m in constraints:
        if isinstance(m, OneOf) and value not in m.values:
            return f"must be one of {', '.join(map(str, m.values))}, got {value}"
        # The bounds of numeric fields are numbers (annotated_types types them
        # as merely comparable).
        if isinstance(m, annotated_types.Gt) and not value > typing.cast("float", m.gt):
            return f"must be > {m.gt:g}, got {value}"
        if isinstance(m, annotated_types.Ge) and not value >= typing.cast("float", m.ge):
            return f"must be >= {m.ge:g}, got {value}"
        if isinstance(m, annotated_types.Lt) and not value < typing.cast("float", m.lt):
            return f"must be < {m.lt:g}, got {value}"
        if isinstance(m, annotated_types.Le) and not value <= typing.cast("float", m.le):
            return f"must be <= {m.le:g}, got {value}"
    return None


def bounds_problem(bounds: FieldBounds, value: Any) -> str | None:
    """Why a typed value (a list: each item) breaks ``bounds``, or None."""
    if isinstance(value, list):
        return next((p for p in (bound_problem(bounds.items, v) for v in value) if p), None)
    return bound_problem(bounds.value, value)


def attr_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings (a string literal right after an annotated field)."""
    return _attr_docs(cls)


@functools.cache
def _attr_docs(cls: type) -> dict[str, str]:
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        klass_node = ast.parse(source).body[0]
        if not isinstance(klass_node, ast.ClassDef):
            continue
        for node, nxt in itertools.pairwise(klass_node.body):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(nxt.value.value)
    return docs


def default_of(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


# --------------------------------------------------------------------------
# dict / JSON -> dataclass


class ConfigValueError(ValueError):
    """A configuration value is invalid; the message names the field."""


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    return getattr(tp, "__name__", str(tp))


def coerce(tp: Any, value: Any, path: str) -> Any:
    """Validate ``value`` against type ``tp`` (JSON-like input); return it typed."""
    hints = flatten_type(tp)
    if value is None:
        if type(None) in hints or tp is Any:
            return None
        raise ConfigValueError(f"{path}: null is not allowed")
    errors: list[str] = []
    # Try the alternatives from the most specific to the least.
    for alt in sorted(hints, key=_alt_rank):
        if alt is type(None):
            continue
        try:
            return _coerce_one(alt, value, path)
        except ConfigValueError as e:
            errors.append(str(e))
    if len(errors) == 1:
        raise ConfigValueError(errors[0])
    expected = " or ".join(_type_name(h) for h in sorted(hints, key=_alt_rank))
    raise ConfigValueError(f"{path}: expected {expected}, got {value!r}")


def _alt_rank(tp: Any) -> int:
    if dataclasses.is_dataclass(tp):
        return 0
    if get_origin(tp) is Literal:
        return 1
    order = {bool: 2, int: 3, float: 4, list: 5, dict: 6, str: 8}
    return order.get(get_origin(tp) or tp, 7)


def _coerce_one(tp: Any, value: Any, path: str) -> Any:  # noqa: C901 (one branch per supported field type)
    origin = get_origin(tp)
    if tp is Any:
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigValueError(f"{path}: expected an object, got {value!r}")
        return from_dict(tp, value, path)
    if origin is Literal:
        if value in get_args(tp):
            return value
        raise ConfigValueError(f"{path}: {value!r} is not {_type_name(tp)}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigValueError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return parse_human_int(value)
            except ValueError as e:
                raise ConfigValueError(f"{path}: {e}") from None
        raise ConfigValueError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigValueError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigValueError(f"{path}: expected a string, got {value!r}")
    if tp is list or origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigValueError(f"{path}: expected a list, got {value!r}")
        (elem,) = get_args(tp) or (Any,)
        return [coerce(elem, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigValueError(f"{path}: expected an object, got {value!r}")
        args = get_args(tp)
        val_t = args[1] if args else Any
        return {str(k): coerce(val_t, v, f"{path}.{k}") for k, v in value.items()}
    raise ConfigValueError(f"{path}: unsupported type {tp!r}")


def from_dict(cls: type, data: dict[str, Any], path: str = "") -> Any:
    """Build dataclass ``cls`` from a dict, rejecting unknown keys by name."""
    known = {f.name: t for f, t in resolved_fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        where = f" in {path}" if path else ""
        raise ConfigValueError(
            f"unknown field(s) {', '.join(unknown)}{where}; known fields: {', '.join(sorted(known))}"
        )
    kwargs = {
        name: coerce(known[name], value, f"{path}.{name}" if path else name)
        for name, value in data.items()
    }
    return cls(**kwargs)


def to_jsonable(obj: Any) -> Any:
    """Dataclasses/tuples/sets -> plain JSON types (dict keys sorted by caller)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        items = [to_jsonable(v) for v in obj]
        return sorted(items) if isinstance(obj, (set, frozenset)) else items
    return obj


# --------------------------------------------------------------------------
# dataclass field -> argparse kwargs


def _optional(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse_optional(text: str) -> Any:
        if text in ("", "None", "none", "null"):
            return None
        return parse(text)

    parse_optional.__name__ = getattr(parse, "__name__", "value")
    return parse_optional


def optional_of(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse``, with ``None`` (or ``none``, ``null``, empty) read as None."""
    return _optional(parse)


def _argtype(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    def parse_arg(text: str) -> Any:
        try:
            return parse(text)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse_arg.__name__ = name
    return parse_arg


def finite_float(text: str) -> float:
    """A float flag value; ``inf`` and ``nan`` are refused (every setting is a
    bound or a weight, and an infinite one is an unbounded wait)."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def bounded_seconds(
    low: float, high: float, *, open_low: bool = False, unit: str = "seconds"
) -> Callable[[str], float]:
    """An argparse ``type`` for a number of seconds within [``low``, ``high``]
    (``(low, high]`` with ``open_low``); the error names the bounds, argparse
    prefixes the flag."""

    def parse_seconds(text: str) -> float:
        try:
            value = finite_float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number ({unit})") from None
        if value < low or (open_low and value == low) or value > high:
            bracket = "(" if open_low else "["
            raise argparse.ArgumentTypeError(
                f"{text} is out of range: {unit} within {bracket}{low:g}, {high:g}]"
            )
        return value

    parse_seconds.__name__ = "seconds"
    return parse_seconds


def json_parser(tp: Any, name: str) -> Callable[[str], Any]:
    """Parse a JSON flag value (human-readable numbers allowed) into ``tp``."""

    def parse_json(text: str) -> Any:
        try:
            data = json.loads(expand_json_human_numbers(text))
        except json.JSONDecodeError as e:
            raise ValueError(f"--{flag_name(name)}: invalid JSON ({e})") from None
        return coerce(tp, data, name)

    return parse_json


def flag_name(field_name: str) -> str:
    return field_name.replace("_", "-")


JSON_METAVAR = "JSON"
"""The placeholder of a JSON flag (``argparse_kwargs``); ``FlexibleArgumentParser``
also takes its keys one by one (``--flag.key value``) by it."""


def argparse_kwargs(name: str, tp: Any, default: Any, help_text: str) -> dict[str, Any]:
    """argparse ``add_argument`` keyword arguments for one typed field.

    bool -> ``--x/--no-x``; Literal -> choices; Optional -> also accepts
    ``None``; list -> ``nargs='+'``; dataclass or dict -> JSON (with
    human-readable numbers); int -> plain int, or a human-readable int for the
    size-like fields.
    """
    hints = flatten_type(tp)
    optional = type(None) in hints
    hints.discard(type(None))
    kw: dict[str, Any] = {"default": default, "help": help_text.replace("%", "%%")}
    dataclass_t = next((h for h in hints if dataclasses.is_dataclass(h)), None)
    if dataclass_t is not None or _has(hints, dict):
        kw["type"] = _argtype(json_parser(tp, name), "JSON")
        kw["metavar"] = JSON_METAVAR
        kw["help"] += "\n\nA JSON object; sizes such as 80m or 2G may be written bare."
        return kw
    if _has(hints, bool):
        kw["action"] = argparse.BooleanOptionalAction
        return kw
    if _has(hints, list):
        elem = get_args(_get(hints, list))
        elem_t = elem[0] if elem else str
        kw["nargs"] = "+"
        if get_origin(elem_t) is Literal:
            kw["choices"] = list(get_args(elem_t))
            elem_t = type(get_args(elem_t)[0])
        elem_parse: Callable[[str], Any] = (
            int if elem_t is int else (float if elem_t is float else str)
        )
        kw["type"] = _argtype(_optional(elem_parse) if optional else elem_parse, elem_t.__name__)
        return kw
    if _has(hints, Literal):
        choices = list(get_args(_get(hints, Literal)))
        if hints - {_get(hints, Literal)}:
            # Literal | str: any string allowed, choices shown as the metavar.
            kw["metavar"] = "{" + ",".join(map(str, choices)) + "}"
            parse: Callable[[str], Any] = str
        else:
            kw["choices"] = [*choices, None] if optional else choices
            kw["metavar"] = "{" + ",".join(map(str, choices)) + "}"
            elem_type = type(choices[0])
            parse = elem_type
        kw["type"] = _argtype(_optional(parse) if optional else parse, "choice")
        return kw
    if _has(hints, int):
        if name == "max_model_len":
            parse = parse_human_int_or_auto
        elif name in HUMAN_READABLE_INT_FIELDS:
            parse = parse_human_int
        else:
            parse = int
        kw["type"] = _argtype(_optional(parse) if optional else parse, "int")
        return kw
    if _has(hints, float):
        kw["type"] = _argtype(_optional(finite_float) if optional else finite_float, "float")
        return kw
    if _has(hints, str):
        kw["type"] = _argtype(_optional(str) if optional else str, "str")
        return kw
    raise TypeError(f"field {name}: no CLI mapping for type {tp!r}")
