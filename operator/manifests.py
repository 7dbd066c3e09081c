"""Pure builders of the Kubernetes objects an InferenceService owns.

``build_children()`` returns every child, in the order the operator applies
them; ``pdfleet render`` prints the same list. No I/O, no clock, no
randomness: the same spec gives byte-identical manifests, so applying them
again is a no-op.

Children of an InferenceService NAME (namespace NS):

* Secret ``NAME-fleet``: the fleet secret (docs/security.md). Not built here
  (it is random); :mod:`.fleet_secret` creates it once, and every engine and
  gateway pod mounts it as a file.
* ServiceAccount, RoleBinding ``NAME-gateway``: the gateway lists and watches
  the service's pods to discover engines, through the chart's gateway role
  (the operator creates no Roles).
* ServiceAccount ``NAME-engine``: the engine pods' own, bound to no role and
  never mounted; with identities, a projected token of it (audience
  ``pdfleet.dev/identity``) is what a pod presents to the operator's identity
  endpoint.
* With identities (``kvTransfer.identity: Required``), Secret and ConfigMap
  ``NAME-identity``: the identity authority's private key, and its public key
  with the endpoint's URL and CA. Not built by :func:`build_children` (they
  hold random values); :mod:`.identity_authority` creates them.
* NetworkPolicies ``NAME-prefill``, ``NAME-decode``, ``NAME-gateway``: engine
  HTTP only from the gateway and the operator, KV ports only from the other
  role, the gateway's port from anywhere.
* ConfigMap ``NAME-config``: each role's engine arguments and command line.
* Services ``NAME-prefill`` and ``NAME-decode`` (headless, one DNS record per
  engine pod) and ``NAME`` (ClusterIP, the gateway: the OpenAI endpoint).
* PodDisruptionBudgets ``NAME-prefill``, ``NAME-decode``, ``NAME-gateway``.
* Deployments ``NAME-gateway``, ``NAME-decode``, ``NAME-prefill``; an engine role
  with ``nodesPerReplica > 1`` is a LeaderWorkerSet of the same name instead
  (docs/parallelism-k8s.md).
"""

from __future__ import annotations

import argparse
import base64
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engine.config import EngineArgs
from ..engine.config.fields import default_of, resolved_fields, to_jsonable
from ..engine.config.gateway import (
    KV_EVENTS_PORT_ANNOTATION,
    KV_REPLAY_PORT_ANNOTATION,
    GatewayConfig,
)
from ..engine.contracts import identity_exchange as exchange
from ..engine.contracts.identity import IDENTITY_AUTHORITY_ENV
from ..engine.contracts.security import FLEET_SECRET_FILE_ENV
from .compat import compat_hash
from .model_source import InitStep, model_volumes
from .parallelism import (
    LABEL_GROUP_ROLE,
    LEADER,
    WORKER,
    parallel_env,
    pod_resources,
    rendezvous_flags,
    role_layout,
    shm_size,
)
from .resource import (
    API_VERSION,
    KIND,
    ROLES,
    InferenceServiceSpec,
    PodPlacement,
    ServingSpec,
    TenantsSource,
)
from .roles import (
    ENGINE_PORT,
    KV_EVENTS_PORT,
    KV_EVENTS_REPLAY_PORT,
    added_capabilities,
    disaggregating,
    engine_command,
    gateway_request_bounds,
    model_source,
    publishes_kv_events,
    rdma_resources,
    role_engine_args,
    secret_file,
    ucx_env,
)

