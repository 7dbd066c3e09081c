"""Per-role engine arguments: base engine + role override + the role's KV transfer.

Pure functions of the spec. The operator renders pod command lines from
them; ``pdfleet up`` starts local processes from the same arguments. Nothing
here needs the model's files: ``EngineArgs`` are built, never resolved (a
node with the model resolves them when the engine starts).
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any

from ..engine.config import EngineArgs, KVEventsConfig, KVTransferConfig
from .engine_spec import engine_args_from_spec
from .resource import ROLES, AdapterSpec, InferenceServiceSpec, ServingSpec

KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# Where model volumes are mounted in pods.
MODELS_DIR = "/models"
# Where adapters are in pods: pvc:// claims mounted read-only under
# ADAPTERS_DIR/pvc/CLAIM, hf:// downloads linked at ADAPTERS_DIR/hf/KEY.
ADAPTERS_DIR = "/adapters"
# LoRA limits spec.adapters implies when spec.engine leaves them unset. They do
# not depend on how many adapters are listed, so adding one does not change
# the engines' command line (which would restart them).
ADAPTER_DEFAULT_MAX_LORAS = 4
ENGINE_PORT = 8000
# The KV event PUB socket and its replay ROUTER socket on every engine pod.
KV_EVENTS_PORT = 5557
KV_EVENTS_REPLAY_PORT = 5558


@dataclass(frozen=True)
class ModelSource:
    """Where a role finds the model directory."""

    scheme: str
    """builtin, file, pvc or hf."""
    path: str
    """The directory the engine loads (inside the pod for pvc, builtin and hf)."""
    claim: str | None = None
    """PersistentVolumeClaim holding the model (pvc only)."""
    builtin: str | None = None
    """Name of the built-in model (builtin only)."""


def secret_file(
    volume: str, secret: str, key: str, directory: str, filename: str, env: str
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(volume, read-only mount, env var naming the file) for one key of a Secret
    mounted as a file: how every credential reaches a pod (docs/security.md)."""
    return (
        {
            "name": volume,
            "secret": {
                "secretName": secret,
                "items": [{"key": key, "path": filename}],
                "defaultMode": 0o440,
            },
        },
        {"name": volume, "mountPath": directory, "readOnly": True},
        {"name": env, "value": f"{directory}/{filename}"},
    )


def model_source(uri: str) -> ModelSource:
    """Parse a (validated) ``spec.model.uri``."""
    scheme, _, rest = uri.partition("://")
    if scheme == "file":
        return ModelSource("file", rest)
    if scheme == "pvc":
        claim, _, sub = rest.partition("/")
        path = f"{MODELS_DIR}/{claim}" + (f"/{sub.strip('/')}" if sub.strip("/") else "")
        return ModelSource("pvc", path, claim=claim)
    if scheme == "builtin":
        return ModelSource("builtin", f"{MODELS_DIR}/{rest}", builtin=rest)
    if scheme == "hf":
        # The init container links the downloaded snapshot (or prepared GGUF) here.
        return ModelSource("hf", f"{MODELS_DIR}/hf")
    raise ValueError(f"spec.model.uri: unsupported scheme in {uri!r}")


def adapter_key(name: str) -> str:
    """A path component for an adapter name (names may hold '/', ':' or '..')."""
    return hashlib.sha256(name.encode()).hexdigest()[:16]


def adapter_claim(adapter: AdapterSpec) -> str | None:
    """The PersistentVolumeClaim of a pvc:// adapter, else None."""
    scheme, _, rest = adapter.source.partition("://")
    return rest.partition("/")[0] if scheme == "pvc" else None


def adapter_path(adapter: AdapterSpec) -> str:
    """The adapter's directory inside a pod."""
    scheme, _, rest = adapter.source.partition("://")
    if scheme == "file":
        return rest
    if scheme == "pvc":
        claim, _, sub = rest.partition("/")
        return f"{ADAPTERS_DIR}/pvc/{claim}" + (f"/{sub.strip('/')}" if sub.strip("/") else "")
    return f"{ADAPTERS_DIR}/hf/{adapter_key(adapter.name)}"


