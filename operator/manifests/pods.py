"""Pod templates: the engine pods' and the gateway's, with their volumes, probes and init steps."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from ...engine.config import EngineArgs
from ...engine.config.gateway import (
    BATCH_DATABASE_ENV,
    KV_EVENTS_PORT_ANNOTATION,
    KV_REPLAY_PORT_ANNOTATION,
    GatewayConfig,
)
from ...engine.config.hashing import hash_factors
from ...engine.contracts import identity_exchange as exchange
from ...engine.contracts.identity import IDENTITY_AUTHORITY_ENV
from ...engine.contracts.security import FLEET_SECRET_FILE_ENV
from ..model_source import InitStep, model_volumes, pod_volumes
from ..parallelism import (
    LABEL_GROUP_ROLE,
    WORKER,
    engine_threads,
    parallel_env,
    pod_resources,
    rendezvous_flags,
    role_layout,
    shm_size,
)
from ..resource import (
    AdapterSpec,
    GatewayBatchSpec,
    InferenceServiceSpec,
    PodPlacement,
    TenantsSource,
)
from ..roles import (
    ENGINE_PORT,
    KV_EVENTS_PORT,
    KV_EVENTS_REPLAY_PORT,
    adapter_claim,
    added_capabilities,
    disaggregating,
    engine_command,
    gateway_peer_pull_settings,
    gateway_request_bounds,
    lends,
    model_source,
    publishes_kv_events,
    rdma_resources,
    secret_file,
    ucx_env,
)
from .common import (
    ANNOTATION_ADAPTERS,
    ANNOTATION_ADAPTERS_KEY,
    ANNOTATION_FLEET_SECRET,
    ANNOTATION_IDENTITY,
    ANNOTATION_IDENTITY_ROLE,
    API_KEY_DIR,
    ENV_API_KEY_FILE,
    ENV_KV_IP,
    ENV_POD_NAME,
    ENV_UCX_PORT_RANGE,
    FLEET_SECRET_DIR,
    FLEET_SECRET_KEY,
    GATEWAY_DATA_DIR,
    GRACE_MARGIN_SECONDS,
    IDENTITY_AUTHORITY_KEY,
    IDENTITY_CA_KEY,
    IDENTITY_DIR,
    IDENTITY_ENDPOINT_KEY,
    IDENTITY_SA_TOKEN_SECONDS,
    LABEL_COMPAT,
    LABEL_SERVICE,
    RUN_AS_USER,
    STARTUP_FAILURES,
    STARTUP_PERIOD_SECONDS,
    TENANTS_DIR,
    child_name,
    common_labels,
    engine_service_account_name,
    fleet_secret_name,
    identity_configmap_name,
    identity_enabled,
    pod_engine_args,
    pod_serving,
    ucx_port_range,
)


def _pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _container_security_context(add: list[str] | None = None) -> dict[str, Any]:
    capabilities: dict[str, list[str]] = {"drop": ["ALL"]}
    if add:
        capabilities["add"] = list(add)
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": capabilities,
    }


def _model_volumes(
    spec: InferenceServiceSpec,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[InitStep]]:
    """(volumes, read-only mounts for the main container, init steps)."""
    parts = model_volumes(spec.model)
    return parts.volumes, parts.mounts, parts.init


def _init_containers(
    image: str, steps: list[InitStep], main_resources: dict[str, Any]
) -> list[dict[str, Any]]:
    # The model writer runs before the main container: it may use the same CPU and
    # memory (the pod's request does not grow), never its accelerators.
    resources = {
        kind: {k: v for k, v in amounts.items() if k in ("cpu", "memory")}
        for kind, amounts in main_resources.items()
    }
    resources = {kind: amounts for kind, amounts in resources.items() if amounts}
    return [
        {
            "name": step.name,
            "image": image,
            "imagePullPolicy": "IfNotPresent",
            "command": list(step.command),
            "env": [{"name": "HOME", "value": "/tmp"}, *step.env],
            "volumeMounts": [*step.mounts, {"name": "tmp", "mountPath": "/tmp"}],
            "securityContext": _container_security_context(),
            **({"resources": resources} if resources else {}),
        }
        for step in steps
    ]


def _resources(placement: PodPlacement) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if placement.resources.limits:
        out["limits"] = dict(placement.resources.limits)
    if placement.resources.requests:
        out["requests"] = dict(placement.resources.requests)
    return out


def _placement(placement: PodPlacement) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if placement.node_selector:
        out["nodeSelector"] = dict(placement.node_selector)
    if placement.tolerations:
        out["tolerations"] = [dict(t) for t in placement.tolerations]
    if placement.affinity:
        out["affinity"] = dict(placement.affinity)
    return out


def _fleet_secret_volume(name: str) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(volume, read-only mount, env var) of the fleet secret file."""
    return secret_file(
        "fleet-secret",
        fleet_secret_name(name),
        FLEET_SECRET_KEY,
        FLEET_SECRET_DIR,
        "secret",
        FLEET_SECRET_FILE_ENV,
    )