DEFAULT_IMAGE = "pdfleet:0.1.0"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LABEL_SERVICE = "pdfleet.dev/service"
LABEL_ROLE = "pdfleet.dev/role"
LABEL_COMPAT = "pdfleet.dev/compat-hash"
MANAGED_BY = "pdfleet-operator"
# Environment variables every engine pod gets from the downward API. Kubernetes
# expands $(VAR) in a container's command, so the KV side channel advertises
# the pod's own IP and each engine is identified by its pod name.
ENV_KV_IP = "PDFLEET_KV_IP"
ENV_POD_NAME = "POD_NAME"
ENV_API_KEY_FILE = "PDFLEET_API_KEY_FILE"
# The gateway's API keys come from its Secret mounted as a file (not an
# environment variable: those leak into crash dumps and `kubectl describe`).
API_KEY_DIR = "/etc/pdfleet/api-key"
# Where the gateway's tenants file (spec.gateway.tenants) is mounted.
TENANTS_DIR = "/etc/pdfleet/tenants"
# Seconds added to the engine's drain time before the kubelet kills it.
GRACE_MARGIN_SECONDS = 15
# Model loading may take long (large weights, cold caches): the startup probe
# allows STARTUP_PERIOD_SECONDS * STARTUP_FAILURES = 30 minutes.
STARTUP_PERIOD_SECONDS = 10
STARTUP_FAILURES = 180
RUN_AS_USER = 10001  # above the host's usual uid range (the images' user)
# The fleet secret, mounted as a file into every engine and gateway pod.
FLEET_SECRET_KEY = "fleet-secret"
FLEET_SECRET_DIR = "/etc/pdfleet/fleet"
# A fingerprint of the fleet secret on the pod templates: a new secret (rotation)
# rolls every pod, since engines read the secret once, at start.
ANNOTATION_FLEET_SECRET = "pdfleet.dev/fleet-secret-version"
# UCX's TCP transport listens on a port of this range (kv_port + 1 onward) rather
# than an ephemeral one, so that a NetworkPolicy can admit exactly the KV ports.
UCX_PORT_COUNT = 32
ENV_UCX_PORT_RANGE = "UCX_TCP_PORT_RANGE"


@dataclass(frozen=True)
class OperatorInstall:
    """What the operator's installation (the Helm chart) provides to every fleet."""

    namespace: str | None = "pdfleet"
    """Namespace of the operator pod (allowed to scrape engines); ``None``: the
    service's own namespace."""
    pod_labels: Mapping[str, str] = field(
        default_factory=lambda: {
            "app.kubernetes.io/name": "pdfleet",
            "app.kubernetes.io/component": "operator",
        }
    )
    """Labels of the operator pod (the chart's selector labels, less the release)."""
    gateway_role: str = "pdfleet-gateway"
    """The role (pods get/list/watch) that each gateway's RoleBinding names; the
    chart creates it."""
    gateway_role_kind: str = "Role"
    """``Role`` (namespaced install, the chart's default: one in each watched
    namespace, so the chart needs no cluster-scoped rights) or ``ClusterRole``
    (cluster-wide install)."""
    leader_worker_set: bool = True
    """Whether roles with ``nodesPerReplica > 1`` may run (LeaderWorkerSets). The
    operator's default is off (its RBAC covers LeaderWorkerSets only when the
    chart enables them); ``pdfleet render`` renders them."""

    def __post_init__(self) -> None:
        if self.gateway_role_kind not in ("Role", "ClusterRole"):
            raise ValueError(
                f"gateway role kind {self.gateway_role_kind!r}: use Role or ClusterRole"
            )


def add_gateway_role_args(parser: argparse.ArgumentParser) -> None:
    """The role each gateway's RoleBinding names (shared by `operator` and `render`)."""
    parser.add_argument(
        "--gateway-role-kind",
        choices=["ClusterRole", "Role"],
        default=OperatorInstall.gateway_role_kind,
        help="Kind of --gateway-role: Role (namespaced install, the chart's default: one per "
        "watched namespace) or ClusterRole (cluster-wide install). Default %(default)s.",
    )
    parser.add_argument(
        "--gateway-role",
        default=OperatorInstall.gateway_role,
        metavar="NAME",
        help="Role or ClusterRole (pods get/list/watch) bound to each gateway's "
        "ServiceAccount; the Helm chart creates it as RELEASE-gateway (the default is "
        "the name of a release called pdfleet). Default %(default)s.",
    )


@dataclass(frozen=True)
class Owner:
    """The InferenceService that owns the children (garbage collection)."""

    name: str
    uid: str

    def reference(self) -> dict[str, Any]:
        return {
            "apiVersion": API_VERSION,
            "kind": KIND,
            "name": self.name,
            "uid": self.uid,
            "controller": True,
            "blockOwnerDeletion": True,
        }


def child_name(name: str, role: str) -> str:
    return name if role == "service" else f"{name}-{role}"


