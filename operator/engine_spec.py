"""``spec.engine`` of an InferenceService <-> ``EngineArgs``.

The resource's engine settings are the engine flags in camelCase
(``maxNumBatchedTokens`` <-> ``--max-num-batched-tokens``), one key per
``EngineArgs`` field: one source of truth, no hand-kept copy.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any

from ..engine.config import EngineArgs
from ..engine.config.fields import (
    HUMAN_READABLE_INT_FIELDS,
    ConfigValueError,
    bounds_problem,
    coerce,
    flatten_type,
    resolved_fields,
    to_jsonable,
)

# Fields the resource sets elsewhere (spec.model, per-role KV transfer), or that
# only make sense on a command line, with where to set them instead.
SET_ELSEWHERE = {
    "model": "spec.model.uri",
    "served_model_name": "spec.model.name",
    "revision": "spec.model.revision",
    "kv_transfer_config": "spec.kvTransfer (the operator adds each role's kv_role)",
}
NOT_IN_SPEC = frozenset(SET_ELSEWHERE)


def _json_type_problem(tp: Any, value: Any, human: bool) -> str | None:
    """Why ``value`` does not have the JSON type the CRD declares for ``tp``
    (an integer for int, no "3"; a number for float; a string only for
    ``human`` size fields), looking into lists, maps and nested
    configurations, or None. Everything else is ``coerce``'s to refuse."""
    hints = flatten_type(tp) - {type(None)}
    origins = {typing.get_origin(h) or h for h in hints}
    if isinstance(value, str) and str not in origins and not (human and int in origins):
        if int in origins:
            return f"expected an integer, got {value!r}"
        if float in origins:
            return f"expected a number, got {value!r}"
    nested: list[tuple[Any, Any]] = []
    for hint in hints:
        args = typing.get_args(hint)
        if isinstance(value, list) and typing.get_origin(hint) is list and args:
            nested += [(args[0], item) for item in value]
        elif isinstance(value, dict) and typing.get_origin(hint) is dict and len(args) == 2:
            nested += [(args[1], item) for item in value.values()]
        elif isinstance(value, dict) and isinstance(hint, type) and dataclasses.is_dataclass(hint):
            known = {f.name: t for f, t in resolved_fields(hint)}
            nested += [(known[k], v) for k, v in value.items() if k in known]
    for inner_tp, inner in nested:
        problem = _json_type_problem(inner_tp, inner, human=False)
        if problem:
            return problem
    return None


class FieldPathError(ValueError):
    """A problem found below the field being validated (``subpath`` names where)."""

    def __init__(self, subpath: str, problem: str) -> None:
        super().__init__(f"{subpath}: {problem}")
        self.subpath = subpath
        self.problem = problem


class FieldPathErrors(ValueError):
    """Several problems found below the field being validated, all reported."""

    def __init__(self, errors: list[FieldPathError]) -> None:
        super().__init__("; ".join(map(str, errors)))
        self.errors = errors


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def spec_fields() -> dict[str, tuple[dataclasses.Field[Any], Any]]:
    """camelCase key -> (EngineArgs field, resolved type)."""
    return {
        camel(f.name): (f, tp) for f, tp in resolved_fields(EngineArgs) if f.name not in NOT_IN_SPEC
    }


def _unknown_key_problem(key: str, fields: dict[str, Any]) -> str:
    elsewhere = {camel(name): where for name, where in SET_ELSEWHERE.items()}
    if key in elsewhere:
        return f"not an engine setting here; set {elsewhere[key]} instead"
    guess = camel(key) if camel(key) in fields else None
    guess = guess or next(iter(difflib.get_close_matches(key, list(fields), n=1)), None)
    if guess:
        return f"unknown engine setting; did you mean {guess}?"
    return "unknown engine setting (the keys are the `pdfleet serve` flags in camelCase)"


def validate_engine_section(engine: dict[str, Any] | None) -> dict[str, Any]:
    """Check a camelCase engine section key by key; return it with typed values.

    Values are coerced to the field types (``"2K"`` -> 2048) and kept
    JSON-like; nulls are dropped (unset, as the API server prunes them).
    Raises :class:`FieldPathError` naming the key.
    """
    fields = spec_fields()
    bounds = EngineArgs.bounds()
    out: dict[str, Any] = {}
    for key, value in (engine or {}).items():
        if value is None:
            continue
        if key not in fields:
            raise FieldPathError(key, _unknown_key_problem(key, fields))
        f, tp = fields[key]
        # Strict, as the API server reads the CRD's types: "3" is no integer.
        problem = _json_type_problem(tp, value, human=f.name in HUMAN_READABLE_INT_FIELDS)
        if problem:
            raise FieldPathError(key, problem)
        try:
            typed = coerce(tp, value, key)
        except ConfigValueError as e:
            raise FieldPathError(key, str(e).removeprefix(f"{key}: ")) from None
        # The bounds the engine's fields state (the CRD's minimum/maximum/enum).
        problem = bounds_problem(bounds[f.name], typed) if f.name in bounds else None
        if problem:
            raise FieldPathError(key, problem)
        out[key] = to_jsonable(typed)
    return out


def engine_args_from_spec(
    engine: dict[str, Any] | None, *, path: str = "spec.engine", **extra: Any
) -> EngineArgs:
    """Build ``EngineArgs`` from a camelCase engine section (unknown keys rejected)."""
    fields = spec_fields()
    values: dict[str, Any] = {}
    for key, value in (engine or {}).items():
        if key not in fields:
            raise ValueError(f"{path}.{key}: {_unknown_key_problem(key, fields)}")
        f, tp = fields[key]
        try:
            values[f.name] = coerce(tp, value, f"{path}.{key}")
        except ConfigValueError as e:
            raise ValueError(str(e)) from None
    values.update(extra)
    return EngineArgs(**values)
