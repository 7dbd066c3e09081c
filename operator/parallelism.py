"""Tensor parallelism and multi-node replicas in Kubernetes (docs/parallelism-k8s.md).

Pure functions of the spec: how many ranks a role's engine runs and over how
many pods, the accelerators and ``/dev/shm`` each pod gets, the NCCL
environment defaults, the rendezvous flags of leader and worker pods, and the
rules a layout must follow (checked by :func:`pdfleet.operator.compat.check_service`).

One replica of a role is one engine with ``tensorParallelSize`` ranks. With
``nodesPerReplica: 1`` (the default) the engine is one pod of a Deployment
and starts its rank processes itself. With ``nodesPerReplica: K > 1`` the
replica is a LeaderWorkerSet group of K pods, ``tensorParallelSize / K``
ranks each: the leader pod (worker index 0) runs the API server, the
scheduler and the first ranks; the K - 1 worker pods run only ranks and
join the leader's ``torch.distributed`` rendezvous at the address the
LeaderWorkerSet controller gives every pod.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..engine.config import EngineArgs
from ..engine.contracts import pod_labels
from .resource import InferenceServiceSpec, RoleSpec

# Environment the LeaderWorkerSet controller sets in every container of a group.
ENV_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
ENV_GROUP_SIZE = "LWS_GROUP_SIZE"
ENV_WORKER_INDEX = "LWS_WORKER_INDEX"
# The leader's torch.distributed rendezvous (TCPStore) port.
RENDEZVOUS_PORT = 29500
# Pod label of multi-node roles: which pod of its group a pod is. The gateway
# routes to leaders only; the operator scrapes leaders only.
LABEL_GROUP_ROLE = pod_labels.LABEL_GROUP_ROLE
LEADER, WORKER = "leader", "worker"
# Memory-backed /dev/shm: enough for the tokenizer pool and UCX with one rank
# per pod; NCCL's shared-memory transport between the ranks of one pod wants
# a few GiB per rank.
SHM_ONE_RANK = "1Gi"
SHM_GIB_PER_RANK = 4
# NCCL/torch.distributed defaults of pods running more than one rank. A key of
# the role's `env` with the same name replaces the default.
NCCL_ENV = (
    # NCCL's warnings and errors reach the pod log (a failed all-reduce says why).
    ("NCCL_DEBUG", "WARN"),
)
# Multi-node groups also bootstrap over the pod network: pin NCCL's and gloo's
# sockets to the pod's interface (eth0 with nearly every CNI plugin).
MULTI_NODE_ENV = (
    ("NCCL_SOCKET_IFNAME", "eth0"),
    ("GLOO_SOCKET_IFNAME", "eth0"),
)
# Shapes of the built-in models (the same as pdfleet.engine.tiny; a test keeps
# them equal): (attention heads, KV heads, MLP intermediate size).
BUILTIN_HEADS = {"tiny": (4, 2, 192), "smollm2-135m-instruct": (9, 3, 1536)}
# The LeaderWorkerSet controller names a group's worker StatefulSet
# NAME-ROLE-GROUP and the StatefulSet controller labels its pods with
# that name plus an 11-character revision suffix, within 63 characters.
MAX_GROUP_SET_NAME = 63 - 11


@dataclass(frozen=True)
class RoleLayout:
    """How one replica of a role spreads over pods."""

    tensor_parallel_size: int
    nodes: int
    """Pods per replica (``nodesPerReplica``)."""

    @property
    def ranks_per_pod(self) -> int:
        return max(1, self.tensor_parallel_size // self.nodes)

    @property
    def multi_node(self) -> bool:
        return self.nodes > 1


@dataclass(frozen=True)
class ModelHeads:
    """The model dimensions that tensor parallelism splits."""

    num_attention_heads: int
    num_key_value_heads: int
    source: str
    """Where they were read (said in error messages)."""
    intermediate_size: int = 0
    """The MLP's width, split by the column-parallel gate/up (0: not known)."""


def role_layout(role_spec: RoleSpec, args: EngineArgs) -> RoleLayout:
    return RoleLayout(args.tensor_parallel_size, role_spec.nodes_per_replica)


def uses_accelerators(args: EngineArgs) -> bool:
    return args.device != "cpu"


def accelerators_per_pod(role_spec: RoleSpec, args: EngineArgs) -> int | None:
    """Accelerators the operator requests per pod, or None to leave the
    resources as written (CPU engines; one rank without an accelerator asked for)."""
    if not uses_accelerators(args):
        return None
    layout = role_layout(role_spec, args)
    asked = role_spec.accelerator_resource in {
        **role_spec.resources.limits,
        **role_spec.resources.requests,
    }
    if layout.tensor_parallel_size == 1 and not layout.multi_node and not asked:
        return None
    return layout.ranks_per_pod