def _template_annotations(secret_version: str | None) -> dict[str, Any]:
    if secret_version is None:
        return {}
    return {"annotations": {ANNOTATION_FLEET_SECRET: secret_version}}


def _probe(path: str, *, period: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period,
        "timeoutSeconds": 5,
        "failureThreshold": failures,
    }


def _probes() -> dict[str, Any]:
    # The server answers /health only once the model is loaded, so readiness
    # (and liveness, which starts after the startup probe) never see a loading pod.
    return {
        "startupProbe": _probe("/health", period=STARTUP_PERIOD_SECONDS, failures=STARTUP_FAILURES),
        "readinessProbe": _probe("/health", period=5, failures=3),
        "livenessProbe": _probe("/health", period=10, failures=6),
    }


def termination_grace_seconds(spec: InferenceServiceSpec, role: str, args: EngineArgs) -> int:
    """At least the engine's drain time; a prefill engine also waits out the KV
    lease so a decode engine can still pull the blocks it holds."""
    drain = float(args.shutdown_timeout)
    if role == "prefill" and disaggregating(spec):
        drain = max(drain, spec.kv_transfer.lease_seconds)
    return math.ceil(drain) + GRACE_MARGIN_SECONDS


def pod_shaping_adapters(adapters: list[AdapterSpec]) -> list[AdapterSpec]:
    """The adapters that change an engine pod beyond its --lora-modules: one
    pvc:// adapter per claim (a volume). The others can be loaded into a
    running engine: file://, more pvc:// adapters on a mounted claim, and
    hf:// ones, which the engine downloads itself (its container has the
    cache, token and endpoint whenever spec.adapters is set)."""
    claims: set[str] = set()
    out = []
    for adapter in adapters:
        claim = adapter_claim(adapter)
        if claim is not None and claim not in claims:
            out.append(adapter)
        if claim is not None:
            claims.add(claim)
    return out


def template_adapters(template: Mapping[str, Any] | None) -> tuple[str, list[AdapterSpec]] | None:
    """(key, adapters) a live engine pod template was rendered with (its
    annotations), or None (no adapters, or annotations it cannot read)."""
    annotations = ((template or {}).get("metadata") or {}).get("annotations") or {}
    key, listed = annotations.get(ANNOTATION_ADAPTERS_KEY), annotations.get(ANNOTATION_ADAPTERS)
    if not isinstance(key, str) or not isinstance(listed, str):
        return None
    try:
        items = json.loads(listed)
        return key, [AdapterSpec.model_validate(a, by_name=False) for a in items]
    except (ValueError, TypeError, ValidationError):
        return None


