"""Names, labels and settings shared by every child of an InferenceService."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...engine.config import EngineArgs
from ...engine.config.fields import default_of, resolved_fields, to_jsonable
from ...engine.config.kv_transfer import KV_IP_ENV
from ...engine.contracts import pod_labels, security
from ..resource import (
    API_VERSION,
    KIND,
    ROLES,
    AdapterSpec,
    InferenceServiceSpec,
    ServingSpec,
)
from ..roles import (
    moves_kv,
    role_engine_args,
)

DEFAULT_IMAGE = "pdfleet:0.1.0"


LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"


LABEL_SERVICE = pod_labels.LABEL_SERVICE


LABEL_ROLE = pod_labels.LABEL_ROLE


LABEL_COMPAT = "pdfleet.dev/compat-hash"


MANAGED_BY = "pdfleet-operator"


# Environment variables every engine pod gets from the downward API. Kubernetes
# expands $(VAR) in a container's command, so the KV side channel advertises
# the pod's own IP and each engine is identified by its pod name.
ENV_KV_IP = KV_IP_ENV


ENV_POD_NAME = "POD_NAME"


ENV_API_KEY_FILE = security.API_KEY_FILE_ENV


# The gateway's API keys come from its Secret mounted as a file (not an
# environment variable: those leak into crash dumps and `kubectl describe`).
API_KEY_DIR = "/etc/pdfleet/api-key"
# Where the gateway's tenants file (spec.gateway.tenants) is mounted.
TENANTS_DIR = "/etc/pdfleet/tenants"
# The gateway's data directory (--data-dir: the Batch API's database and files)
# when spec.gateway.batch gives it a volume.
GATEWAY_DATA_DIR = "/var/lib/pdfleet/gateway"


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


def fleet_secret_name(name: str) -> str:
    return f"{name}-fleet"


def ucx_port_range(spec: InferenceServiceSpec) -> tuple[int, int]:
    """The UCX TCP listening ports (inclusive): just above ``kv_port``, or just
    below it when that would pass 65535."""
    port = spec.kv_transfer.port
    if port + UCX_PORT_COUNT <= 65535:
        return port + 1, port + UCX_PORT_COUNT
    return port - UCX_PORT_COUNT, port - 1


def pod_engine_args(
    spec: InferenceServiceSpec, role: str, adapters: list[AdapterSpec] | None = None
) -> EngineArgs:
    """The role's arguments as a pod runs them: KV side channel on the pod IP,
    engine id = pod name (both expanded by Kubernetes from the environment);
    ``adapters`` loaded at start (default spec.adapters)."""
    return role_engine_args(
        spec,
        role,
        kv_ip=f"$({ENV_KV_IP})",
        engine_id=f"$({ENV_POD_NAME})",
        adapters=adapters,
    )


def pod_serving(spec: InferenceServiceSpec) -> ServingSpec:
    """``spec.serving`` for a pod's command line: an inline chat template's
    every ``$`` is written ``$$``. The kubelet reduces ``$$`` to ``$`` and
    expands ``$(NAME)`` from the pod's environment, so unescaped a template
    would lose a ``$`` of each ``$$`` and take in the environment's values,
    which differ between pods (engines and the gateway alike)."""
    template = spec.serving.chat_template
    if template is None or "$" not in template:
        return spec.serving
    return spec.serving.model_copy(update={"chat_template": template.replace("$", "$$")})


def object_meta(
    name: str, namespace: str, labels: dict[str, str], owner: Owner | None
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if owner is not None:
        meta["ownerReferences"] = [owner.reference()]
    return meta


def non_default_args(args: EngineArgs) -> dict[str, Any]:
    """The arguments that differ from the engine's defaults (snake_case)."""
    out = {}
    for f, _ in resolved_fields(EngineArgs):
        value = to_jsonable(getattr(args, f.name))
        if value != to_jsonable(default_of(f)):
            out[f.name] = value
    return out


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
# On the pod templates of engines that lend and pull (``kv_role: kv_both``, peer
# pulls): the identity role they may ask for besides their role label, "both"
# (a prefill identity may not claim a peer's lease; operator/identity_issuer.py).
ANNOTATION_IDENTITY_ROLE = "pdfleet.dev/identity-role"


# On engine pod templates with spec.adapters: the adapters the pods start with
# (a JSON list of spec.adapters entries), and the hash of the template without
# the adapters the operator can load at run time. While the hash stays, a
# reconcile keeps the template's adapters (no restart) and loads the rest.
ANNOTATION_ADAPTERS = "pdfleet.dev/adapters"
ANNOTATION_ADAPTERS_KEY = "pdfleet.dev/adapters-template-hash"


def identity_enabled(spec: InferenceServiceSpec) -> bool:
    """Whether the service's engines get identities: a KV connector runs, and
    ``kvTransfer.identity`` is ``Required``."""
    return spec.kv_transfer.identity == "Required" and moves_kv(spec)


def identity_secret_name(name: str) -> str:
    return f"{name}-identity"


def identity_configmap_name(name: str) -> str:
    return f"{name}-identity"


def engine_service_account_name(name: str) -> str:
    return child_name(name, "engine")


def multi_node(spec: InferenceServiceSpec, role: str) -> bool:
    """Whether a role's engines span several pods (LeaderWorkerSet groups)."""
    return role in ROLES and spec.role(role).nodes_per_replica > 1