def pod_resources(role_spec: RoleSpec, args: EngineArgs) -> dict[str, Any]:
    """The main container's resources, with the accelerator count set."""
    out: dict[str, Any] = {}
    limits = dict(role_spec.resources.limits)
    requests = dict(role_spec.resources.requests)
    count = accelerators_per_pod(role_spec, args)
    if count is not None:
        # Extended resources cannot be overcommitted: request and limit are equal.
        limits[role_spec.accelerator_resource] = count
        if requests:
            requests[role_spec.accelerator_resource] = count
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def shm_size(role_spec: RoleSpec, args: EngineArgs) -> int | str:
    if role_spec.shm_size is not None:
        return role_spec.shm_size
    ranks = role_layout(role_spec, args).ranks_per_pod
    return SHM_ONE_RANK if ranks == 1 else f"{SHM_GIB_PER_RANK * ranks}Gi"


def parallel_env(
    role_spec: RoleSpec, args: EngineArgs, user_env: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """NCCL/gloo defaults for the role's pods, less the names ``user_env`` sets."""
    layout = role_layout(role_spec, args)
    defaults: list[tuple[str, str]] = []
    if layout.tensor_parallel_size > 1:
        defaults += NCCL_ENV
    if layout.multi_node:
        defaults += MULTI_NODE_ENV
    taken = {e.get("name") for e in user_env}
    return [{"name": k, "value": v} for k, v in defaults if k not in taken]


def rendezvous_flags(layout: RoleLayout, group_role: str) -> list[str]:
    """The engine flags of one pod of a multi-node group (docs/parallelism-k8s.md).

    Every pod names the group size and the leader's rendezvous address; the
    leader is node rank 0, a worker takes its index in the group and runs no
    API server (``--headless``).
    """
    rank = "0" if group_role == LEADER else f"$({ENV_WORKER_INDEX})"
    flags = [
        "--nnodes",
        str(layout.nodes),
        "--node-rank",
        rank,
        "--master-addr",
        f"$({ENV_LEADER_ADDRESS})",
        "--master-port",
        str(RENDEZVOUS_PORT),
    ]
    if group_role == WORKER:
        flags.append("--headless")
    return flags


def builtin_heads(uri: str) -> ModelHeads | None:
    scheme, _, name = uri.partition("://")
    if scheme != "builtin" or name not in BUILTIN_HEADS:
        return None
    heads, kv_heads, intermediate = BUILTIN_HEADS[name]
    return ModelHeads(heads, kv_heads, f"the built-in model {name}", intermediate)


def local_model_heads(spec: InferenceServiceSpec) -> ModelHeads | None:
    """Head counts from a ``file://`` model directory present on this machine
    (``pdfleet render`` beside the model); None when it is not here."""
    scheme, _, path = spec.model.uri.partition("://")
    if scheme != "file" or not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from ..engine.config.model import load_hf_config

    try:
        hf = load_hf_config(path, spec.engine.get("hfOverrides") or None)
    except Exception:  # a broken config: the engine says what is wrong when it starts
        return None
    heads = int(hf.get("num_attention_heads") or 0)
    if heads <= 0:
        return None
    kv_heads = int(hf.get("num_key_value_heads") or heads)
    intermediate = int(hf.get("intermediate_size") or 0)
    return ModelHeads(heads, kv_heads, f"{path}/config.json", intermediate)


def heads_problem(tp: int, heads: ModelHeads) -> str | None:
    """Why ``tp`` ranks cannot split the model, or None when they can.

    Attention heads are split evenly; KV heads are split evenly too, or
    replicated when there are fewer KV heads than ranks (then the ranks must
    be a multiple of them); the MLP's intermediate size is split evenly (the
    engine makes the same checks when it starts)."""
    if heads.num_attention_heads % tp:
        return (
            f"{tp} ranks cannot split the {heads.num_attention_heads} attention heads of "
            f"{heads.source} evenly"
        )
    kv = heads.num_key_value_heads
    if kv % tp and tp % kv:
        return (
            f"{tp} ranks cannot split or replicate the {kv} KV heads of {heads.source} "
            "(the ranks must divide them, or be a multiple of them)"
        )
    if heads.intermediate_size and heads.intermediate_size % tp:
        return (
            f"{tp} ranks cannot split the MLP intermediate size {heads.intermediate_size} "
            f"of {heads.source} evenly"
        )
    return None


def divisors_of(heads: ModelHeads) -> list[int]:
    """The TP sizes that work for ``heads``."""
    n = heads.num_attention_heads
    return [tp for tp in range(1, n + 1) if heads_problem(tp, heads) is None]


def engine_threads(cores: int, engines: int) -> int:
    """Torch threads for each of ``engines`` CPU engines (or ranks of one pod) on
    ``cores`` cores (``pdfleet up``'s machine, or a pod's CPU limit).

    At least one core is left to the gateway and the engines' own front ends
    (their HTTP servers and engine threads; vLLM's CPU backend also keeps one
    core out of its OpenMP threads): torch's OpenMP threads spin at every
    barrier, so an engine whose threads fill every core stalls whenever the
    gateway or a client takes one of them, and its steps run several times
    slower under load than with one thread fewer. The price is a lone
    request's speed on an idle machine (a long prompt's first token about
    1.5-1.8 times later on one thread than on two)."""
    return max(1, (cores - 1) // max(1, engines))