def engine_pod_template(
    name: str,
    spec: InferenceServiceSpec,
    role: str,
    *,
    image: str,
    compat: str,
    secret_version: str | None = None,
    group_role: str | None = None,
    identity_version: str | None = None,
    live: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """One engine pod; ``group_role`` (``leader`` or ``worker``) for a pod of a
    multi-node group: a worker runs ranks only (no API server, no probes).
    ``identity_version``: the identity authority's fingerprint (a new authority
    rolls the pods, which read it once, at start).

    ``live``: the role's pod template as it runs now. Its adapters (annotated)
    stay in the new template when the two differ in nothing but adapters the
    operator loads into running engines (:func:`pod_shaping_adapters`): the
    template, and so the pods, stay the same, and the operator loads and
    unloads the difference through each engine's API. Any other change
    renders spec.adapters, and the new pods start with all of them."""
    kwargs: dict[str, Any] = {
        "image": image,
        "compat": compat,
        "secret_version": secret_version,
        "group_role": group_role,
        "identity_version": identity_version,
    }
    if not spec.adapters:
        return _engine_pod_template(name, spec, role, adapters=[], **kwargs)
    base = _engine_pod_template(
        name, spec, role, adapters=pod_shaping_adapters(spec.adapters), **kwargs
    )
    key = hash_factors(base, length=16)
    running = template_adapters(live)
    adapters = running[1] if running is not None and running[0] == key else spec.adapters
    template = _engine_pod_template(name, spec, role, adapters=adapters, **kwargs)
    template["metadata"].setdefault("annotations", {}).update(
        {
            ANNOTATION_ADAPTERS_KEY: key,
            ANNOTATION_ADAPTERS: json.dumps(
                [a.model_dump(by_alias=True, exclude_none=True) for a in adapters],
                separators=(",", ":"),
            ),
        }
    )
    return template


def _engine_pod_template(
    name: str,
    spec: InferenceServiceSpec,
    role: str,
    *,
    adapters: list[AdapterSpec],
    image: str,
    compat: str,
    secret_version: str | None = None,
    group_role: str | None = None,
    identity_version: str | None = None,
) -> dict[str, Any]:
    """One engine pod, starting with ``adapters``."""
    role_spec = spec.role(role)
    args = pod_engine_args(spec, role, adapters=adapters)
    layout = role_layout(role_spec, args)
    parts = pod_volumes(spec.model, adapters, hub=bool(spec.adapters))
    volumes, model_mounts, model_steps = parts.volumes, parts.mounts, parts.init
    secret_volume, secret_mount, secret_env = _fleet_secret_volume(name)
    ports = []
    annotations: dict[str, str] = {}
    if group_role != WORKER:
        ports.append({"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"})
        if publishes_kv_events(spec, role):
            ports += [
                {"name": "kv-events", "containerPort": KV_EVENTS_PORT, "protocol": "TCP"},
                {"name": "kv-replay", "containerPort": KV_EVENTS_REPLAY_PORT, "protocol": "TCP"},
            ]
            # How the gateway finds the streams (engine/gateway/discovery.py).
            annotations = {
                KV_EVENTS_PORT_ANNOTATION: str(KV_EVENTS_PORT),
                KV_REPLAY_PORT_ANNOTATION: str(KV_EVENTS_REPLAY_PORT),
            }
    kv_env: list[dict[str, Any]] = []
    if args.kv_transfer_config is not None:
        ports.append({"name": "kv", "containerPort": spec.kv_transfer.port, "protocol": "TCP"})
        if spec.kv_transfer.connector == "NixlConnector":
            first, last = ucx_port_range(spec)
            kv_env.append({"name": ENV_UCX_PORT_RANGE, "value": f"{first}-{last}"})
            kv_env.extend(ucx_env(spec, role, pod_resources(role_spec, args)))
    identity_volumes: list[dict[str, Any]] = []
    identity_mounts: list[dict[str, Any]] = []
    if args.kv_transfer_config is not None and group_role != WORKER and identity_enabled(spec):
        volume, mount, identity_env = engine_identity_parts(name)
        identity_volumes.append(volume)
        identity_mounts.append(mount)
        kv_env.extend(identity_env)
    env = [
        {"name": ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": ENV_KV_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "HOME", "value": "/tmp"},
        secret_env,
        *parts.env,
        *kv_env,
        *parallel_env(role_spec, args, role_spec.env),
        *engine_threads_env(role_spec.resources.limits, layout.ranks_per_pod, role_spec.env),
        *[dict(e) for e in role_spec.env],
    ]
    command = engine_command(args, serving=pod_serving(spec))
    if group_role is not None:
        command += rendezvous_flags(layout, group_role)
    container: dict[str, Any] = {
        "name": "engine",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "ports": ports,
        "env": env,
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
            secret_mount,
            *identity_mounts,
            *model_mounts,
        ],
        **(_probes() if group_role != WORKER else {}),
        "securityContext": _container_security_context(added_capabilities(spec)),
    }
    resources = pod_resources(role_spec, args)
    # The RDMA device goes to the engine container only, not to init steps.
    engine_resources = {
        kind: {**resources.get(kind, {}), **rdma_resources(spec)}
        for kind in ("limits", "requests")
        if resources.get(kind) or rdma_resources(spec)
    }
    if engine_resources:
        container["resources"] = engine_resources
    pod_spec: dict[str, Any] = {
        # The service's engine account, bound to no role: its token is never
        # mounted, only projected for the identity endpoint's audience.
        "serviceAccountName": engine_service_account_name(name),
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec, role, args),
        "securityContext": _pod_security_context(),
        **_placement(role_spec),
        "containers": [container],
        "volumes": [
            {
                "name": "dshm",
                "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(role_spec, args)},
            },
            {"name": "tmp", "emptyDir": {}},
            secret_volume,
            *identity_volumes,
            *volumes,
        ],
    }
    if model_steps:
        pod_spec["initContainers"] = _init_containers(image, model_steps, resources)
    labels = {**common_labels(name, role), LABEL_COMPAT: compat}
    if group_role is not None:
        labels[LABEL_GROUP_ROLE] = group_role
    meta: dict[str, Any] = {"labels": labels, **_template_annotations(secret_version)}
    if identity_version is not None and identity_enabled(spec):
        annotations[ANNOTATION_IDENTITY] = identity_version
    if identity_enabled(spec) and lends(spec, role):
        annotations[ANNOTATION_IDENTITY_ROLE] = "both"
    if annotations:
        meta["annotations"] = {**meta.get("annotations", {}), **annotations}
    return {"metadata": meta, "spec": pod_spec}


