"""Python types -> Kubernetes structural OpenAPI v3 schemas.

One converter for the resource's pydantic models and the engine's
dataclasses, so the CRD documents every field with its own docstring. The
schemas are *structural* (every node typed, no ``$ref``, no ``anyOf`` of
types, ``additionalProperties`` never beside ``properties``). Optional
fields are not nullable: the API server prunes a null and applies the
default, which is what ``null`` means in the resource model too.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from ..engine.config import EngineArgs
from ..engine.config.fields import (
    HUMAN_READABLE_INT_FIELDS,
    OneOf,
    attr_docs,
    default_of,
    flag_name,
    resolved_fields,
)
from ..engine.config.fields import to_jsonable as dataclass_jsonable
from .engine_spec import spec_fields
from .resource import EngineSection, ListMap, PassThrough

Schema = dict[str, Any]
PRESERVE = "x-kubernetes-preserve-unknown-fields"
INT_OR_STRING = "x-kubernetes-int-or-string"
# Engine fields whose values may be written with size suffixes ("2K", "80m").
HUMAN_READABLE_ENGINE_FIELDS = HUMAN_READABLE_INT_FIELDS


def _alternatives(tp: Any) -> list[Any]:
    if get_origin(tp) in (Union, types.UnionType):
        return [a for a in get_args(tp) if a is not type(None)]
    return [tp]


def _markers(tp: Any) -> tuple[Any, list[Any]]:
    """Strip ``Annotated``; return the bare type and its metadata."""
    if get_origin(tp) is typing.Annotated:
        bare, *meta = get_args(tp)
        return bare, meta
    return tp, []


def schema_for_type(
    tp: Any, *, rules: dict[type, list[Schema]] | None = None, defaults: bool = True
) -> Schema:
    """The structural schema of a type (without description or default)."""
    tp, meta = _markers(tp)
    if any(isinstance(m, EngineSection) for m in meta):
        return engine_schema()
    passthrough = [m for m in meta if isinstance(m, PassThrough)]
    if passthrough:
        return {"type": "object", PRESERVE: True, **passthrough[0].known}
    alts = _alternatives(tp)
    if len(alts) > 1:
        kinds = {get_origin(a) or a for a in alts}
        if kinds == {int, str}:
            return {INT_OR_STRING: True}
        if kinds == {int, float}:
            return {"type": "number"}
        raise TypeError(f"no structural schema for the union {tp!r}")
    tp = alts[0]
    tp, more = _markers(tp)
    if more:
        return schema_for_type(typing.Annotated[tp, *more], rules=rules, defaults=defaults)
    origin = get_origin(tp)
    if tp is Any:
        return {PRESERVE: True}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp is str:
        return {"type": "string"}
    if origin is Literal:
        values = list(get_args(tp))
        kind = {bool: "boolean", int: "integer", float: "number", str: "string"}[type(values[0])]
        return {"type": kind, "enum": values}
    if tp is list or origin is list:
        (elem,) = get_args(tp) or (Any,)
        return {"type": "array", "items": schema_for_type(elem, rules=rules, defaults=defaults)}
    if tp is dict or origin is dict:
        args = get_args(tp)
        value_t = args[1] if args else Any
        if value_t is Any:
            return {"type": "object", PRESERVE: True}
        items = schema_for_type(value_t, rules=rules, defaults=defaults)
        return {"type": "object", "additionalProperties": items}
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return model_schema(tp, rules=rules, defaults=defaults)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return dataclass_schema(tp)
    raise TypeError(f"no structural schema for {tp!r}")


def _constraints(metadata: Iterable[Any], kind: str | None = None) -> Schema:
    """The ``annotated_types`` bounds of a field as OpenAPI v3 (draft 4: a
    boolean ``exclusiveMinimum``), for a pydantic field's metadata and an
    engine dataclass field's ``Annotated`` alike; a length bound of an array
    bounds its items."""
    out: Schema = {}
    if kind == "array":
        for m in metadata:
            if isinstance(m, annotated_types.MinLen):
                out["minItems"] = m.min_length
            elif isinstance(m, annotated_types.MaxLen):
                out["maxItems"] = m.max_length
        return out
    for m in metadata:
        if isinstance(m, OneOf):
            out["enum"] = list(m.values)
        elif isinstance(m, annotated_types.Ge):
            out["minimum"] = m.ge
        elif isinstance(m, annotated_types.Gt):
            out["minimum"] = m.gt
            out["exclusiveMinimum"] = True
        elif isinstance(m, annotated_types.Le):
            out["maximum"] = m.le
        elif isinstance(m, annotated_types.Lt):
            out["maximum"] = m.lt
            out["exclusiveMaximum"] = True
        elif isinstance(m, annotated_types.MinLen):
            out["minLength"] = m.min_length
        elif isinstance(m, annotated_types.MaxLen):
            out["maxLength"] = m.max_length
        elif hasattr(m, "pattern") and m.pattern is not None:
            out["pattern"] = m.pattern
    return out


def _field_default(info: FieldInfo) -> Any:
    if info.default_factory is not None:
        return info.get_default(call_default_factory=True, validated_data={})
    if info.default is PydanticUndefined:
        return PydanticUndefined
    return info.default


def _jsonable_default(value: Any) -> Any:
    if isinstance(value, BaseModel):
        # An empty object: the API server then applies the nested defaults.
        return {}
    return value


def model_schema(
    model: type[BaseModel],
    *,
    rules: dict[type, list[Schema]] | None = None,
    defaults: bool = True,
) -> Schema:
    """Object schema of a pydantic model: camelCase properties, docstrings as
    descriptions, bounds, defaults (unless ``defaults`` is false), and any CEL
    ``rules`` given for the class."""
    properties: Schema = {}
    required = []
    for name, info in model.model_fields.items():
        key = info.alias or name
        annotation: Any = info.annotation
        if info.metadata:
            markers = [m for m in info.metadata if isinstance(m, (EngineSection, PassThrough))]
            if markers:
                annotation = typing.Annotated[annotation, *markers]
        prop = schema_for_type(annotation, rules=rules, defaults=defaults)
        if info.description:
            prop = {"description": " ".join(info.description.split()), **prop}
        prop.update(_constraints(info.metadata, prop.get("type")))
        default = _field_default(info)
        if default is PydanticUndefined:
            required.append(key)
        elif (
            defaults
            and default is not None
            and not any(isinstance(m, EngineSection) for m in info.metadata)
        ):
            prop["default"] = _jsonable_default(default)
        for m in info.metadata:
            if isinstance(m, ListMap):
                prop["x-kubernetes-list-type"] = "map"
                prop["x-kubernetes-list-map-keys"] = list(m.keys)
        properties[key] = prop
    schema: Schema = {"type": "object"}
    if model.__doc__:
        schema["description"] = " ".join(model.__doc__.split())
    schema["properties"] = properties
    if required:
        schema["required"] = required
    if rules and model in rules:
        schema["x-kubernetes-validations"] = rules[model]
    return schema


def dataclass_schema(cls: type) -> Schema:
    """Object schema of an engine config dataclass (snake_case keys, as its JSON).

    Types only (``resolved_fields`` strips the bounds): neither the CRD nor
    the resource model bounds the fields of a JSON sub-configuration such as
    ``compilationConfig``; the engine checks them when it starts. The
    top-level engine settings carry theirs (:func:`engine_schema`)."""
    docs = attr_docs(cls)
    properties: Schema = {}
    for f, tp in resolved_fields(cls):
        prop = schema_for_type(tp)
        if docs.get(f.name):
            prop = {"description": " ".join(docs[f.name].split()), **prop}
        properties[f.name] = prop
    schema: Schema = {"type": "object"}
    if cls.__doc__:
        schema["description"] = " ".join(cls.__doc__.split())
    schema["properties"] = properties
    return schema


def _default_text(f: dataclasses.Field[Any]) -> str:
    default = dataclass_jsonable(default_of(f))
    if default is None or default == {} or default == []:
        return ""
    if isinstance(default, bool):
        return f" Default: {str(default).lower()}."
    return f" Default: {default}."


def engine_schema() -> Schema:
    """The schema of an engine section: one property per ``EngineArgs`` field,
    camelCase, described by the field's docstring and its flag. No defaults:
    an unset key keeps the engine's (or ``spec.engine``'s) value."""
    properties: Schema = {}
    bounds = EngineArgs.bounds()
    for key, (f, tp) in spec_fields().items():
        prop = schema_for_type(tp)
        if f.name in HUMAN_READABLE_ENGINE_FIELDS:
            prop = {INT_OR_STRING: True}
        bound = bounds.get(f.name)
        if bound is not None and bound.items:
            prop["items"] = {**prop["items"], **_constraints(bound.items)}
        elif bound is not None:
            # Of a size field, the bound applies to an integer; a string ("2K")
            # is parsed and bounded by the resource model and the engine.
            prop.update(_constraints(bound.value, prop.get("type")))
        help_text = " ".join(EngineArgs.field_help(f).split())
        text = f"{help_text}{_default_text(f)} Flag: --{flag_name(f.name)}.".strip()
        properties[key] = {"description": text, **prop}
    return {
        "type": "object",
        "description": "Engine settings: the `pdfleet serve` flags in camelCase.",
        "properties": properties,
    }