def lora_extra(
    spec: InferenceServiceSpec, role: str, modules: dict[str, str] | None
) -> dict[str, Any]:
    """The LoRA engine arguments spec.adapters implies: LoRA on (with the
    default limits unless the engine section sets them) and ``modules``
    (name -> directory) loaded at start. Nothing without adapters."""
    if not spec.adapters:
        return {}
    section = role_engine_section(spec, role)
    extra: dict[str, Any] = {"enable_lora": True}
    if section.get("maxLoras") is None:
        # Never above a maxCpuLoras the section sets (it must hold maxLoras).
        cpu = section.get("maxCpuLoras")
        extra["max_loras"] = min(ADAPTER_DEFAULT_MAX_LORAS, cpu or ADAPTER_DEFAULT_MAX_LORAS)
    if modules:
        extra["lora_modules"] = [f"{name}={path}" for name, path in modules.items()]
    return extra


def disaggregating(spec: InferenceServiceSpec) -> bool:
    return spec.disaggregation.mode != "Disabled"


def role_engine_section(spec: InferenceServiceSpec, role: str) -> dict[str, Any]:
    """``spec.engine`` with the role's ``engine`` keys laid over it (key by key)."""
    return {**spec.engine, **spec.role(role).engine}


def connector_extra_config(spec: InferenceServiceSpec) -> dict[str, Any]:
    kv = spec.kv_transfer
    extra: dict[str, Any] = {**kv.extra_config, "lease_seconds": kv.lease_seconds}
    if kv.connector == "NixlConnector":
        extra["backends"] = list(kv.backends)
    if kv.handshake_timeout_seconds is not None:
        extra["handshake_timeout_seconds"] = kv.handshake_timeout_seconds
    if kv.transfer_timeout_seconds is not None:
        extra["transfer_timeout_seconds"] = kv.transfer_timeout_seconds
    return extra


def role_kv_transfer_config(
    spec: InferenceServiceSpec,
    role: str,
    *,
    kv_ip: str | None = None,
    kv_port: int | None = None,
    engine_id: str | None = None,
) -> KVTransferConfig | None:
    """The role's ``kv_transfer_config``: prefill produces KV, decode consumes it;
    an engine that lends its cached blocks does both (``lends``).

    ``None`` when disaggregation is Disabled without peer pulls, or no connector
    is set.
    ``kv_ip``/``kv_port``/``engine_id`` override what the spec gives (the
    operator passes the pod's IP and name; ``pdfleet up`` a free local port).
    """
    if role not in KV_ROLES:
        raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
    kv = spec.kv_transfer
    if not (disaggregating(spec) or peer_pulls(spec, role)) or kv.connector is None:
        return None
    values: dict[str, Any] = {
        "kv_connector": kv.connector,
        "kv_role": "kv_both" if lends(spec, role) else KV_ROLES[role],
        "kv_port": kv.port if kv_port is None else kv_port,
        "kv_connector_extra_config": connector_extra_config(spec),
        "kv_load_failure_policy": kv.load_failure_policy,
        "engine_id": engine_id,
    }
    if kv_ip is not None:
        values["kv_ip"] = kv_ip
    return KVTransferConfig(**values)


def peer_pulls(spec: InferenceServiceSpec, role: str) -> bool:
    """Whether the role's engines lend cached prefixes to each other and pull
    them (``spec.<role>.peerPull``; docs/peer-pull.md): the decode role of an
    aggregated fleet, the prefill role of a disaggregating one."""
    if role not in KV_ROLES or spec.kv_transfer.connector is None:
        return False
    computes_prompts = "prefill" if disaggregating(spec) else "decode"
    return role == computes_prompts and spec.role(role).peer_pull


