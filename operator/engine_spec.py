"""``spec.engine`` of an InferenceService <-> ``EngineArgs``.

The resource's engine settings are the engine flags in camelCase
(``maxNumBatchedTokens`` <-> ``--max-num-batched-tokens``), one key per
``EngineArgs`` field: one source of truth, no hand-kept copy.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

from ..engine.config import EngineArgs
from ..engine.config.fields import ConfigValueError, coerce, resolved_fields, to_jsonable

# Fields the resource sets elsewhere (spec.model, per-role KV transfer), or that
# only make sense on a command line, with where to set them instead.
SET_ELSEWHERE = {
    "model": "spec.model.uri",
    "served_model_name": "spec.model.name",
    "revision": "spec.model.revision",
    "kv_transfer_config": "spec.kvTransfer (the operator adds each role's kv_role)",
}
NOT_IN_SPEC = frozenset(SET_ELSEWHERE)


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
    out: dict[str, Any] = {}
    for key, value in (engine or {}).items():
        if value is None:
            continue
        if key not in fields:
            raise FieldPathError(key, _unknown_key_problem(key, fields))
        _, tp = fields[key]
        try:
            out[key] = to_jsonable(coerce(tp, value, key))
        except ConfigValueError as e:
            raise FieldPathError(key, str(e).removeprefix(f"{key}: ")) from None
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
