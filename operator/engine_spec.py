"""``spec.engine`` of an InferenceService <-> ``EngineArgs``.

The resource's engine settings are the engine flags in camelCase
(``maxNumBatchedTokens`` <-> ``--max-num-batched-tokens``), one key per
``EngineArgs`` field: one source of truth, no hand-kept copy.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from dataclasses import dataclass
from typing import Any

from ..engine.config import EngineArgs
from ..engine.config.admission import DEFAULT_MAX_N
from ..engine.config.cache import BLOCK_SIZES
from ..engine.config.fields import (
    HUMAN_READABLE_INT_FIELDS,
    ConfigValueError,
    coerce,
    flatten_type,
    resolved_fields,
    to_jsonable,
)
from ..engine.config.lora import POSSIBLE_MAX_LORA_RANKS

# Fields the resource sets elsewhere (spec.model, per-role KV transfer), or that
# only make sense on a command line, with where to set them instead.
SET_ELSEWHERE = {
    "model": "spec.model.uri",
    "served_model_name": "spec.model.name",
    "revision": "spec.model.revision",
    "kv_transfer_config": "spec.kvTransfer (the operator adds each role's kv_role)",
}
NOT_IN_SPEC = frozenset(SET_ELSEWHERE)


@dataclass(frozen=True)
class EngineBound:
    """A constant bound of one engine setting, as the engine's own checks make it.

    ``exclusive`` makes ``minimum`` open; ``items`` bounds a list's items."""

    minimum: float | None = None
    maximum: float | None = None
    exclusive: bool = False
    enum: tuple[int, ...] | None = None
    items: bool = False

    def problem(self, value: Any) -> str | None:
        """Why ``value`` (typed) is out of bounds, or None."""
        if isinstance(value, list) and self.items:
            return next((p for p in map(self.problem, value) if p), None)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        if isinstance(value, float) and not math.isfinite(value):
            return f"must be a finite number, got {value}"
        if self.enum is not None and value not in self.enum:
            return f"must be one of {', '.join(map(str, self.enum))}, got {value}"
        if self.minimum is not None and self.exclusive and value <= self.minimum:
            return f"must be > {self.minimum:g}, got {value}"
        if self.minimum is not None and value < self.minimum:
            return f"must be >= {self.minimum:g}, got {value}"
        if self.maximum is not None and value > self.maximum:
            return f"must be <= {self.maximum:g}, got {value}"
        return None


# The engine's constant bounds, by EngineArgs field: the CRD's
# minimum/maximum/enum of the engine sections and the resource model's checks.
# Each is the one the engine's configuration makes when it starts (a test
# constructs each sub-configuration just outside the bound), except `seed`,
# the resource's own (an engine seeds torch with it).
_AT_LEAST_1 = EngineBound(minimum=1)
_FRACTION = EngineBound(minimum=0, maximum=1, exclusive=True)
ENGINE_BOUNDS: dict[str, EngineBound] = {
    "seed": EngineBound(minimum=0),
    "max_model_len": EngineBound(minimum=-1),  # -1: the model's own (auto); 0 is refused
    "max_logprobs": EngineBound(minimum=-1),  # -1: no bound; 0 is refused
    "tensor_parallel_size": _AT_LEAST_1,
    "pipeline_parallel_size": _AT_LEAST_1,
    "data_parallel_size": _AT_LEAST_1,
    "nnodes": _AT_LEAST_1,
    "node_rank": EngineBound(minimum=0),
    "master_port": EngineBound(minimum=1, maximum=65535),
    "block_size": EngineBound(enum=BLOCK_SIZES),
    "gpu_memory_utilization": _FRACTION,
    "kv_cache_memory_bytes": _AT_LEAST_1,
    "kv_offload_bytes": _AT_LEAST_1,
    "num_gpu_blocks_override": _AT_LEAST_1,
    "max_num_batched_tokens": _AT_LEAST_1,
    "max_num_seqs": _AT_LEAST_1,
    "long_prefill_token_threshold": EngineBound(minimum=0),
    "max_request_share": _FRACTION,
    "max_n": EngineBound(minimum=1, maximum=DEFAULT_MAX_N),
    "max_request_output_tokens": _AT_LEAST_1,
    "max_grammar_choices": _AT_LEAST_1,
    "max_schema_enum_values": _AT_LEAST_1,
    "max_schema_bytes": _AT_LEAST_1,
    "max_grammar_chars": _AT_LEAST_1,
    "grammar_cache_bytes": _AT_LEAST_1,
    "max_grammar_memory_bytes": _AT_LEAST_1,
    "grammar_compile_timeout": EngineBound(minimum=0, exclusive=True),
    "grammar_compile_workers": _AT_LEAST_1,
    "max_grammar_compiles_per_caller": _AT_LEAST_1,
    "cudagraph_capture_sizes": EngineBound(minimum=1, items=True),
    "max_cudagraph_capture_size": _AT_LEAST_1,
    "max_loras": EngineBound(minimum=1, maximum=256),
    "max_lora_rank": EngineBound(enum=POSSIBLE_MAX_LORA_RANKS),
    "max_cpu_loras": _AT_LEAST_1,
}


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
        bound = ENGINE_BOUNDS.get(f.name)
        problem = bound.problem(typed) if bound else None
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