def gateway_command(name: str, spec: InferenceServiceSpec, namespace: str) -> list[str]:
    """``pdfleet gateway`` finding the service's engine pods by label, rendered from the
    gateway's own typed settings (the flags it parses).

    The engines' chat template reaches the gateway as theirs does: inline text
    as the flag's value, a path as it is. The gateway pod runs the engines'
    image and mounts the model's volumes where they do, so a template file in
    the image or the model's directory is there too; the adapters' volumes
    are the engines' only (a template on one stops the gateway at startup,
    its error naming ``--chat-template``)."""
    config = GatewayConfig(
        host="0.0.0.0",  # noqa: S104 (the gateway pod serves every interface)
        port=spec.gateway.port,
        tokenizer=model_source(spec.model.uri).path,
        chat_template=pod_serving(spec).chat_template,
        served_model_name=[spec.model.name],
        disaggregation_mode=spec.disaggregation.mode,
        min_prompt_tokens=spec.disaggregation.min_prompt_tokens,
        discovery="kubernetes",
        namespace=namespace,
        selector=f"{LABEL_SERVICE}={name}",
        engine_port=ENGINE_PORT,
        **(spec.autoscaling.gateway_settings() if spec.autoscaling else {}),
        **gateway_request_bounds(spec),
        trust_client_trace_context=spec.gateway.trust_client_trace_context,
        workers=gateway_workers(spec.gateway),
        tenants_file=f"{TENANTS_DIR}/tenants.yaml" if spec.gateway.tenants else None,
        data_dir=GATEWAY_DATA_DIR if uses_data_dir(spec.gateway.batch) else None,
        **spec.gateway.overload_settings(),
        **gateway_peer_pull_settings(spec),
    )
    return ["pdfleet", "gateway", *config.to_cli_args()]


