"""The rules of a camelCase spec section, written once, read two ways.

A rule is data: :class:`Bound` limits one field by a constant, :class:`NotBelow`
keeps one field at or above the sum of others. :func:`check_section` evaluates
them in Python (the section's ``validate()``), and :mod:`.schema` renders the
same objects as the CRD's ``minimum``/``maximum`` keywords and CEL
``x-kubernetes-validations``, so the API server and ``pdfleet up`` refuse the
same specs (``tests/autoscaling/test_schema.py`` holds them to it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from ..engine_spec import camel

BOUNDS = "bounds"
KEY = "key"

Op = Literal[">", ">=", "<="]


class SpecValueError(ValueError):
    """A bad value in a spec section: ``key`` is its dotted camelCase path below
    ``root`` (empty for the section itself), ``problem`` what is wrong."""

    def __init__(self, root: str, key: str, problem: str, sep: str = ": ") -> None:
        self.root = root
        self.key = key
        self.problem = problem
        where = f"{root}.{key}" if root and key else (root or key)
        super().__init__(f"{where}{sep}{problem}")


def spec_key(f: dataclasses.Field[Any]) -> str:
    """The resource key of a dataclass field (camelCase unless metadata names it)."""
    if KEY in f.metadata:
        return str(f.metadata[KEY])
    return camel(f.name)


@dataclass(frozen=True)
class Bound:
    """``value OP limit`` for one field; a null value (an optional field unset)
    satisfies every bound."""

    op: Op
    limit: float

    def holds(self, value: float) -> bool:
        if self.op == ">":
            return value > self.limit
        if self.op == ">=":
            return value >= self.limit
        return value <= self.limit


def bounds_text(bounds: tuple[Bound, ...], nullable: bool) -> str:
    """``must be >= 1``, ``must be in (0, 1]``, ``must be > 0 or null``."""
    lower = [b for b in bounds if b.op in (">", ">=")]
    upper = [b for b in bounds if b.op == "<="]
    if lower and upper:
        lo, hi = lower[0], upper[0]
        left = "(" if lo.op == ">" else "["
        text = f"must be in {left}{lo.limit:g}, {hi.limit:g}]"
    else:
        text = " and ".join(f"must be {b.op} {b.limit:g}" for b in bounds)
    return text + (" or null" if nullable else "")


@dataclass(frozen=True)
class NotBelow:
    """``field >= floor[0] + floor[1] + ...`` on the object holding the rule.

    Paths are attribute paths from that object (``prefill.min_replicas``).
    The rule holds while any side is null (an optional field unset). ``why``,
    when given, ends the message. A class lists its rules in ``RULES``.
    """

    field: str
    floor: tuple[str, ...]
    why: str = ""


def field_at(cls: type, path: str) -> dataclasses.Field[Any]:
    """The dataclass field an attribute path ends at."""
    *heads, last = path.split(".")
    for head in heads:
        cls = _field_type(cls, head)
    return next(f for f in dataclasses.fields(cls) if f.name == last)


def key_path(cls: type, path: str) -> list[str]:
    """The resource keys of an attribute path (``prefill.min_replicas`` ->
    ``["prefill", "minReplicas"]``)."""
    names = path.split(".")
    return [spec_key(field_at(cls, ".".join(names[: i + 1]))) for i in range(len(names))]


def _field_type(cls: type, name: str) -> type:
    from ...engine.config.fields import resolved_fields

    tp = next(tp for f, tp in resolved_fields(cls) if f.name == name)
    if not isinstance(tp, type) or not dataclasses.is_dataclass(tp):
        raise TypeError(f"{cls.__name__}.{name} is not a dataclass field")
    return tp


def _value_at(obj: Any, path: str) -> Any:
    for name in path.split("."):
        obj = getattr(obj, name)
    return obj


def field_bounds(f: dataclasses.Field[Any]) -> tuple[Bound, ...]:
    bounds: tuple[Bound, ...] = f.metadata.get(BOUNDS, ())
    return bounds


def rules_of(cls: type) -> tuple[NotBelow, ...]:
    rules: tuple[NotBelow, ...] = getattr(cls, "RULES", ())
    return rules


def check_section(obj: Any, root: str, prefix: str = "") -> None:
    """Raise :class:`SpecValueError` for the first broken rule of ``obj`` and its
    nested sections: each field's bounds, then the nested sections' rules, then
    the cross-field rules of ``obj`` itself."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{spec_key(f)}"
        if dataclasses.is_dataclass(value):
            check_section(value, root, f"{key}.")
            continue
        if value is None:
            continue
        bounds = field_bounds(f)
        if not all(b.holds(value) for b in bounds):
            nullable = f.default is None
            raise SpecValueError(root, key, f"{bounds_text(bounds, nullable)}, got {value}", " ")
    for rule in rules_of(type(obj)):
        value = _value_at(obj, rule.field)
        parts = [_value_at(obj, p) for p in rule.floor]
        if value is None or any(p is None for p in parts) or value >= sum(parts):
            continue
        key = f"{prefix}{'.'.join(key_path(type(obj), rule.field))}"
        names = " + ".join(".".join(key_path(type(obj), p)) for p in rule.floor)
        why = f" ({rule.why})" if rule.why else ""
        problem = f"must be at least {names} ({sum(parts):g}), got {value:g}{why}"
        raise SpecValueError(root, key, problem, " ")