def selector_labels(name: str, role: str) -> dict[str, str]:
    """The labels a role's pods are selected by (immutable in a Deployment)."""
    return {LABEL_SERVICE: name, LABEL_ROLE: role}


def common_labels(name: str, role: str | None = None) -> dict[str, str]:
    labels = {
        "app.kubernetes.io/name": "pdfleet",
        "app.kubernetes.io/instance": name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_SERVICE: name,
    }
    if role is not None:
        labels["app.kubernetes.io/component"] = role
        labels[LABEL_ROLE] = role
    return labels


def desired_replicas(
    spec: InferenceServiceSpec, role: str, autoscaled: Mapping[str, int] | None = None
) -> int:
    """Replicas of a role: the autoscaler's choice (kept within min..max) when
    autoscaling is on, else the spec's; no prefill pods when not disaggregating."""
    if role == "gateway":
        return spec.gateway.replicas
    if role == "prefill" and not disaggregating(spec):
        return 0
    replicas = spec.role(role).replicas
    if spec.autoscaling is None:
        return replicas
    policy = getattr(spec.autoscaling, role)
    wanted = (autoscaled or {}).get(role, replicas)
    return max(policy.min_replicas, min(policy.max_replicas, wanted))


# --------------------------------------------------------------------------
# pod parts


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


def _model_volumes(spec: InferenceServiceSpec) -> tuple[list[dict], list[dict], list[InitStep]]:
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


def fleet_secret_name(name: str) -> str:
    return f"{name}-fleet"


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


def ucx_port_range(spec: InferenceServiceSpec) -> tuple[int, int]:
    """The UCX TCP listening ports (inclusive): just above ``kv_port``, or just
    below it when that would pass 65535."""
    port = spec.kv_transfer.port
    if port + UCX_PORT_COUNT <= 65535:
        return port + 1, port + UCX_PORT_COUNT
    return port - UCX_PORT_COUNT, port - 1


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


def pod_engine_args(spec: InferenceServiceSpec, role: str) -> EngineArgs:
    """The role's arguments as a pod runs them: KV side channel on the pod IP,
    engine id = pod name (both expanded by Kubernetes from the environment)."""
    return role_engine_args(spec, role, kv_ip=f"$({ENV_KV_IP})", engine_id=f"$({ENV_POD_NAME})")


def pod_serving(spec: InferenceServiceSpec) -> ServingSpec:
    """``spec.serving`` for a pod's command line: an inline chat template's
    ``$(`` is written ``$$(``, which the kubelet turns back into ``$(`` instead
    of expanding it as an environment variable."""
    template = spec.serving.chat_template
    if template is None or "$(" not in template:
        return spec.serving
    return spec.serving.model_copy(update={"chat_template": template.replace("$(", "$$(")})


def termination_grace_seconds(spec: InferenceServiceSpec, role: str, args: EngineArgs) -> int:
    """At least the engine's drain time; a prefill engine also waits out the KV
    lease so a decode engine can still pull the blocks it holds."""
    drain = float(args.shutdown_timeout)
    if role == "prefill" and disaggregating(spec):
        drain = max(drain, spec.kv_transfer.lease_seconds)
    return math.ceil(drain) + GRACE_MARGIN_SECONDS


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
) -> dict[str, Any]:
    """One engine pod; ``group_role`` (``leader`` or ``worker``) for a pod of a
    multi-node group: a worker runs ranks only (no API server, no probes).
    ``identity_version``: the identity authority's fingerprint (a new authority
    rolls the pods, which read it once, at start)."""
    role_spec = spec.role(role)
    args = pod_engine_args(spec, role)
    layout = role_layout(role_spec, args)
    volumes, model_mounts, model_steps = _model_volumes(spec)
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
        *kv_env,
        *parallel_env(role_spec, args, role_spec.env),
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
    if annotations:
        meta["annotations"] = {**meta.get("annotations", {}), **annotations}
    return {"metadata": meta, "spec": pod_spec}


