"""``spec.engine`` of an InferenceService <-> ``EngineArgs``.

The resource's engine settings are the engine flags in camelCase
(``maxNumBatchedTokens`` <-> ``--max-num-batched-tokens``), one key per
``EngineArgs`` field: one source of truth, no hand-kept copy.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from pdfleet.engine.config import EngineArgs
from pdfleet.engine.config.fields import ConfigValueError, coerce, resolved_fields, to_jsonable

# Fields the resource sets elsewhere (spec.model, per-role KV transfer), or that
# only make sense on a command line.
NOT_IN_SPEC = frozenset({"model", "kv_transfer_config"})


def camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def spec_fields() -> dict[str, tuple[dataclasses.Field, Any]]:
    """camelCase key -> (EngineArgs field, resolved type)."""
    return {
        camel(f.name): (f, tp) for f, tp in resolved_fields(EngineArgs) if f.name not in NOT_IN_SPEC
    }


def engine_args_from_spec(
    engine: dict[str, Any] | None, *, path: str = "spec.engine", **extra: Any
) -> EngineArgs:
    """Build ``EngineArgs`` from a camelCase engine section (unknown keys rejected)."""
    fields = spec_fields()
    values: dict[str, Any] = {}
    for key, value in (engine or {}).items():
        if key not in fields:
            hint = f" (did you mean {camel(key)}?)" if camel(key) in fields else ""
            raise ValueError(f"{path}.{key}: unknown engine setting{hint}")
        f, tp = fields[key]
        try:
            values[f.name] = coerce(tp, value, f"{path}.{key}")
        except ConfigValueError as e:
            raise ValueError(str(e)) from None
    values.update(extra)
    return EngineArgs(**values)


def spec_from_engine_args(args: EngineArgs) -> dict[str, Any]:
    """The camelCase engine section holding the non-default values of ``args``."""
    out: dict[str, Any] = {}
    for key, (f, _tp) in spec_fields().items():
        value = to_jsonable(getattr(args, f.name))
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        if value != to_jsonable(default):
            out[key] = value
    return out