def tenants_volume(source: TenantsSource) -> dict[str, Any]:
    """The tenants file's volume: one key of a Secret or a ConfigMap, as ``tenants.yaml``."""
    items = [{"key": source.key, "path": "tenants.yaml"}]
    if source.secret is not None:
        return {
            "name": "tenants",
            "secret": {"secretName": source.secret, "items": items, "defaultMode": 0o440},
        }
    return {
        "name": "tenants",
        "configMap": {"name": source.config_map, "items": items, "defaultMode": 0o440},
    }


def uses_data_dir(batch: GatewayBatchSpec | None) -> bool:
    """Whether the Batch API keeps its state in the gateway's data directory
    (a claim or an emptyDir; a PostgreSQL database needs none)."""
    return batch is not None and batch.database_secret is None


def gateway_data_volume(batch: GatewayBatchSpec) -> dict[str, Any]:
    """The gateway's data directory (the Batch API's state): the claim it names,
    or an emptyDir (the pod's own: lost with the pod)."""
    if batch.claim_name is not None:
        return {"name": "gateway-data", "persistentVolumeClaim": {"claimName": batch.claim_name}}
    return {"name": "gateway-data", "emptyDir": {}}


def cpu_cores(quantity: object) -> float | None:
    """A Kubernetes CPU quantity (``2``, ``1.5``, ``500m``) in cores; None when
    absent or unreadable."""
    if quantity is None:
        return None
    text = str(quantity).strip()
    try:
        return float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        return None


def gateway_workers(gateway: PodPlacement) -> int:
    """``--workers``: one gateway process per whole CPU of the pod's limit (else
    its request; 1 without either), so a pod uses every core it may."""
    cores = cpu_cores(gateway.resources.limits.get("cpu") or gateway.resources.requests.get("cpu"))
    return 1 if cores is None else max(1, int(cores))