def gateway_command(name: str, spec: InferenceServiceSpec, namespace: str) -> list[str]:
    """``pdfleet gateway`` finding the service's engine pods by label, rendered from the
    gateway's own typed settings (the flags it parses)."""
    config = GatewayConfig(
        host="0.0.0.0",
        port=spec.gateway.port,
        tokenizer=model_source(spec.model.uri).path,
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
        **spec.gateway.overload_settings(),
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


def gateway_workers(gateway: PodPlacement) -> int:
    """``--workers``: one gateway process per whole CPU of the pod's limit (else
    its request; 1 without either), so a pod uses every core it may."""
    cpu = gateway.resources.limits.get("cpu") or gateway.resources.requests.get("cpu")
    if cpu is None:
        return 1
    text = str(cpu).strip()
    try:
        cores = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        return 1
    return max(1, int(cores))


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
    env += [dict(e) for e in gateway.env]
    container: dict[str, Any] = {
        "name": "gateway",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": gateway_command(name, spec, namespace),
        "ports": [{"name": "http", "containerPort": gateway.port, "protocol": "TCP"}],
        "env": env,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, *model_mounts, *secret_mounts],
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


# --------------------------------------------------------------------------
# objects


def _meta(name: str, namespace: str, labels: dict[str, str], owner: Owner | None) -> dict:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if owner is not None:
        meta["ownerReferences"] = [owner.reference()]
    return meta


def build_deployment(
    name: str,
    spec: InferenceServiceSpec,
    role: str,
    *,
    namespace: str,
    image: str,
    compat: str,
    replicas: int,
    owner: Owner | None = None,
    secret_version: str | None = None,
    identity_version: str | None = None,
) -> dict[str, Any]:
    if role == "gateway":
        template = gateway_pod_template(
            name, spec, namespace=namespace, image=image, secret_version=secret_version
        )
        labels = common_labels(name, role)
    else:
        template = engine_pod_template(
            name,
            spec,
            role,
            image=image,
            compat=compat,
            secret_version=secret_version,
            identity_version=identity_version,
        )
        labels = {**common_labels(name, role), LABEL_COMPAT: compat}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(child_name(name, role), namespace, labels, owner),
        "spec": {
            "replicas": replicas,
            "revisionHistoryLimit": 3,
            "selector": {"matchLabels": selector_labels(name, role)},
            # Add a pod before removing one: serving capacity never drops in a rollout.
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "template": template,
        },
    }


def multi_node(spec: InferenceServiceSpec, role: str) -> bool:
    """Whether a role's engines span several pods (LeaderWorkerSet groups)."""
    return role in ROLES and spec.role(role).nodes_per_replica > 1


def workload_kind(spec: InferenceServiceSpec, role: str) -> str:
    """The kind of a role's workload object: Deployment or LeaderWorkerSet."""
    return "LeaderWorkerSet" if multi_node(spec, role) else "Deployment"


def build_leader_worker_set(
    name: str,
    spec: InferenceServiceSpec,
    role: str,
    *,
    namespace: str,
    image: str,
    compat: str,
    replicas: int,
    owner: Owner | None = None,
    secret_version: str | None = None,
    identity_version: str | None = None,
) -> dict[str, Any]:
    """A multi-node role: ``replicas`` groups of ``nodesPerReplica`` pods each.

    The leader (worker index 0) serves the API and runs node rank 0; workers
    join its rendezvous. A pod that fails restarts its whole group (the ranks
    of one engine live and die together). Rollouts add a new group before
    removing an old one, as the Deployments do with pods.
    """
    role_spec = spec.role(role)
    templates = {
        group_role: engine_pod_template(
            name,
            spec,
            role,
            image=image,
            compat=compat,
            secret_version=secret_version,
            group_role=group_role,
            identity_version=identity_version,
        )
        for group_role in (LEADER, WORKER)
    }
    labels = {**common_labels(name, role), LABEL_COMPAT: compat}
    return {
        "apiVersion": LWS_API_VERSION,
        "kind": "LeaderWorkerSet",
        "metadata": _meta(child_name(name, role), namespace, labels, owner),
        "spec": {
            "replicas": replicas,
            "startupPolicy": "LeaderCreated",
            "rolloutStrategy": {
                "type": "RollingUpdate",
                "rollingUpdateConfiguration": {"maxSurge": 1, "maxUnavailable": 0},
            },
            "networkConfig": {"subdomainPolicy": "Shared"},
            "leaderWorkerTemplate": {
                "size": role_spec.nodes_per_replica,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": templates[LEADER],
                "workerTemplate": templates[WORKER],
            },
        },
    }


