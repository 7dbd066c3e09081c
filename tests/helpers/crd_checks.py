"""A small stand-in for the API server's handling of a CRD schema.

Applies ``default``s the way the API server does (top-down, an object
default then its properties' defaults), converts ``type: number`` values to
floats as CEL sees them, validates with JSON Schema (OpenAPI v3 is draft 4
here: boolean ``exclusiveMinimum``) and evaluates the CEL
``x-kubernetes-validations`` rules with cel-python.
"""

from __future__ import annotations

import copy
from typing import Any

import celpy
import jsonschema

from pdfleet.operator.crd import build_crd


def crd_schema() -> dict[str, Any]:
    return build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def default(schema: dict[str, Any], value: Any) -> Any:
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, prop in (schema.get("properties") or {}).items():
            if key not in value and "default" in prop:
                value[key] = copy.deepcopy(prop["default"])
            if key in value:
                value[key] = default(prop, value[key])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in value:
                value[key] = default(extra, value[key])
    elif schema.get("type") == "array" and isinstance(value, list):
        return [default(schema["items"], v) for v in value]
    elif schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


def cel_errors(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    errors = []
    env = celpy.Environment()
    for rule in schema.get("x-kubernetes-validations") or []:
        program = env.program(env.compile(rule["rule"]))
        if not program.evaluate({"self": celpy.json_to_cel(value)}):
            errors.append(f"{path}{rule.get('fieldPath', '')}: {rule['message']}")
    if schema.get("type") == "object" and isinstance(value, dict):
        for key, prop in (schema.get("properties") or {}).items():
            if key in value:
                errors += cel_errors(prop, value[key], f"{path}.{key}")
    if schema.get("type") == "array" and isinstance(value, list):
        if schema.get("x-kubernetes-list-type") == "map":
            keys = schema["x-kubernetes-list-map-keys"]
            seen = [tuple(item.get(k) for k in keys) for item in value]
            if len(set(seen)) != len(seen):
                errors.append(f"{path}: Duplicate value")
        for i, item in enumerate(value):
            errors += cel_errors(schema.get("items") or {}, item, f"{path}[{i}]")
    return errors


def admit(obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """(the object as stored, the errors the API server would return)."""
    schema = crd_schema()
    stored = default(schema, copy.deepcopy(obj))
    errors = [
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}"
        for e in jsonschema.Draft4Validator(schema).iter_errors(stored)
    ]
    if not errors:
        errors = cel_errors(schema, stored)
    return stored, errors
