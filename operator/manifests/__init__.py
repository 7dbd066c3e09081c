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

The builders live in one module per child kind: ``common`` (names and
labels), ``pods``, ``workloads``, ``services`` (and PDBs), ``network``,
``access`` (Secrets, ConfigMaps, RBAC) and ``children``, which assembles them.
"""

from __future__ import annotations

from .access import (
    build_configmap,
    build_engine_service_account,
    build_fleet_secret,
    build_gateway_rbac,
    build_identity_configmap,
    build_identity_secret,
)
from .children import build_children
from .common import (
    ANNOTATION_ADAPTERS,
    ANNOTATION_ADAPTERS_KEY,
    ANNOTATION_FLEET_SECRET,
    ANNOTATION_IDENTITY,
    ANNOTATION_IDENTITY_ROLE,
    API_KEY_DIR,
    DEFAULT_IMAGE,
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
    IDENTITY_SECRET_KEY,
    LABEL_COMPAT,
    LABEL_ROLE,
    LABEL_SERVICE,
    LWS_API_VERSION,
    MANAGED_BY,
    RUN_AS_USER,
    STARTUP_FAILURES,
    STARTUP_PERIOD_SECONDS,
    TENANTS_DIR,
    UCX_PORT_COUNT,
    OperatorInstall,
    Owner,
    add_gateway_role_args,
    child_name,
    common_labels,
    engine_service_account_name,
    fleet_secret_name,
    identity_configmap_name,
    identity_enabled,
    identity_secret_name,
    multi_node,
    non_default_args,
    pod_engine_args,
    pod_serving,
    selector_labels,
    ucx_port_range,
)
from .network import build_network_policies
from .pods import (
    engine_identity_parts,
    engine_pod_template,
    gateway_command,
    gateway_pod_template,
    gateway_workers,
    pod_shaping_adapters,
    template_adapters,
    tenants_volume,
    termination_grace_seconds,
)
from .services import build_engine_service, build_gateway_service, build_pdb, service_url
from .workloads import (
    build_deployment,
    build_leader_worker_set,
    desired_replicas,
    workload_kind,
)

__all__ = [
    "ANNOTATION_ADAPTERS",
    "ANNOTATION_ADAPTERS_KEY",
    "ANNOTATION_FLEET_SECRET",
    "ANNOTATION_IDENTITY",
    "ANNOTATION_IDENTITY_ROLE",
    "API_KEY_DIR",
    "DEFAULT_IMAGE",
    "ENV_API_KEY_FILE",
    "ENV_KV_IP",
    "ENV_POD_NAME",
    "ENV_UCX_PORT_RANGE",
    "FLEET_SECRET_DIR",
    "FLEET_SECRET_KEY",
    "GATEWAY_DATA_DIR",
    "GRACE_MARGIN_SECONDS",
    "IDENTITY_AUTHORITY_KEY",
    "IDENTITY_CA_KEY",
    "IDENTITY_DIR",
    "IDENTITY_ENDPOINT_KEY",
    "IDENTITY_SA_TOKEN_SECONDS",
    "IDENTITY_SECRET_KEY",
    "LABEL_COMPAT",
    "LABEL_ROLE",
    "LABEL_SERVICE",
    "LWS_API_VERSION",
    "MANAGED_BY",
    "RUN_AS_USER",
    "STARTUP_FAILURES",
    "STARTUP_PERIOD_SECONDS",
    "TENANTS_DIR",
    "UCX_PORT_COUNT",
    "OperatorInstall",
    "Owner",
    "add_gateway_role_args",
    "build_children",
    "build_configmap",
    "build_deployment",
    "build_engine_service",
    "build_engine_service_account",
    "build_fleet_secret",
    "build_gateway_rbac",
    "build_gateway_service",
    "build_identity_configmap",
    "build_identity_secret",
    "build_leader_worker_set",
    "build_network_policies",
    "build_pdb",
    "child_name",
    "common_labels",
    "desired_replicas",
    "engine_identity_parts",
    "engine_pod_template",
    "engine_service_account_name",
    "fleet_secret_name",
    "gateway_command",
    "gateway_pod_template",
    "gateway_workers",
    "identity_configmap_name",
    "identity_enabled",
    "identity_secret_name",
    "multi_node",
    "non_default_args",
    "pod_engine_args",
    "pod_serving",
    "pod_shaping_adapters",
    "selector_labels",
    "service_url",
    "template_adapters",
    "tenants_volume",
    "termination_grace_seconds",
    "ucx_port_range",
    "workload_kind",
]