def build_engine_service(
    name: str, spec: InferenceServiceSpec, role: str, *, namespace: str, owner: Owner | None
) -> dict[str, Any]:
    ports = [{"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}]
    if disaggregating(spec) and spec.kv_transfer.connector is not None:
        ports.append(
            {"name": "kv", "port": spec.kv_transfer.port, "targetPort": "kv", "protocol": "TCP"}
        )
    service_spec: dict[str, Any] = {
        "clusterIP": "None",
        "selector": selector_labels(name, role),
        "ports": ports,
    }
    if multi_node(spec, role):
        # The LeaderWorkerSet's subdomain (its controller finds this Service under
        # the set's name and creates none): workers resolve their leader before
        # it is ready, since it becomes ready only once they have joined.
        service_spec["publishNotReadyAddresses"] = True
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(child_name(name, role), namespace, common_labels(name, role), owner),
        "spec": service_spec,
    }


def build_gateway_service(
    name: str, spec: InferenceServiceSpec, *, namespace: str, owner: Owner | None
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(name, namespace, common_labels(name, "gateway"), owner),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name, "gateway"),
            "ports": [
                {"name": "http", "port": spec.gateway.port, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def build_pdb(name: str, role: str, *, namespace: str, owner: Owner | None) -> dict[str, Any]:
    # maxUnavailable rather than minAvailable: a one-pod role can still be drained.
    # For multi-node roles one pod down stops its whole group (the group is
    # recreated), so one pod at a time is also one group at a time.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _meta(child_name(name, role), namespace, common_labels(name, role), owner),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name, role)}},
    }


def build_gateway_rbac(
    name: str, *, namespace: str, owner: Owner | None, install: OperatorInstall
) -> list[dict[str, Any]]:
    """ServiceAccount and RoleBinding letting the gateway watch the pods of its
    namespace (it filters to its own service by label). The binding names the
    chart's gateway role (a Role in the namespace, or a ClusterRole), so the
    operator never writes a role's rules."""
    sa_name = child_name(name, "gateway")
    labels = common_labels(name, "gateway")
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": _meta(sa_name, namespace, labels, owner),
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _meta(sa_name, namespace, labels, owner),
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": install.gateway_role_kind,
                "name": install.gateway_role,
            },
            "subjects": [{"kind": "ServiceAccount", "name": sa_name, "namespace": namespace}],
        },
    ]


def _operator_peer(install: OperatorInstall) -> dict[str, Any]:
    peer: dict[str, Any] = {"podSelector": {"matchLabels": dict(install.pod_labels)}}
    if install.namespace is not None:
        peer["namespaceSelector"] = {
            "matchLabels": {"kubernetes.io/metadata.name": install.namespace}
        }
    return peer


def _tcp(port: int, end_port: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"port": port, "protocol": "TCP"}
    if end_port is not None:
        out["endPort"] = end_port
    return out


def build_network_policies(
    name: str,
    spec: InferenceServiceSpec,
    *,
    namespace: str,
    owner: Owner | None,
    install: OperatorInstall,
) -> list[dict[str, Any]]:
    """One ingress policy per role (docs/security.md).

    Engines: HTTP only from the service's gateway pods and the operator pod;
    the KV event ports (when the role publishes) only from the gateway pods;
    the KV side channel and the UCX port range only from the other role's
    pods; for multi-node roles, any port from the role's own pods (the
    rendezvous, NCCL and gloo pick their ports at run time). The gateway: its
    port from anywhere (it checks API keys itself).
    Policies add up, so a cluster admin may admit more (e.g. a Prometheus).
    """
    policies = []
    kv = disaggregating(spec) and spec.kv_transfer.connector is not None
    other = {"prefill": "decode", "decode": "prefill"}
    for role in ("prefill", "decode"):
        ingress: list[dict[str, Any]] = [
            {
                "from": [
                    {"podSelector": {"matchLabels": selector_labels(name, "gateway")}},
                    _operator_peer(install),
                ],
                "ports": [_tcp(ENGINE_PORT)],
            }
        ]
        if publishes_kv_events(spec, role):
            ingress.append(
                {
                    "from": [{"podSelector": {"matchLabels": selector_labels(name, "gateway")}}],
                    "ports": [_tcp(KV_EVENTS_PORT), _tcp(KV_EVENTS_REPLAY_PORT)],
                }
            )
        if kv:
            ports = [_tcp(spec.kv_transfer.port)]
            if spec.kv_transfer.connector == "NixlConnector":
                ports.append(_tcp(*ucx_port_range(spec)))
            ingress.append(
                {
                    "from": [{"podSelector": {"matchLabels": selector_labels(name, other[role])}}],
                    "ports": ports,
                }
            )
        if multi_node(spec, role):
            ingress.append(
                {"from": [{"podSelector": {"matchLabels": selector_labels(name, role)}}]}
            )
        policies.append((role, ingress))
    policies.append(("gateway", [{"ports": [_tcp(spec.gateway.port)]}]))
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _meta(child_name(name, role), namespace, common_labels(name, role), owner),
            "spec": {
                "podSelector": {"matchLabels": selector_labels(name, role)},
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }
        for role, ingress in policies
    ]


