"""The base of every section of the InferenceService resource, and its errors.

Every section (``spec.model``, ``spec.gateway``, ``spec.autoscaling``, ...) is
a pydantic model deriving from :class:`SpecModel`: its keys are the camelCase
aliases of snake_case attributes, its attribute docstrings are what ``kubectl
explain`` prints (the CRD is generated from these models by
:mod:`pdfleet.operator.openapi`), constant bounds are ``Field`` constraints
(the CRD's ``minimum``/``maximum``) and cross-field checks are model
validators (and, for the API server, the CEL rules in
:mod:`pdfleet.operator.crd`).

``null`` means "not set", as on the API server, which prunes nulls of
non-nullable fields before applying defaults: a null value takes the field's
default here too, so a file means the same to ``pdfleet up`` and to a cluster.
"""

from __future__ import annotations

import difflib
from typing import Any, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from .engine_spec import FieldPathError, FieldPathErrors, camel

UNKNOWN_FIELD = "unknown field; remove it (`pdfleet crd` or kubectl explain lists the fields)"


class SpecModel(BaseModel):
    """A section of the resource: camelCase keys, unknown keys refused, null = unset."""

    # Strict: a value must already have the type the CRD declares (no "5" for 5,
    # no true for 1), as on the API server. Input from a file or a live object is
    # validated by alias only (``by_name=False``): a snake_case key would be
    # pruned by the API server, so it is refused here too; names are for Python.
    model_config = ConfigDict(
        strict=True,
        extra="forbid",
        populate_by_name=True,
        use_attribute_docstrings=True,
        alias_generator=camel,
        validate_default=True,
    )

    @model_validator(mode="before")
    @classmethod
    def _null_means_unset(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


def _model_at(model: type[BaseModel] | None, loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The section model at ``loc`` below ``model`` (list indexes and optional
    wrappers skipped), or None where the path leaves the models."""
    for part in loc:
        if model is None or isinstance(part, int):
            continue
        field = next((f for name, f in model.model_fields.items() if part in (name, f.alias)), None)
        if field is None:
            return None
        inner: Any = field.annotation
        while get_origin(inner) is not None and not (
            isinstance(inner, type) and issubclass(inner, BaseModel)
        ):
            models = [
                a for a in get_args(inner) if isinstance(a, type) and issubclass(a, BaseModel)
            ]
            inner = models[0] if models else None
            if inner is None:
                break
        model = inner if isinstance(inner, type) and issubclass(inner, BaseModel) else None
    return model


def _unknown_key(model: type[BaseModel] | None, loc: tuple[int | str, ...]) -> str:
    """The problem text of an unknown key, with the closest known key as a hint."""
    key = str(loc[-1]) if loc else ""
    section = _model_at(model, loc[:-1])
    aliases = sorted(f.alias or name for name, f in section.model_fields.items()) if section else []
    close = difflib.get_close_matches(key, aliases, n=1) or (
        [camel(key)] if camel(key) in aliases else []
    )
    hint = f" (did you mean {close[0]}?)" if close else ""
    return UNKNOWN_FIELD.replace(";", f"{hint};", 1)


def format_validation_error(
    error: ValidationError, prefix: str = "", model: type[BaseModel] | None = None
) -> str:
    """One line per problem, each starting with the field's dotted camelCase path;
    ``model`` (the validated class) lets an unknown key name its closest known one."""
    lines = []
    for err in error.errors():
        path = ".".join(str(p) for p in (prefix, *err["loc"]) if p != "")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = _unknown_key(model, tuple(err["loc"]))
        elif err["type"] == "missing":
            msg = "required field is missing"
        nested = (err.get("ctx") or {}).get("error")
        if isinstance(nested, FieldPathErrors):
            lines += [f"{path}.{e.subpath}: {e.problem}" for e in nested.errors]
            continue
        if isinstance(nested, FieldPathError):
            path, msg = f"{path}.{nested.subpath}", nested.problem
        lines.append(f"{path}: {msg}")
    return "\n".join(lines)
