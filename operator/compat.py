"""What prefill and decode must agree on: cross-role checks and the compatibility hash.

Checked before anything runs (docs/operator.md, "Checks"). A violation names the field, the
problem and the fix; the operator turns violations into a ``Ready=False``
condition and events, ``pdfleet up`` and ``pdfleet render`` into an error.

Every rule the API server can check is a CEL rule of the CRD, so it refuses
the object at admission; its local twin is a validator of the resource model
(``pdfleet.operator.resource``), or, for two of them, a rule here: the
connector a disaggregated fleet needs (listed with the other violations,
where a model validator would stop parsing first) and a multi-node role's
worker set names (they need ``metadata.name``, which the spec model does not
see). What is left here needs more than CEL can give:

- the engine's own checks run on the merged ``EngineArgs`` (unsupported
  features, the LoRA flags, the KV cache's settings together), so that a
  spec meets exactly what ``pdfleet serve`` would refuse;
- ``hfOverrides`` of the two roles must match: it is a free-form object,
  whose unknown fields CEL cannot read (and whose size it cannot bound);
- the tensor-parallel layout against the model's head counts (needs the
  model's configuration), against the pods' accelerator requests (Kubernetes
  quantities, compared as the operator renders them, against a count from
  the merged engine arguments).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..engine.config import UNSUPPORTED, CacheConfig, EngineArgs
from ..engine.config.cache import DEFAULT_BLOCK_SIZE
from ..engine.config.hashing import hash_factors
from .engine_spec import camel
from .parallelism import (
    MAX_GROUP_SET_NAME,
    ModelHeads,
    accelerators_per_pod,
    builtin_heads,
    divisors_of,
    heads_problem,
    role_layout,
)
from .resource import ROLES, InferenceServiceSpec
from .roles import disaggregating, role_engine_args

# Engine settings whose values decide the shape and meaning of KV blocks.
MUST_MATCH = (
    ("block_size", "KV blocks move between the roles block by block"),
    ("kv_cache_dtype", "KV bytes are copied as they are, without conversion"),
    ("dtype", "both roles must compute the same activations"),
    ("hf_overrides", "both roles must run the same model architecture"),
)
# Settings the resource accepts although the engine's own check refuses them
# today: the operator renders them for engines that implement them.
ALLOWED_IN_SPEC = frozenset({"tensor_parallel_size"})


@dataclass(frozen=True)
class Violation:
    """One broken rule: the field, what is wrong, and what to change."""

    field: str
    problem: str
    fix: str

    def __str__(self) -> str:
        return f"{self.field}: {self.problem}; {self.fix}"


def _where(spec: InferenceServiceSpec, role: str, key: str) -> str:
    return f"spec.{role}.engine.{key}" if key in spec.role(role).engine else f"spec.engine.{key}"


def _role_args(spec: InferenceServiceSpec) -> dict[str, EngineArgs]:
    # A fixed engine id keeps the arguments free of per-call randomness.
    return {role: role_engine_args(spec, role, engine_id="check") for role in ROLES}


def _check_engine(spec: InferenceServiceSpec, role: str, args: EngineArgs) -> list[Violation]:
    out = []
    for name, unused, what in UNSUPPORTED:
        value = getattr(args, name)
        if value != unused and name not in ALLOWED_IN_SPEC:
            key = camel(name)
            out.append(
                Violation(
                    _where(spec, role, key),
                    f"{what} is not supported by pdfleet (got {value!r})",
                    f"remove {key}",
                )
            )
    try:
        args.create_lora_config()
    except ValueError as e:
        flag = re.search(r"--([a-z-]+)", str(e))
        key = camel(flag.group(1).replace("-", "_")) if flag else "enableLora"
        fix = (
            f"drop {key}, or list spec.adapters (which turns LoRA on)"
            if not args.enable_lora and flag
            else "fix the LoRA fields"
        )
        out.append(Violation(_where(spec, role, key), str(e), fix))
    try:
        CacheConfig(
            block_size=args.block_size or DEFAULT_BLOCK_SIZE,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            cache_dtype=args.kv_cache_dtype,
            num_gpu_blocks_override=args.num_gpu_blocks_override,
            prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        )
    except ValueError as e:
        out.append(Violation(f"spec.{role}.engine", str(e), "change the value named"))
    return out


def _check_cross_role(spec: InferenceServiceSpec, args: dict[str, EngineArgs]) -> list[Violation]:
    out = []
    prefill, decode = args["prefill"], args["decode"]
    # The other MUST_MATCH settings are the resource model's (and the CRD's) rules.
    p, d = prefill.hf_overrides, decode.hf_overrides
    if p != d:
        role = "decode" if "hfOverrides" in spec.decode.engine else "prefill"
        out.append(
            Violation(
                _where(spec, role, "hfOverrides"),
                f"prefill has {p!r} but decode has {d!r} ({dict(MUST_MATCH)['hf_overrides']})",
                "set hfOverrides once in spec.engine, not per role",
            )
        )
    # Tensor parallelism may differ between the roles, in both directions:
    # each decode rank reads its KV heads' slice from the prefill ranks holding
    # them (docs/kv_transfer.md).
    return out


def _check_connector(spec: InferenceServiceSpec) -> list[Violation]:
    # Also a CEL rule of the CRD. Not a model validator: the model's validators
    # stop parsing before these checks run, and this one is listed with them
    # (``pdfleet render`` prints every violation at once).
    if disaggregating(spec) and spec.kv_transfer.connector is None:
        return [
            Violation(
                "spec.kvTransfer.connector",
                f"no KV connector while disaggregation.mode is {spec.disaggregation.mode} "
                "(decode engines would silently recompute every prompt)",
                "set kvTransfer.connector to NixlConnector or ZmqConnector, "
                "or set disaggregation.mode: Disabled",
            )
        ]
    return []


def _check_layout(
    spec: InferenceServiceSpec,
    role: str,
    args: EngineArgs,
    heads: ModelHeads | None,
    name: str | None,
) -> list[Violation]:
    """Tensor parallelism over the role's pods (docs/parallelism-k8s.md)."""
    out: list[Violation] = []
    role_spec = spec.role(role)
    layout = role_layout(role_spec, args)
    tp_field = _where(spec, role, "tensorParallelSize")
    if layout.tensor_parallel_size < 1:
        return out  # refused by the resource model (the field's bound)
    if layout.tensor_parallel_size % layout.nodes:
        out.append(
            Violation(
                f"spec.{role}.nodesPerReplica",
                f"{layout.nodes} pods cannot hold {layout.tensor_parallel_size} tensor-parallel "
                "ranks evenly (every pod of a group runs the same number of ranks)",
                f"make {tp_field} a multiple of nodesPerReplica",
            )
        )
    if heads is not None:
        problem = heads_problem(layout.tensor_parallel_size, heads)
        if problem is not None:
            sizes = ", ".join(str(n) for n in divisors_of(heads))
            out.append(Violation(tp_field, problem, f"use one of {sizes}"))
    count = accelerators_per_pod(role_spec, args)
    resource = role_spec.accelerator_resource
    for kind in ("limits", "requests"):
        asked = getattr(role_spec.resources, kind).get(resource)
        if count is not None and asked is not None and str(asked) != str(count):
            out.append(
                Violation(
                    f"spec.{role}.resources.{kind}.{resource}",
                    f"asks for {asked} per pod but each pod runs {count} ranks "
                    f"({tp_field} {layout.tensor_parallel_size} over "
                    f"{layout.nodes} pod(s))",
                    f"remove it (the operator requests {count}) or change {tp_field}",
                )
            )
    if layout.multi_node and name is not None:
        longest = f"{name}-{role}-{max(0, _max_groups(spec, role) - 1)}"
        if len(longest) > MAX_GROUP_SET_NAME:
            out.append(
                Violation(
                    "metadata.name",
                    f"{name!r} is too long for multi-node groups (their worker sets are named "
                    f"like {longest!r}, at most {MAX_GROUP_SET_NAME} characters)",
                    "use a shorter name",
                )
            )
    return out