def build_fleet_secret(
    name: str, *, namespace: str, owner: Owner | None, value: str
) -> dict[str, Any]:
    """The fleet Secret holding ``value`` (random: the caller draws it, once)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(fleet_secret_name(name), namespace, common_labels(name), owner),
        "type": "Opaque",
        "immutable": True,
        "data": {FLEET_SECRET_KEY: base64.b64encode(value.encode()).decode()},
    }


def non_default_args(args: EngineArgs) -> dict[str, Any]:
    """The arguments that differ from the engine's defaults (snake_case)."""
    out = {}
    for f, _ in resolved_fields(EngineArgs):
        value = to_jsonable(getattr(args, f.name))
        if value != to_jsonable(default_of(f)):
            out[f.name] = value
    return out


def build_configmap(
    name: str, spec: InferenceServiceSpec, *, namespace: str, compat: str, owner: Owner | None
) -> dict[str, Any]:
    data = {"compat-hash": compat}
    for role in ROLES:
        args = pod_engine_args(spec, role)
        command = engine_command(args, serving=pod_serving(spec))
        doc: dict[str, Any] = {"args": non_default_args(args), "command": command}
        if multi_node(spec, role):
            layout = role_layout(spec.role(role), args)
            doc["command"] = command + rendezvous_flags(layout, LEADER)
            doc["workerCommand"] = command + rendezvous_flags(layout, WORKER)
        data[f"{role}.json"] = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    gateway = {"command": gateway_command(name, spec, namespace)}
    data["gateway.json"] = json.dumps(gateway, indent=2, sort_keys=True) + "\n"
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(child_name(name, "config"), namespace, common_labels(name), owner),
        "data": data,
    }


def build_children(
    name: str,
    spec: InferenceServiceSpec,
    *,
    namespace: str,
    image: str | None = None,
    owner: Owner | None = None,
    autoscaled: Mapping[str, int] | None = None,
    install: OperatorInstall | None = None,
    secret_version: str | None = None,
    identity_version: str | None = None,
) -> list[dict[str, Any]]:
    """Every child object, in apply order (workloads last: gateway, decode, prefill).

    An engine role's workload is a Deployment, or a LeaderWorkerSet when its
    ``nodesPerReplica`` is above 1 (:func:`workload_kind`).

    ``image`` is the default when ``spec.image`` is unset; ``autoscaled``
    holds the replicas the autoscaler chose (used when autoscaling is on);
    ``install`` says where the operator runs; ``secret_version`` is the fleet
    secret's fingerprint (a change rolls every pod), ``identity_version`` the
    identity authority's (a change rolls the engine pods).
    The spec must pass :func:`pdfleet.operator.compat.check_service`.
    """
    image = spec.image or image or DEFAULT_IMAGE
    install = install or OperatorInstall()
    compat = compat_hash(spec)
    objects = build_gateway_rbac(name, namespace=namespace, owner=owner, install=install)
    objects.append(build_engine_service_account(name, namespace=namespace, owner=owner))
    objects += build_network_policies(name, spec, namespace=namespace, owner=owner, install=install)
    objects.append(build_configmap(name, spec, namespace=namespace, compat=compat, owner=owner))
    for role in ROLES:
        objects.append(build_engine_service(name, spec, role, namespace=namespace, owner=owner))
    objects.append(build_gateway_service(name, spec, namespace=namespace, owner=owner))
    for role in ("prefill", "decode", "gateway"):
        objects.append(build_pdb(name, role, namespace=namespace, owner=owner))
    for role in ("gateway", "decode", "prefill"):
        build = build_leader_worker_set if multi_node(spec, role) else build_deployment
        objects.append(
            build(
                name,
                spec,
                role,
                namespace=namespace,
                image=image,
                compat=compat,
                replicas=desired_replicas(spec, role, autoscaled),
                owner=owner,
                secret_version=secret_version,
                **({} if role == "gateway" else {"identity_version": identity_version}),
            )
        )
    return objects