def engine_threads_env(
    limits: Mapping[str, Any], ranks: int, user_env: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``OMP_NUM_THREADS`` for an engine container with a CPU limit: its whole
    cores less one, shared by its ``ranks`` processes, at least 1 each (unless
    the role's env sets it). Torch sizes its OpenMP pool from the node's cores,
    not the container's limit, and its threads spin at every barrier: a pool
    larger than the limit is throttled in every step, and one that fills the
    limit stalls whenever the engine's own server and scheduler threads run
    (the core left over is theirs, as under ``pdfleet up``). Without a limit
    the container may use the node's cores, and torch's default stands."""
    cores = cpu_cores(limits.get("cpu"))
    if cores is None or any(e.get("name") == "OMP_NUM_THREADS" for e in user_env):
        return []
    return [{"name": "OMP_NUM_THREADS", "value": str(engine_threads(int(cores), ranks))}]


def gateway_pod_template(
    name: str,
    spec: InferenceServiceSpec,
    *,
    namespace: str,
    image: str,
    secret_version: str | None = None,
) -> dict[str, Any]:
    gateway = spec.gateway
    volumes, model_mounts, model_steps = _model_volumes(spec)
    secret_volume, secret_mount, secret_env = _fleet_secret_volume(name)
    volumes.append(secret_volume)
    env: list[dict[str, Any]] = [{"name": "HOME", "value": "/tmp"}, secret_env]
    secret_mounts: list[dict[str, Any]] = [secret_mount]
    if gateway.api_key_secret is not None:
        key_volume, key_mount, key_env = secret_file(
            "api-key",
            gateway.api_key_secret.name,
            gateway.api_key_secret.key,
            API_KEY_DIR,
            "api-key",
            ENV_API_KEY_FILE,
        )
        env.append(key_env)
        volumes.append(key_volume)
        secret_mounts.append(key_mount)
    if gateway.tenants is not None:
        volumes.append(tenants_volume(gateway.tenants))
        secret_mounts.append({"name": "tenants", "mountPath": TENANTS_DIR, "readOnly": True})
    data_mounts: list[dict[str, Any]] = []
    if gateway.batch is not None and uses_data_dir(gateway.batch):
        volumes.append(gateway_data_volume(gateway.batch))
        data_mounts.append({"name": "gateway-data", "mountPath": GATEWAY_DATA_DIR})
    if gateway.batch is not None and gateway.batch.database_secret is not None:
        # The URL holds a password: from the Secret into the variable the
        # gateway reads, never onto its command line.
        ref = gateway.batch.database_secret
        env.append(
            {
                "name": BATCH_DATABASE_ENV,
                "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}},
            }
        )
    env += [dict(e) for e in gateway.env]
    container: dict[str, Any] = {
        "name": "gateway",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": gateway_command(name, spec, namespace),
        "ports": [{"name": "http", "containerPort": gateway.port, "protocol": "TCP"}],
        "env": env,
        "volumeMounts": [
            {"name": "tmp", "mountPath": "/tmp"},
            *model_mounts,
            *secret_mounts,
            *data_mounts,
        ],
        "readinessProbe": _probe("/health", period=5, failures=3),
        "livenessProbe": _probe("/health", period=10, failures=6),
        "securityContext": _container_security_context(),
    }
    resources = _resources(gateway)
    if resources:
        container["resources"] = resources
    pod_spec: dict[str, Any] = {
        "serviceAccountName": child_name(name, "gateway"),
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 30,
        "securityContext": _pod_security_context(),
        **_placement(gateway),
        "containers": [container],
        "volumes": [{"name": "tmp", "emptyDir": {}}, *volumes],
    }
    if model_steps:
        pod_spec["initContainers"] = _init_containers(image, model_steps, resources)
    return {
        "metadata": {
            "labels": common_labels(name, "gateway"),
            **_template_annotations(secret_version),
        },
        "spec": pod_spec,
    }


def engine_identity_parts(
    name: str,
) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """(volume, read-only mount, env vars) that let an engine pod obtain its identity.

    One projected volume: the pod's ServiceAccount token for the identity
    audience (short-lived, rotated by the kubelet) and the CA of the operator's
    endpoint (updated in place when the operator restarts with a new one). The
    authority's public key and the endpoint's URL are variables, read once.
    """
    volume = {
        "name": "identity",
        "projected": {
            "defaultMode": 0o440,
            "sources": [
                {
                    "serviceAccountToken": {
                        "audience": exchange.AUDIENCE,
                        "expirationSeconds": IDENTITY_SA_TOKEN_SECONDS,
                        "path": "token",
                    }
                },
                {
                    "configMap": {
                        "name": identity_configmap_name(name),
                        "items": [{"key": IDENTITY_CA_KEY, "path": IDENTITY_CA_KEY}],
                    }
                },
            ],
        },
    }
    mount = {"name": "identity", "mountPath": IDENTITY_DIR, "readOnly": True}

    def from_configmap(var: str, key: str) -> dict[str, Any]:
        ref = {"name": identity_configmap_name(name), "key": key}
        return {"name": var, "valueFrom": {"configMapKeyRef": ref}}

    env = [
        from_configmap(IDENTITY_AUTHORITY_ENV, IDENTITY_AUTHORITY_KEY),
        from_configmap(exchange.ENDPOINT_ENV, IDENTITY_ENDPOINT_KEY),
        {"name": exchange.CA_FILE_ENV, "value": f"{IDENTITY_DIR}/{IDENTITY_CA_KEY}"},
        {"name": exchange.SA_TOKEN_FILE_ENV, "value": f"{IDENTITY_DIR}/token"},
        {"name": exchange.SERVICE_ENV, "value": name},
    ]
    return volume, mount, env