def _max_groups(spec: InferenceServiceSpec, role: str) -> int:
    replicas = spec.role(role).replicas
    if spec.autoscaling is not None:
        replicas = max(replicas, getattr(spec.autoscaling, role).max_replicas)
    return replicas


def check_service(
    spec: InferenceServiceSpec, *, heads: ModelHeads | None = None, name: str | None = None
) -> list[Violation]:
    """Every rule the spec breaks (empty when it can run). Pure; needs no model files.

    The model's head counts are known for built-in models; a caller that can
    read the model's configuration passes ``heads`` (``pdfleet render`` beside a
    local model directory); otherwise the engine checks them when it starts.
    ``name`` (the object's) adds the rules on child names.
    """
    violations = _check_connector(spec)
    args = _role_args(spec)
    heads = heads or builtin_heads(spec.model.uri)
    for role in ROLES:
        if role == "prefill" and not disaggregating(spec):
            continue  # no prefill pods run
        violations += _check_engine(spec, role, args[role])
        violations += _check_layout(spec, role, args[role], heads, name)
    if disaggregating(spec):
        violations += _check_cross_role(spec, args)
    # Both roles inherit spec.engine: report a shared problem once.
    return list(dict.fromkeys(violations))


def compat_factors(spec: InferenceServiceSpec) -> dict[str, Any]:
    """What two engines must share to exchange KV (decode's values; checks make
    prefill's equal)."""
    decode = role_engine_args(spec, "decode", engine_id="check")
    kv = spec.kv_transfer if disaggregating(spec) else None
    return {
        "model": spec.model.uri,
        "revision": spec.model.revision,
        **{name: getattr(decode, name) for name, _ in MUST_MATCH},
        "block_size": decode.block_size or DEFAULT_BLOCK_SIZE,
        "connector": kv.connector if kv else None,
    }


def compat_hash(spec: InferenceServiceSpec) -> str:
    """Stable 10-hex-digit hash of :func:`compat_factors`; stamped on pods as a
    label so the gateway pairs only engines with equal hashes."""
    return hash_factors(compat_factors(spec))