def service_url(name: str, spec: InferenceServiceSpec, namespace: str) -> str:
    """The OpenAI base URL of the gateway Service, inside the cluster."""
    return f"http://{name}.{namespace}.svc:{spec.gateway.port}/v1"


# --------------------------------------------------------------------------
# identities (docs/security.md, "Identities")

IDENTITY_SECRET_KEY = "authority"
# Keys of the ConfigMap NAME-identity (all public).
IDENTITY_AUTHORITY_KEY = "authority"
IDENTITY_CA_KEY = "ca.crt"
IDENTITY_ENDPOINT_KEY = "endpoint"
IDENTITY_DIR = "/var/run/secrets/pdfleet/identity"
# Lifetime of the projected ServiceAccount token (seconds; the kubelet renews
# it at 80%). It only ever reaches the operator's endpoint.
IDENTITY_SA_TOKEN_SECONDS = 600
# The identity authority's fingerprint on engine pod templates: a new authority
# (rotation) rolls the engine pods, which read its public key once, at start.
ANNOTATION_IDENTITY = "pdfleet.dev/identity-authority-version"


def identity_enabled(spec: InferenceServiceSpec) -> bool:
    """Whether the service's engines get identities: a KV connector runs, and
    ``kvTransfer.identity`` is ``Required``."""
    return (
        spec.kv_transfer.identity == "Required"
        and disaggregating(spec)
        and spec.kv_transfer.connector is not None
    )


def identity_secret_name(name: str) -> str:
    return f"{name}-identity"


def identity_configmap_name(name: str) -> str:
    return f"{name}-identity"


def engine_service_account_name(name: str) -> str:
    return child_name(name, "engine")


def build_engine_service_account(
    name: str, *, namespace: str, owner: Owner | None
) -> dict[str, Any]:
    """The engine pods' ServiceAccount: no RoleBinding names it (engines call no
    API), its token is never mounted; the identity endpoint accepts projected
    tokens of this account only."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _meta(engine_service_account_name(name), namespace, common_labels(name), owner),
        "automountServiceAccountToken": False,
    }


def engine_identity_parts(name: str) -> tuple[dict[str, Any], dict[str, Any], list[dict]]:
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


def build_identity_secret(
    name: str, *, namespace: str, owner: Owner | None, value: str
) -> dict[str, Any]:
    """The Secret holding the identity authority's private key (``value``:
    base64url of the raw key; random, drawn once by the caller). No pod mounts
    it; only the operator reads it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(identity_secret_name(name), namespace, common_labels(name), owner),
        "type": "Opaque",
        "immutable": True,
        "data": {IDENTITY_SECRET_KEY: base64.b64encode(value.encode()).decode()},
    }


def build_identity_configmap(
    name: str,
    *,
    namespace: str,
    owner: Owner | None,
    authority: str,
    ca_pem: str,
    endpoint: str,
) -> dict[str, Any]:
    """What engine pods read about identities, all public: the authority's
    public key, the endpoint's URL and the CA its certificate chains to."""
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(identity_configmap_name(name), namespace, common_labels(name), owner),
        "data": {
            IDENTITY_AUTHORITY_KEY: authority,
            IDENTITY_CA_KEY: ca_pem,
            IDENTITY_ENDPOINT_KEY: endpoint,
        },
    }