def lends(spec: InferenceServiceSpec, role: str) -> bool:
    """Whether the role's engines lend the prefix blocks they cache to peers that
    pull them, besides their P/D part (``kv_role: kv_both``): the role whose
    engines pull from each other (``peer_pulls``), and, in a disaggregating fleet
    whose prefill engines pull, the decode engines too. A decode engine holds
    what it decoded (a conversation's last prompt and its answer, which the next
    turn's prompt extends): a prefill engine pulls that instead of computing
    it. The decode engines still consume the prefill legs' KV, and they pull
    from no peer of their own role."""
    if peer_pulls(spec, role):
        return True
    return role == "decode" and disaggregating(spec) and peer_pulls(spec, "prefill")


def moves_kv(spec: InferenceServiceSpec) -> bool:
    """Whether engines of the service exchange KV (a KV connector runs): P/D, or
    peer pulls in an aggregated fleet."""
    return spec.kv_transfer.connector is not None and (
        disaggregating(spec) or peer_pulls(spec, "decode")
    )


# Leading prompt blocks the gateway hashes when peer pulls are on: a lend covers at
# most these (4096 tokens at 16 per block).
PEER_PULL_PREFIX_BLOCKS = 256


def gateway_peer_pull_settings(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The gateway's peer-pull flags (``GatewayConfig`` keyword arguments)."""
    if not (peer_pulls(spec, "decode") or peer_pulls(spec, "prefill")):
        return {}
    return {"peer_pull": True, "prefix_blocks": PEER_PULL_PREFIX_BLOCKS}


def publishes_kv_events(spec: InferenceServiceSpec, role: str) -> bool:
    """Whether the fleet turns on the role's KV event publisher for the
    gateway's exact prefix index (docs/kv_events.md): ``spec.gateway.kvEvents``
    is on, the role's prefix cache is not turned off, and the engine section
    does not configure ``kvEventsConfig`` itself (then the user's settings
    stand, and the gateway learns nothing from the fleet)."""
    section = role_engine_section(spec, role)
    return (
        spec.gateway.kv_events
        and section.get("enablePrefixCaching") is not False
        and section.get("kvEventsConfig") is None
    )


def role_engine_args(
    spec: InferenceServiceSpec,
    role: str,
    *,
    model_path: str | None = None,
    kv_ip: str | None = None,
    kv_port: int | None = None,
    engine_id: str | None = None,
    kv_events: tuple[str, str] | None = None,
    adapters: list[AdapterSpec] | None = None,
    adapter_paths: dict[str, str] | None = None,
) -> EngineArgs:
    """The role's complete ``EngineArgs`` (not resolved against the model).

    ``adapters``: the adapters loaded at start (default spec.adapters; a
    pod template may hold the list it was first rendered with), at
    :func:`adapter_path` unless ``adapter_paths`` (name -> local directory,
    ``pdfleet up``) says otherwise.

    ``model_path`` defaults to where the pod sees the model
    (:func:`model_source`); ``pdfleet up`` passes a local directory.
    ``kv_events``: the (PUB, replay) endpoints the engine binds when
    :func:`publishes_kv_events`; ``tcp://*`` on the fixed pod ports when None.
    """
    section = role_engine_section(spec, role)
    extra: dict[str, Any] = {}
    if publishes_kv_events(spec, role):
        pub, replay = kv_events or (
            f"tcp://*:{KV_EVENTS_PORT}",
            f"tcp://*:{KV_EVENTS_REPLAY_PORT}",
        )
        extra["kv_events_config"] = KVEventsConfig(
            enable_kv_cache_events=True, endpoint=pub, replay_endpoint=replay
        )
    path = model_path if model_path is not None else model_source(spec.model.uri).path
    modules = {
        a.name: (adapter_paths or {}).get(a.name) or adapter_path(a)
        for a in (spec.adapters if adapters is None else adapters)
    }
    where = "spec.engine" if not spec.role(role).engine else f"spec.engine + spec.{role}.engine"
    return engine_args_from_spec(
        section,
        path=where,
        model=path,
        served_model_name=[spec.model.name],
        revision=spec.model.revision,
        kv_transfer_config=role_kv_transfer_config(
            spec, role, kv_ip=kv_ip, kv_port=kv_port, engine_id=engine_id
        ),
        **extra,
        **lora_extra(spec, role, modules),
    )


def gateway_request_bounds(spec: InferenceServiceSpec) -> dict[str, Any]:
    """The gateway's ``max_n`` and ``max_request_output_tokens``: the smallest
    any engine role has, so the gateway refuses (400) what an engine would,
    before a prefill leg runs."""
    roles = ("decode",) if not disaggregating(spec) else ROLES
    args = [role_engine_args(spec, role) for role in roles]
    return {
        "max_n": min(a.max_n for a in args),
        "max_request_output_tokens": min(a.max_request_output_tokens for a in args),
    }


def serving_flags(serving: ServingSpec | None) -> list[str]:
    """``spec.serving`` as ``pdfleet serve`` server flags (docs/tool_calling.md);
    an inline chat template is passed as the flag's value (``--chat-template``
    takes a template's text as well as a file's path)."""
    if serving is None:
        return []
    flags: list[str] = []
    if serving.chat_template is not None:
        flags += ["--chat-template", serving.chat_template]
    if serving.tool_call_parser is not None:
        flags += ["--tool-call-parser", serving.tool_call_parser]
    if serving.reasoning_parser is not None:
        flags += ["--reasoning-parser", serving.reasoning_parser]
    if serving.enable_auto_tool_choice is not None:
        # Unset leaves the model directory's default (docs/tool_calling.md).
        on = serving.enable_auto_tool_choice
        flags.append("--enable-auto-tool-choice" if on else "--no-enable-auto-tool-choice")
    return flags


def engine_command(
    args: EngineArgs,
    *,
    host: str = "0.0.0.0",  # noqa: S104 (an engine pod serves every interface)
    port: int = ENGINE_PORT,
    serving: ServingSpec | None = None,
) -> list[str]:
    """``pdfleet serve MODEL ...flags`` for one engine: the model positional,
    then the non-default flags (``--kv-transfer-config`` JSON included), then
    the server flags of ``serving`` (``spec.serving``)."""
    flags = dataclasses.replace(args, model="").to_cli_args()
    return [
        "pdfleet",
        "serve",
        args.model,
        *flags,
        *serving_flags(serving),
        "--host",
        host,
        "--port",
        str(port),
    ]


GPU_RESOURCE = "nvidia.com/gpu"
ENV_UCX_TLS = "UCX_TLS"


def requests_gpus(resources: dict[str, Any], accelerator: str = GPU_RESOURCE) -> bool:
    """Whether a container's rendered ``resources`` ask for at least one GPU."""
    counts = [str(r.get(accelerator, "0")) for r in resources.values() if isinstance(r, dict)]
    return any(c not in ("0", "") for c in counts)


def ucx_env(
    spec: InferenceServiceSpec, role: str, resources: dict[str, Any]
) -> list[dict[str, str]]:
    """UCX transports for KV in GPU memory, for a NIXL engine pod whose rendered
    ``resources`` hold GPUs (``kvTransfer.ucxTransports``), unless the role sets
    ``UCX_TLS`` itself. Without GPUs UCX keeps its own choice (host memory:
    shared memory, TCP)."""
    role_spec = spec.role(role)
    gpus = requests_gpus(resources, role_spec.accelerator_resource)
    if spec.kv_transfer.connector != "NixlConnector" or not gpus:
        return []
    if any(e.get("name") == ENV_UCX_TLS for e in role_spec.env):
        return []
    return [{"name": ENV_UCX_TLS, "value": spec.kv_transfer.ucx_transports}]


def rdma_resources(spec: InferenceServiceSpec) -> dict[str, str]:
    """The RDMA device an engine pod requests (limits and requests alike), if any."""
    rdma = spec.kv_transfer.rdma_resource
    return {rdma: "1"} if rdma and spec.kv_transfer.connector == "NixlConnector" else {}


def added_capabilities(spec: InferenceServiceSpec) -> list[str]:
    """Linux capabilities an engine container adds to none: ``IPC_LOCK`` (to pin
    memory for RDMA registration) when the pods get an RDMA device."""
    return ["IPC_LOCK"] if rdma_resources(spec) else []
