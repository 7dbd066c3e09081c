"""The CRD schema of a spec section, generated from its dataclasses.

Keys are the fields' resource keys (:func:`.rules.spec_key`), descriptions
their attribute docstrings (what ``kubectl explain`` prints), defaults their
defaults, each :class:`.rules.Bound` a ``minimum`` or ``maximum``, and every
:class:`.rules.NotBelow` rule a CEL ``x-kubernetes-validations`` entry on
the object that holds it. The API server applies defaults before it
validates, but each CEL term still falls back to the field's default (or
holds when an optional field is unset), so a rule reads right on its own.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Literal, Union, get_args, get_origin

from ...engine.config.fields import attr_docs, resolved_fields
from .rules import Bound, NotBelow, field_at, field_bounds, key_path, rules_of, spec_key

Schema = dict[str, Any]


def _bare(tp: Any) -> tuple[Any, bool]:
    """(the type without ``None``, whether it was optional)."""
    if get_origin(tp) in (Union, types.UnionType):
        alts = [a for a in get_args(tp) if a is not type(None)]
        if len(alts) != 1:
            raise TypeError(f"{tp!r}: only X | None unions are supported")
        return alts[0], True
    return tp, False


def _bound_keywords(bounds: tuple[Bound, ...]) -> Schema:
    out: Schema = {}
    for b in bounds:
        if b.op in (">", ">="):
            out["minimum"] = b.limit
            if b.op == ">":
                out["exclusiveMinimum"] = True
        else:
            out["maximum"] = b.limit
    return out


def section_schema(cls: type) -> Schema:
    """The structural object schema of spec dataclass ``cls``."""
    docs = attr_docs(cls)
    properties: Schema = {}
    for f, tp in resolved_fields(cls):
        bare, _ = _bare(tp)
        prop: Schema
        if dataclasses.is_dataclass(bare):
            if not isinstance(bare, type):
                raise TypeError("broken invariant: isinstance(bare, type)")
            prop = section_schema(bare)
            prop["default"] = {}  # the API server then fills the nested defaults
        elif get_origin(bare) is Literal:
            prop = {"type": "string", "enum": list(get_args(bare))}
            if f.default is not dataclasses.MISSING:
                prop["default"] = f.default
        else:
            kind = {bool: "boolean", int: "integer", float: "number", str: "string"}[bare]
            prop = {"type": kind, **_bound_keywords(field_bounds(f))}
            if f.default is not None and f.default is not dataclasses.MISSING:
                prop["default"] = f.default
        if docs.get(f.name):
            prop = {"description": " ".join(docs[f.name].split()), **prop}
        properties[spec_key(f)] = prop
    schema: Schema = {"type": "object"}
    if cls.__doc__:
        schema["description"] = " ".join(cls.__doc__.split())
    schema["properties"] = properties
    rules = [cel_rule(cls, rule) for rule in rules_of(cls)]
    if rules:
        schema["x-kubernetes-validations"] = rules
    return schema


def _literal(value: Any, tp: Any) -> str:
    return repr(float(value)) if tp is float else repr(int(value))


def _term(cls: type, path: str) -> tuple[str, str | None]:
    """(the CEL expression of a path's value, the guard under which it is unset
    when the field is optional)."""
    keys = key_path(cls, path)
    selectors = [f"self.{'.'.join(keys[: i + 1])}" for i in range(len(keys))]
    present = " && ".join(f"has({s})" for s in selectors)
    f = field_at(cls, path)
    types_by_name = {g.name: t for g, t in resolved_fields(_owner(cls, path))}
    tp, optional = _bare(types_by_name[f.name])
    if optional:
        return selectors[-1], f"!({present})" if len(selectors) > 1 else f"!{present}"
    return f"({present} ? {selectors[-1]} : {_literal(f.default, tp)})", None


def _owner(cls: type, path: str) -> type:
    *heads, _ = path.split(".")
    for head in heads:
        tp, _ = _bare(next(t for f, t in resolved_fields(cls) if f.name == head))
        cls = tp
    return cls


def cel_rule(cls: type, rule: NotBelow) -> Schema:
    """The CEL validation of one :class:`.rules.NotBelow` rule of ``cls``."""
    value, value_unset = _term(cls, rule.field)
    parts = [_term(cls, p) for p in rule.floor]
    guards = [g for g in (value_unset, *(g for _, g in parts)) if g]
    check = f"{value} >= {' + '.join(expr for expr, _ in parts)}"
    key = key_path(cls, rule.field)
    names = " + ".join(".".join(key_path(cls, p)) for p in rule.floor)
    why = f" ({rule.why})" if rule.why else ""
    return {
        "rule": " || ".join([*guards, check]),
        "message": f"{'.'.join(key)} must be at least {names}{why}",
        "fieldPath": "." + ".".join(key),
    }
