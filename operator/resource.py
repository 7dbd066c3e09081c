"""The ``InferenceService`` resource: its spec and status as pydantic models.

One schema, read three ways: ``pdfleet up`` loads a YAML file with
:func:`load_inference_service`, the operator validates ``spec`` of live
objects, and :mod:`pdfleet.operator.crd` generates the CRD's OpenAPI schema
from these classes (the field docstrings become ``kubectl explain`` text).
Every section derives from :class:`pdfleet.operator.spec_model.SpecModel`
(camelCase keys, unknown keys refused, null = unset); the ``autoscaling``
section is the policy's own models (:mod:`pdfleet.operator.autoscaling.spec`),
in the same system.
"""

from __future__ import annotations

import os
import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from ..engine.config.gateway import FLOAT_BOUNDS
from ..engine.contracts.model_source import parse_hf_uri
from .autoscaling.spec import AutoscalingSpec
from .engine_spec import FieldPathError, FieldPathErrors, camel, validate_engine_section
from .spec_model import SpecModel, format_validation_error

GROUP = "pdfleet.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
SINGULAR = "inferenceservice"
SHORT_NAMES = ("pdsvc",)
CATEGORIES = ("pdfleet", "llm")

ROLES = ("prefill", "decode")
# Engine settings whose values decide the shape and meaning of KV blocks: the
# two roles of a disaggregated fleet must agree on them. (key, value when
# neither the role nor spec.engine sets it, why). hfOverrides must match too;
# compat.check_service checks it (CEL cannot see inside a free-form object).
KV_SHAPE_KEYS = (
    ("blockSize", 16, "KV blocks move between the roles block by block"),
    ("kvCacheDtype", "auto", "KV bytes are copied as they are, without conversion"),
    ("dtype", "auto", "both roles must compute the same activations"),
)
# kvTransfer fields that kvTransfer.extraConfig must not repeat (snake_case, as
# the engine reads extraConfig).
TYPED_EXTRA_KEYS = (
    "backends",
    "handshake_timeout_seconds",
    "lease_seconds",
    "transfer_timeout_seconds",
)
# A name leaves room for the longest child name (``NAME-gateway``) within the
# 63 characters of a DNS label, which Service names must be.
MAX_NAME_LENGTH = 45
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MODEL_URI_SCHEMES = ("builtin", "file", "pvc", "hf")
# A model revision: a branch, tag or commit (Hub refs such as refs/pr/1 too).
# It becomes a command-line value, so it never starts with "-".
REVISION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/-]{0,127}$"
# The name clients use: letters, digits and . _ - / : @ + (never a leading "-").
MODEL_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]{0,255}$"
# Kubernetes object names (DNS subdomains) and Secret keys.
OBJECT_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
# The operator names each service's fleet Secret NAME-fleet: no spec field may
# name a Secret so (it would hand one fleet's secret to a pod or a variable).
FLEET_SECRET_SUFFIX = "-fleet"
# Nor NAME-identity, which holds the private key of a service's identity authority.
IDENTITY_SECRET_SUFFIX = "-identity"
# Variables pdfleet itself reads (the fleet secret's file, API keys, the KV
# address): a role's env may not set them.
RESERVED_ENV_PREFIX = "PDFLEET_"
ENV_NAME_PATTERN = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# The same names as pdfleet.engine.tiny.registry.BUILTIN_MODELS (a test keeps them equal).
BUILTIN_MODELS = ("tiny", "smollm2-135m-instruct")


class EngineSection:
    """Marks a field holding engine settings (camelCase ``EngineArgs`` fields).

    The CRD generator emits the schema generated from ``EngineArgs`` for it.
    """


class PassThrough:
    """Marks a field copied verbatim into a Kubernetes object (e.g. a Toleration).

    The API server validates it when the child object is created; the CRD
    keeps its unknown fields.
    """

    def __init__(self, kind: str, known: dict[str, Any] | None = None) -> None:
        self.kind = kind
        self.known = known or {}
        """Properties the CRD declares (for its CEL rules); the rest stay unknown."""


class ListMap:
    """Marks a list whose items are unique by ``keys``: the CRD declares it an
    ``x-kubernetes-list-type: map``, so the API server refuses a repeated key
    itself (and server-side apply merges the items by key)."""

    def __init__(self, *keys: str) -> None:
        self.keys = keys


EngineSettings = Annotated[dict[str, Any], EngineSection()]
Quantity = int | str


# --------------------------------------------------------------------------
# spec


def _not_a_fleet_secret(name: str) -> str:
    if name.endswith(FLEET_SECRET_SUFFIX):
        raise ValueError(
            f"{name!r}: Secret names ending in {FLEET_SECRET_SUFFIX} are reserved for fleet "
            "secrets (the operator's NAME-fleet)"
        )
    if name.endswith(IDENTITY_SECRET_SUFFIX):
        raise ValueError(
            f"{name!r}: Secret names ending in {IDENTITY_SECRET_SUFFIX} are reserved for "
            "identity authorities (the operator's NAME-identity)"
        )
    return name


SecretName = Annotated[str, Field(min_length=1, max_length=253, pattern=OBJECT_NAME_PATTERN)]
SecretKey = Annotated[str, Field(min_length=1, max_length=253, pattern=SECRET_KEY_PATTERN)]


class HubTokenSecret(SpecModel):
    """A key of a Secret in the InferenceService's namespace holding a Hugging Face token."""

    name: SecretName
    """Name of the Secret (not one of the operator's: names ending in -fleet or
    -identity are refused)."""
    key: SecretKey = "token"
    """Key within the Secret."""

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        return _not_a_fleet_secret(name)


class ModelCacheSpec(SpecModel):
    """Where `hf://` downloads are kept."""

    claim: str = Field(min_length=1, max_length=253, pattern=OBJECT_NAME_PATTERN)
    """PersistentVolumeClaim holding the Hugging Face cache (ReadWriteMany to share
    it between pods: a pod that finds the files there downloads nothing)."""


class ModelSpec(SpecModel):
    """The model to serve."""

    name: str = Field(min_length=1, max_length=256, pattern=MODEL_NAME_PATTERN)
    """Model name clients use (the OpenAI `model` field); every role serves it
    under this name. Letters, digits and `. _ - / : @ +`, not starting with
    `-`."""
    uri: str = "builtin://tiny"
    """Where the weights are: `file:///path` (a Hugging Face model directory
    inside the image or a mounted volume), `pvc://CLAIM/path` (a directory on
    a PersistentVolumeClaim, mounted read-only), `hf://ORG/NAME` (downloaded
    from the Hugging Face Hub by an init container: config, tokenizer and
    safetensors), `hf://ORG/NAME/FILE.gguf` (one GGUF file of a Hub
    repository), or a built-in model: `builtin://tiny` (pdfleet's small
    random-weight test model) or `builtin://smollm2-135m-instruct`
    (SmolLM2-135M-Instruct, shipped in the image), prepared when a pod starts."""
    revision: str | None = Field(default=None, max_length=128, pattern=REVISION_PATTERN)
    """Model revision (a commit or tag). Part of the compatibility hash, so
    prefill and decode engines serving different weights never exchange KV.
    For `hf://`, the branch, tag or commit to download (default main); a
    40-character commit is checked against what the Hub serves. Letters,
    digits and `. _ - /`, not starting with `-` and without `..`."""
    token_secret: HubTokenSecret | None = None
    """`hf://` models and adapters only: Secret holding a Hugging Face token
    (private or gated repositories)."""
    cache: ModelCacheSpec | None = None
    """`hf://` models and adapters only: PersistentVolumeClaim for the
    download cache; each pod downloads into its own emptyDir when unset."""
    hf_endpoint: str | None = None
    """`hf://` models and adapters only: base URL of the Hub or a mirror (the
    HF_ENDPOINT variable); the public Hub when unset."""

    @field_validator("revision")
    @classmethod
    def _check_revision(cls, revision: str | None) -> str | None:
        if revision is not None and (".." in revision or "//" in revision):
            raise ValueError(f"{revision!r}: a revision holds no '..' or '//'")
        return revision

    @field_validator("uri")
    @classmethod
    def _check_uri(cls, uri: str) -> str:
        scheme, sep, rest = uri.partition("://")
        if not sep or scheme not in MODEL_URI_SCHEMES:
            raise ValueError(
                f"{uri!r} is not a supported model location; use file:///path/to/model, "
                "pvc://CLAIM/path, hf://ORG/NAME or builtin://NAME"
            )
        if scheme == "file" and not rest.startswith("/"):
            raise ValueError(f"{uri!r}: a file URI needs an absolute path (file:///models/x)")
        if scheme == "pvc" and not re.fullmatch(OBJECT_NAME_PATTERN, rest.split("/", 1)[0]):
            raise ValueError(
                f"{uri!r}: name the claim (a Kubernetes object name), e.g. "
                "pvc://models/llama-3.1-8b"
            )
        if scheme in ("file", "pvc") and "/../" in f"{rest}/":
            raise ValueError(f"{uri!r}: the path holds '..'")
        if scheme == "builtin" and rest not in BUILTIN_MODELS:
            raise ValueError(f"{uri!r}: the built-in models are {', '.join(BUILTIN_MODELS)}")
        if scheme == "hf":
            parse_hf_uri(uri)  # its ValueError names the expected shape
        return uri

    def hub_fields_set(self) -> list[str]:
        """The hf://-only fields that are set (checked against spec.adapters too)."""
        values = (
            ("tokenSecret", self.token_secret),
            ("cache", self.cache),
            ("hfEndpoint", self.hf_endpoint),
        )
        return [field for field, value in values if value is not None]

    @model_validator(mode="after")
    def _check_endpoint(self) -> ModelSpec:
        if self.hf_endpoint is not None and not re.match(r"^https?://[^\s]+$", self.hf_endpoint):
            raise ValueError(f"hfEndpoint {self.hf_endpoint!r} is not an http(s) URL")
        return self


ADAPTER_SOURCE_SCHEMES = ("file", "pvc", "hf")


class AdapterSpec(SpecModel):
    """A LoRA adapter served on top of the model (a PEFT directory:
    adapter_config.json and adapter_model.safetensors)."""

    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")
    """The name clients give as `model` to use the adapter. Letters, digits and
    `. _ : / -`, starting with a letter or digit; unique in the list and not
    the model's name."""
    source: str
    """Where the adapter is: `hf://ORG/NAME` (downloaded by the init container
    that fetches the model, with spec.model.tokenSecret, spec.model.cache and
    spec.model.hfEndpoint), `file:///path` (a directory inside the image or a
    volume) or `pvc://CLAIM/path` (a directory on a PersistentVolumeClaim,
    mounted read-only)."""
    revision: str | None = Field(default=None, max_length=128, pattern=REVISION_PATTERN)
    """`hf://` only: the branch, tag or commit to download (default main)."""

    @field_validator("source")
    @classmethod
    def _check_source(cls, source: str) -> str:
        scheme, sep, rest = source.partition("://")
        if scheme == "builtin":
            raise ValueError(
                f"{source!r}: pdfleet ships no built-in LoRA adapters; use hf://ORG/NAME, "
                "file:///path or pvc://CLAIM/path"
            )
        if not sep or scheme not in ADAPTER_SOURCE_SCHEMES:
            raise ValueError(
                f"{source!r} is not a supported adapter location; use hf://ORG/NAME, "
                "file:///path or pvc://CLAIM/path"
            )
        if scheme == "file" and not rest.startswith("/"):
            raise ValueError(f"{source!r}: a file URI needs an absolute path (file:///adapters/x)")
        if scheme == "pvc":
            claim = rest.partition("/")[0]
            if not re.fullmatch(OBJECT_NAME_PATTERN, claim):
                raise ValueError(
                    f"{source!r}: name the claim (a Kubernetes object name), e.g. "
                    "pvc://adapters/sql"
                )
        if scheme in ("file", "pvc") and "/../" in f"{rest}/":
            raise ValueError(f"{source!r}: the path holds '..'")
        if scheme == "hf":
            hf = parse_hf_uri(source)  # its ValueError names the expected shape
            if hf.filename is not None:
                raise ValueError(f"{source!r}: an adapter is a repository (hf://ORG/NAME)")
        return source

    @field_validator("revision")
    @classmethod
    def _check_revision(cls, revision: str | None) -> str | None:
        if revision is not None and (".." in revision or "//" in revision):
            raise ValueError(f"{revision!r}: a revision holds no '..' or '//'")
        return revision

    @model_validator(mode="after")
    def _revision_needs_hf(self) -> AdapterSpec:
        if self.revision is not None and not self.source.startswith("hf://"):
            raise ValueError(f"revision applies to hf:// adapters only (source is {self.source})")
        return self


class KVTransferSpec(SpecModel):
    """How prefill engines hand KV blocks to decode engines."""

    connector: Literal["NixlConnector", "ZmqConnector"] | None = None
    """KV connector: `NixlConnector` (NIXL over UCX; RDMA when the network
    has it) or `ZmqConnector` (block bytes over ZeroMQ, for nodes without
    NIXL). Required unless `disaggregation.mode` is `Disabled`."""
    backends: list[str] = Field(default_factory=lambda: ["UCX"])
    """NIXL backends, in order of preference (NixlConnector only)."""
    lease_seconds: float = Field(default=30.0, gt=0)
    """How long a prefill engine holds a prompt's KV blocks for the decode
    engine that will pull them; unclaimed blocks are freed after it."""
    load_failure_policy: Literal["recompute", "fail"] = "recompute"
    """When a decode engine cannot pull a prompt's KV: `recompute` it locally
    (the request still completes) or `fail` the request with an error."""
    port: int = Field(default=14579, ge=1, le=65535)
    """Port of the connector's side channel on every engine pod."""
    handshake_timeout_seconds: float | None = Field(default=None, gt=0)
    """Bound on the connector handshake between two engines (connector default
    when unset)."""
    transfer_timeout_seconds: float | None = Field(default=None, gt=0)
    """Bound on one KV pull (connector default when unset)."""
    ucx_transports: str = "cuda_copy,cuda_ipc,rc,sm,self,tcp"
    """`UCX_TLS` of engine pods that request GPUs (NixlConnector only): the UCX
    transports for KV in GPU memory (cuda_copy, cuda_ipc within a node, rc for
    RDMA between nodes) with shared memory and TCP as fallbacks. A role's own
    `UCX_TLS` in `env` wins. See docs/gpu.md for what TCP-only UCX costs."""
    rdma_resource: str | None = None
    """Extended resource of one RDMA device (e.g. `rdma/rdma_shared_device_a`
    from the RDMA shared device plugin): when set, every engine pod requests
    one and gets the `IPC_LOCK` capability that RDMA memory registration
    needs (outside the `restricted` Pod Security profile)."""
    extra_config: Annotated[
        dict[str, Any],
        # The typed keys are declared so that the CRD's CEL rules can see them
        # (CEL reads only declared properties of an object that keeps unknown
        # fields). They stay untyped on purpose: the rules refuse any value
        # there, naming the kvTransfer field to set instead, which a type
        # error would pre-empt with a worse message.
        PassThrough(
            "kv_connector_extra_config",
            {
                "properties": {
                    k: {"x-kubernetes-preserve-unknown-fields": True} for k in TYPED_EXTRA_KEYS
                }
            },
        ),
    ] = Field(default_factory=dict)
    """More connector options, merged into `kv_connector_extra_config`
    (snake_case keys, as the engine reads them)."""
    identity: Literal["Required", "Disabled"] = "Required"
    """Per-engine identities on the KV side channel (docs/security.md,
    "Identities"). `Required`: each engine pod generates its own key at start
    and gets a short-lived token for it from the operator's identity endpoint
    (checked against the pod's ServiceAccount token and role label); a lease
    binds to that identity, and peers without one are refused. An engine that
    cannot reach the endpoint within 2 minutes exits, saying why. `Disabled`:
    engines run with the fleet secret alone, and leases bind to the stated
    engine ids and the claimant's address."""

    @model_validator(mode="after")
    def _extra_config_repeats_no_field(self) -> KVTransferSpec:
        for key in TYPED_EXTRA_KEYS:
            if key in self.extra_config:
                raise FieldPathError(
                    f"extraConfig.{key}",
                    f"repeats a setting kvTransfer has a field for; set kvTransfer.{camel(key)} "
                    "instead",
                )
        return self


class SecretKeyRef(SpecModel):
    """A key of a Secret in the InferenceService's namespace."""

    name: SecretName
    """Name of the Secret (not one of the operator's: names ending in -fleet or
    -identity are refused)."""
    key: SecretKey = "api-key"
    """Key within the Secret."""

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        return _not_a_fleet_secret(name)


class Resources(SpecModel):
    """Compute resources of one container (core/v1 ResourceRequirements)."""

    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Limits, e.g. {cpu: "8", memory: 64Gi, nvidia.com/gpu: 1}."""
    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Requests; default to the limits for extended resources such as GPUs."""


# What the CRD declares of an EnvVar (for the rules in crd.py); the API server
# checks the rest when it creates the pod. Written out rather than generated:
# it is a partial schema (each level keeps its unknown fields, and only what
# the CEL rules read is declared), of a Kubernetes type pdfleet has no model
# of (`env` passes through; `check_env_var` is the resource model's check),
# so a model written only to emit these few properties would be a second
# declaration of the same thing.
ENV_VAR_KNOWN: dict[str, Any] = {
    "required": ["name"],
    "properties": {
        "name": {"type": "string", "maxLength": 256},
        "valueFrom": {
            "type": "object",
            "x-kubernetes-preserve-unknown-fields": True,
            "properties": {
                "secretKeyRef": {
                    "type": "object",
                    "x-kubernetes-preserve-unknown-fields": True,
                    "properties": {"name": {"type": "string", "maxLength": 253}},
                }
            },
        },
    },
}


def check_env_var(var: Any, where: str) -> None:
    """``ValueError`` for an EnvVar a role may not set: a pdfleet variable, or a
    reference to a fleet secret (either would move the fleet's credential)."""
    if not isinstance(var, dict) or not isinstance(var.get("name"), str):
        raise ValueError(f"{where}: an EnvVar needs a name")
    name = var["name"]
    if not re.fullmatch(ENV_NAME_PATTERN, name):
        raise ValueError(f"{where}: {name!r} is not a variable name")
    if name.startswith(RESERVED_ENV_PREFIX):
        raise ValueError(
            f"{where}: {name} is reserved (pdfleet sets its {RESERVED_ENV_PREFIX}* variables "
            "itself: the fleet secret's file, API keys, the KV address)"
        )
    ref = (var.get("valueFrom") or {}).get("secretKeyRef") if "valueFrom" in var else None
    if isinstance(ref, dict) and str(ref.get("name", "")).endswith(FLEET_SECRET_SUFFIX):
        raise ValueError(
            f"{where}: {name} may not read the Secret {ref.get('name')!r} (names ending in "
            f"{FLEET_SECRET_SUFFIX} are fleet secrets)"
        )
    if isinstance(ref, dict) and str(ref.get("name", "")).endswith(IDENTITY_SECRET_SUFFIX):
        raise ValueError(
            f"{where}: {name} may not read the Secret {ref.get('name')!r} (names ending in "
            f"{IDENTITY_SECRET_SUFFIX} hold identity authorities)"
        )


class PodPlacement(SpecModel):
    """Where and with what a role's pods run."""

    resources: Resources = Field(default_factory=Resources)
    """Compute resources of the main container."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the pods require."""
    tolerations: list[Annotated[dict[str, Any], PassThrough("core/v1 Toleration")]] = Field(
        default_factory=list
    )
    """Tolerations of the pods (core/v1 Toleration objects)."""
    affinity: Annotated[dict[str, Any], PassThrough("core/v1 Affinity")] = Field(
        default_factory=dict
    )
    """Affinity of the pods (a core/v1 Affinity object)."""
    env: list[Annotated[dict[str, Any], PassThrough("core/v1 EnvVar", ENV_VAR_KNOWN)]] = Field(
        default_factory=list, max_length=256
    )
    """Extra environment variables of the main container (core/v1 EnvVar
    objects), e.g. UCX_TLS or UCX_NET_DEVICES. Names starting with PDFLEET_
    (pdfleet's own settings and credentials) and references to a fleet
    secret (a Secret named NAME-fleet) or an identity authority (NAME-identity)
    are refused."""

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, var in enumerate(env):
            check_env_var(var, f"env[{i}]")
        return env


class RoleSpec(PodPlacement):
    """One engine pool: prefill or decode."""

    replicas: int = Field(default=1, ge=0)
    """Number of engines (pods, or pod groups when nodesPerReplica > 1). With
    `autoscaling` set, the starting point, kept within the role's
    minReplicas..maxReplicas."""
    engine: EngineSettings = Field(default_factory=dict)
    """Engine settings for this role only; each key overrides the same key of
    `spec.engine` (same keys and meaning). `tensorParallelSize` may differ
    between the roles (e.g. prefill 1, decode 4)."""
    nodes_per_replica: int = Field(default=1, ge=1, le=64)
    """Pods (nodes) one engine spans. 1: each engine is one pod of a
    Deployment, its tensorParallelSize ranks on that pod's accelerators. More:
    each engine is a LeaderWorkerSet group (leaderworkerset.x-k8s.io/v1, whose
    controller must be installed) of this many pods holding
    tensorParallelSize / nodesPerReplica ranks each; the leader pod serves the
    API and the gateway routes to leaders only (docs/parallelism-k8s.md)."""
    shm_size: Quantity | None = None
    """Size of the memory-backed /dev/shm volume (NCCL, UCX and the tokenizer
    pool use shared memory). Default: 1Gi for one rank per pod, 4Gi per rank
    when a pod runs several tensor-parallel ranks."""
    accelerator_resource: str = Field(default="nvidia.com/gpu", min_length=1)
    """Extended resource of one accelerator. When the engine runs more than one
    rank (or the resources already name it), the operator requests
    tensorParallelSize / nodesPerReplica of it per pod."""
    peer_pull: bool = False
    """Peer pulls (docs/peer-pull.md): the role's engines lend the prefix blocks
    they cache (device or host tier) to each other over the KV connector
    (`kv_role: kv_both`), and the gateway serves a request whose prefix one
    engine holds on that engine, on another that pulls the prefix from it, or
    on another that recomputes it, whichever its measured costs predict is
    fastest. For the role that computes prompts: decode in an aggregated fleet
    (`disaggregation.mode: Disabled`), prefill in a disaggregating one (a
    prefill engine pulls the cached part of a prompt from a peer, computes the
    tail and hands it all to the decode engine; the decode engines lend what
    they hold too, such as a chat's last turn and its answer, and still
    consume the prefill legs' KV). Needs `kvTransfer.connector` and
    `gateway.kvEvents`."""

    @field_validator("engine")
    @classmethod
    def _check_engine(cls, engine: dict[str, Any]) -> dict[str, Any]:
        return validate_engine_section(engine)


class DisaggregationSpec(SpecModel):
    """When the gateway splits a request into a prefill leg and a decode leg."""

    mode: Literal["Always", "Conditional", "Disabled"] = "Conditional"
    """`Always` (every request), `Conditional` (prompts of at least
    minPromptTokens that the decode engine does not already cache), or
    `Disabled` (decode engines serve whole requests; no prefill pods, no KV
    connector)."""
    min_prompt_tokens: int = Field(default=256, ge=0)
    """Conditional mode: shorter prompts go straight to a decode engine."""


def _bounded(flag_field: str, default: float | None) -> Any:
    """A gateway setting's Field, bounded as its flag is (``FLOAT_BOUNDS``):
    finite, within range, and a number (a boolean or a string is refused,
    not converted)."""
    low, high, open_low = FLOAT_BOUNDS[flag_field]
    return Field(
        default=default,
        gt=low if open_low else None,
        ge=None if open_low else low,
        le=high,
        allow_inf_nan=False,
        strict=True,
    )


class TenantsSource(SpecModel):
    """Where the gateway's tenants file comes from: one key of a Secret (when
    it lists API keys, as it usually does) or of a ConfigMap."""

    secret: SecretName | None = None
    """Name of a Secret holding the file."""
    config_map: SecretName | None = None
    """Name of a ConfigMap holding the file (keys in a ConfigMap are readable by
    whoever may read ConfigMaps: prefer a Secret)."""
    key: SecretKey = "tenants.yaml"
    """Key of the Secret or ConfigMap whose value is the file (YAML or JSON,
    docs/flow-control.md)."""

    @field_validator("secret")
    @classmethod
    def _check_secret(cls, name: str | None) -> str | None:
        return None if name is None else _not_a_fleet_secret(name)

    @model_validator(mode="after")
    def _one_source(self) -> TenantsSource:
        if (self.secret is None) == (self.config_map is None):
            raise ValueError("tenants: give exactly one of secret or configMap")
        return self


class DatabaseSecretRef(SecretKeyRef):
    """A key of a Secret holding a PostgreSQL URL."""

    key: SecretKey = "url"
    """Key within the Secret: `postgresql://user:password@host:5432/db`."""


class GatewayBatchSpec(SpecModel):
    """The OpenAI Batch API on the gateway (`/v1/files`, `/v1/batches`) and
    where its state lives: a SQLite database and the files in a data directory
    (a claim or an emptyDir; one gateway replica), or a PostgreSQL database that
    any number of gateway replicas share."""

    claim_name: SecretName | None = None
    """A PersistentVolumeClaim the gateway mounts as its data directory
    (ReadWriteOnce is enough): batches and files survive gateway restarts,
    rollouts and rescheduling. The gateway then rolls by recreating its pod
    (the old pod lets go of the claim before the new one opens it)."""
    empty_dir: bool = False
    """An emptyDir instead of a claim: the state is the pod's own and is lost
    with the pod (a rollout, an eviction, a node failure loses every batch and
    file). For trials only."""
    database_secret: DatabaseSecretRef | None = None
    """A Secret key holding a PostgreSQL URL: the gateway replicas share that
    database (files included), run its batches together, and roll like any
    Deployment. The database is yours to run and back up."""

    @model_validator(mode="after")
    def _one_storage(self) -> GatewayBatchSpec:
        given = [self.claim_name is not None, self.empty_dir, self.database_secret is not None]
        if sum(given) != 1:
            raise ValueError(
                "gateway.batch: give exactly one of claimName, emptyDir: true or databaseSecret"
            )
        return self


class GatewaySpec(PodPlacement):
    """The OpenAI-compatible gateway in front of the engines."""

    replicas: int = Field(default=1, ge=0)
    """Number of gateway pods (stateless; any number works, but with `batch` on
    a claim or an emptyDir at most 1)."""
    port: int = Field(default=8000, ge=1, le=65535)
    """Port of the gateway Service and its pods."""
    api_key_secret: SecretKeyRef | None = None
    """Secret holding the API key clients must send as a Bearer token; no
    authentication when unset."""
    trust_client_trace_context: bool = False
    """Continue the trace of a client's `traceparent`, sampled flag included
    (`--trust-client-trace-context`, when tracing is on). Off: each request
    starts a new trace that the configured sampler decides on, linked to the
    client's span."""
    kv_events: bool = True
    """Route on the engines' KV event streams (docs/kv_events.md): every engine
    whose prefix cache is on publishes the blocks it caches, and the gateway
    scores engines from that exact index. Off: engines publish nothing and the
    gateway estimates from its own routing history. An engine section that
    sets `kvEventsConfig` itself is left as it is."""
    stall_timeout_seconds: float = _bounded("stall_timeout", 5.0)
    """The least time an engine with requests in flight may send nothing
    before the gateway counts it as stalled (`--stall-timeout`); the limit
    follows each engine: stallStepMultiple times its longest recent step
    when that is longer. A stalled engine leaves routing only while another
    engine of its role progresses, never as the last one of its role."""
    stall_step_multiple: float = _bounded("stall_step_multiple", 4.0)
    """How many of an engine's longest recent steps without progress make a
    stall (`--stall-step-multiple`); 0: stallTimeoutSeconds alone."""
    stall_max_step_seconds: float | None = _bounded("stall_max_step", None)
    """How long one engine step may run before the engine counts as stalled
    although it answers its checks (`--stall-max-step`): an engine busy in a
    step it reports is not stalled until then. Default max(120,
    stallTimeoutSeconds × stallStepMultiple)."""
    queue_timeout_seconds: float = _bounded("queue_timeout", 60.0)
    """How long a request waits for a slot while every decode engine is at
    capacity before a 503 with Retry-After (`--queue-timeout`); one that
    could not get a slot in time is refused at once (429)."""
    max_queued_requests: int = Field(default=1024, ge=0, le=1_000_000, strict=True)
    """Requests that may wait for a slot at once; more get a 429 with
    Retry-After at once (`--max-queued-requests`)."""
    tenants: TenantsSource | None = None
    """The tenants file (`--tenants-file`): API keys grouped into tenants with
    a weight, a priority band, in-flight, queue and rate limits and cache
    sharing (docs/flow-control.md). Its keys are accepted API keys. Unset:
    every API key is its own tenant of equal weight. Read when a gateway pod
    starts: roll the gateway after changing it."""
    batch: GatewayBatchSpec | None = None
    """The OpenAI Batch API and where its state lives (a PersistentVolumeClaim,
    an emptyDir whose state is the pod's own, or a PostgreSQL database). Unset:
    the Batch API is off (`/v1/files` and `/v1/batches` answer 404). A claim or
    an emptyDir needs replicas at most 1."""
    engine_priority: bool = False
    """Pass each request's priority band to the engines (`--engine-priority`),
    and run the engines with `--scheduling-policy priority` so that they admit
    and preempt by it."""
    max_migrations: int = Field(default=3, ge=0, le=100, strict=True)
    """Times one request may move to another decode engine when its decode
    engine dies, stalls or drains mid-answer, resumed from the tokens the
    client already has (`--max-migrations`, docs/migration.md); then it fails
    with a clear error. 0: no migration."""

    @model_validator(mode="after")
    def _batch_on_one_replica(self) -> GatewaySpec:
        if self.batch is not None and self.batch.database_secret is None and self.replicas > 1:
            raise ValueError(
                f"gateway.batch: the Batch API keeps its state in one SQLite database, "
                f"which one gateway replica may open: set gateway.replicas to 1 (it is "
                f"{self.replicas}), or give batch.databaseSecret (PostgreSQL, shared by "
                f"the replicas)"
            )
        return self

    def overload_settings(self) -> dict[str, Any]:
        """The gateway flags of these fields (``GatewayConfig`` keyword arguments)."""
        return {
            "stall_timeout": self.stall_timeout_seconds,
            "stall_step_multiple": self.stall_step_multiple,
            "stall_max_step": self.stall_max_step_seconds,
            "queue_timeout": self.queue_timeout_seconds,
            "max_queued_requests": self.max_queued_requests,
            "engine_priority": self.engine_priority,
            "max_migrations": self.max_migrations,
        }


class ServingSpec(SpecModel):
    """OpenAI server settings of every engine, prefill and decode alike (the
    `pdfleet serve` flags that are not engine settings; docs/tool_calling.md)."""

    chat_template: str | None = Field(default=None, min_length=1)
    """A Jinja chat template used instead of the tokenizer's (`--chat-template`):
    the template itself (text holding `{{` or `{%`), or the path of a file
    inside the engine image or the model's directory. It receives `messages`
    and, with tools, `tools`. The gateway renders chat prompts with it too (to
    count their tokens and hash their prefix blocks): it runs the engines'
    image and mounts the model where they do, so it reads the same file."""
    tool_call_parser: Literal["hermes", "llama3_json", "mistral"] | None = None
    """How tool calls are read from the model's text (`--tool-call-parser`,
    vLLM's parser names). Needed for `tool_choice: auto`. Unset: the model's
    own when it names one (the built-in smollm2-135m-instruct: hermes, with
    its tools-aware chat template), else none."""
    enable_auto_tool_choice: bool | None = None
    """Let the model decide when to call tools (`--enable-auto-tool-choice`);
    needs toolCallParser. Unset: on for a model that names its parser (the
    built-in smollm2-135m-instruct), else off; false turns it off."""
    reasoning_parser: Literal["qwen3", "deepseek_r1"] | None = None
    """How a thinking model's `<think>…</think>` text is split from its answer
    (`--reasoning-parser`, vLLM's names): returned as `message.reasoning`
    (and `reasoning_content`), streamed apart from the content. `qwen3`:
    output without `</think>` is all answer (thinking switched off);
    `deepseek_r1`: it is all reasoning. Unset: no split. Every engine gets it
    (any engine may answer a whole request)."""

    @model_validator(mode="after")
    def _auto_needs_parser(self) -> ServingSpec:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError(
                "enableAutoToolChoice needs toolCallParser (hermes, llama3_json or mistral)"
            )
        return self


# --------------------------------------------------------------------------
# --------------------------------------------------------------------------


class InferenceServiceSpec(SpecModel):
    """A model served by a prefill pool and a decode pool behind a gateway."""

    model: ModelSpec
    """The model to serve."""
    image: str | None = None
    """Image of the engine and gateway pods; the operator's default engine
    image when unset."""
    engine: EngineSettings = Field(default_factory=dict)
    """Engine settings of both roles: the `pdfleet serve` flags in camelCase
    (maxNumBatchedTokens <-> --max-num-batched-tokens)."""
    kv_transfer: KVTransferSpec = Field(default_factory=KVTransferSpec)
    """KV transfer between the roles."""
    prefill: RoleSpec = Field(default_factory=RoleSpec)
    """The prefill pool."""
    decode: RoleSpec = Field(default_factory=RoleSpec)
    """The decode pool."""
    disaggregation: DisaggregationSpec = Field(default_factory=DisaggregationSpec)
    """Which requests are split into prefill and decode legs."""
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    """The gateway."""
    serving: ServingSpec = Field(default_factory=ServingSpec)
    """OpenAI server settings shared by every engine: chat template and tool calling."""
    autoscaling: AutoscalingSpec | None = None
    """Scale the pools from engine metrics; fixed replica counts when unset."""
    adapters: Annotated[list[AdapterSpec], ListMap("name")] = Field(
        default_factory=list, max_length=256
    )
    """LoRA adapters served on top of the model; a request names one by
    `model`. A non-empty list turns LoRA on in both roles (enableLora, with
    maxLoras 4 and maxLoraRank 16 unless spec.engine sets them). Adding or
    removing a file:// adapter, or a pvc:// one on a claim the pods already
    mount, loads or unloads it on the running engines; an hf:// adapter or a
    new claim changes the pods, which roll."""

    @field_validator("engine")
    @classmethod
    def _check_engine(cls, engine: dict[str, Any]) -> dict[str, Any]:
        return validate_engine_section(engine)

    @model_validator(mode="after")
    def _check_adapters(self) -> InferenceServiceSpec:
        hub = self.model.uri.startswith("hf://") or any(
            a.source.startswith("hf://") for a in self.adapters
        )
        for field in self.model.hub_fields_set() if not hub else []:
            raise ValueError(
                f"model.{field} applies to hf:// models only (uri is {self.model.uri}) "
                "and hf:// adapters (spec.adapters has none)"
            )
        if not self.adapters:
            return self
        seen: set[str] = set()
        for i, adapter in enumerate(self.adapters):
            if adapter.name in seen:
                raise ValueError(f"adapters[{i}].name: {adapter.name!r} is given twice")
            if adapter.name == self.model.name:
                raise ValueError(
                    f"adapters[{i}].name: {adapter.name!r} is the model's name (spec.model.name)"
                )
            seen.add(adapter.name)
        sections = {"engine": self.engine}
        sections.update({f"{r}.engine": self.role(r).engine for r in ROLES})
        for where, section in sections.items():
            if section.get("enableLora") is False:
                raise ValueError(
                    f"{where}.enableLora is false but spec.adapters lists adapters, which need "
                    "LoRA: remove enableLora (the adapters turn it on) or the adapters"
                )
            if section.get("loraModules"):
                raise ValueError(
                    f"{where}.loraModules: with spec.adapters, list every adapter there "
                    "(spec.adapters is fetched into the pods and kept loaded)"
                )
        return self

    @model_validator(mode="after")
    def _engine_priority_needs_the_priority_policy(self) -> InferenceServiceSpec:
        if self.gateway.engine_priority:
            for role in ROLES:
                section = {**self.engine, **self.role(role).engine}
                if section.get("schedulingPolicy") != "priority":
                    raise ValueError(
                        "gateway.enginePriority: the engines must schedule by priority: set "
                        f"engine.schedulingPolicy: priority (the {role} engines run "
                        f"{section.get('schedulingPolicy', 'fcfs')})"
                    )
        return self

    @property
    def disaggregating(self) -> bool:
        """Whether requests are split into a prefill and a decode leg."""
        return self.disaggregation.mode != "Disabled"

    def engine_value(self, role: str, key: str, default: Any = None) -> Any:
        """The role's engine setting ``key``: its own, else spec.engine's, else ``default``."""
        return self.role(role).engine.get(key, self.engine.get(key, default))

    @model_validator(mode="after")
    def _cross_field_rules(self) -> InferenceServiceSpec:
        # All of them at once: a spec that breaks several learns of every one.
        errors = [*self._connector_problems(), *self._kv_shape_problems()]
        if errors:
            raise FieldPathErrors(errors)
        return self

    def _connector_problems(self) -> list[FieldPathError]:
        """The KV connector and peer pulls: what moves KV between engines."""
        out = []
        connector = self.kv_transfer.connector
        # Peer pulls serve the role that computes prompts: decode in an aggregated
        # fleet, prefill in a disaggregating one.
        pulling = "prefill" if self.disaggregating else "decode"
        for role in ("prefill", "decode"):
            if self.role(role).peer_pull and role != pulling:
                out.append(self._peer_pull_role_problem(role))
        if self.role(pulling).peer_pull and connector is None:
            out.append(
                FieldPathError(
                    "kvTransfer.connector",
                    f"{pulling}.peerPull moves KV between engines and needs a KV connector: "
                    "set kvTransfer.connector to NixlConnector (or ZmqConnector without NIXL)",
                )
            )
        if self.role(pulling).peer_pull and not self.gateway.kv_events:
            out.append(
                FieldPathError(
                    "gateway.kvEvents",
                    f"{pulling}.peerPull needs the exact prefix index (which engine holds "
                    "which blocks): set gateway.kvEvents: true",
                )
            )
        if self.disaggregating and connector == "ZmqConnector":
            for role in ROLES:
                tp = self.engine_value(role, "tensorParallelSize", 1)
                if tp > 1:
                    out.append(self._zmq_problem(role, tp))
                    break
        return out

    def _peer_pull_role_problem(self, role: str) -> FieldPathError:
        if role == "prefill":
            return FieldPathError(
                "prefill.peerPull",
                "prefill engines run only while disaggregating (disaggregation.mode is "
                "Disabled): set peerPull on the decode role of an aggregated fleet",
            )
        return FieldPathError(
            "decode.peerPull",
            "in a disaggregating fleet the prefill engines compute prompts and pull cached "
            f"prefixes (disaggregation.mode is {self.disaggregation.mode}): set "
            "prefill.peerPull, or disaggregation.mode: Disabled",
        )

    def _zmq_problem(self, role: str, tp: int) -> FieldPathError:
        # Each rank holds its KV heads' shard in its own process (over several
        # pods, on its own pod); ZMQ reads one process's memory.
        nodes = self.role(role).nodes_per_replica
        where = f" on {nodes} pods (spec.{role}.nodesPerReplica)" if nodes > 1 else ""
        return FieldPathError(
            "kvTransfer.connector",
            f"ZmqConnector moves KV from one process's memory and cannot reach the "
            f"{tp} KV shards of {role} tensorParallelSize {tp}{where} "
            "(docs/parallelism.md): use NixlConnector (every rank reads its own shard), "
            "or tensorParallelSize 1" + (" and nodesPerReplica 1" if nodes > 1 else ""),
        )

    def _kv_shape_problems(self) -> list[FieldPathError]:
        """What the two roles of a disaggregated fleet must agree on."""
        if not self.disaggregating:
            return []  # no KV moves between the roles
        out = []
        for key, default, why in KV_SHAPE_KEYS:
            p = self.engine_value("prefill", key, default)
            d = self.engine_value("decode", key, default)
            if p != d:
                role = "decode" if key in self.decode.engine else "prefill"
                out.append(
                    FieldPathError(
                        f"{role}.engine.{key}",
                        f"prefill has {p!r} but decode has {d!r} ({why}); set {key} once in "
                        "spec.engine, not per role",
                    )
                )
        return out

    def role(self, role: str) -> RoleSpec:
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLES)}")
        return self.prefill if role == "prefill" else self.decode


# --------------------------------------------------------------------------
# status


class Condition(BaseModel):
    """A metav1.Condition."""

    model_config = ConfigDict(
        use_attribute_docstrings=True, alias_generator=camel, populate_by_name=True
    )

    type: str
    """Ready, PrefillReady, DecodeReady, GatewayReady or KVTransferHealthy."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str
    """One CamelCase word saying why."""
    message: str = ""
    """What happened and, when something is wrong, what to change."""
    last_transition_time: str | None = None
    """When the status last changed (RFC 3339)."""
    observed_generation: int | None = None
    """The spec generation the condition describes."""


class RoleStatus(BaseModel):
    """Replica counts of one role."""

    model_config = ConfigDict(
        use_attribute_docstrings=True, alias_generator=camel, populate_by_name=True
    )

    replicas: int = 0
    """Pods that exist."""
    ready_replicas: int = 0
    """Pods that are ready (model loaded, serving)."""
    updated_replicas: int = 0
    """Pods running the current spec."""
    desired_replicas: int = 0
    """Pods wanted (by the spec or the autoscaler)."""
    summary: str = "0/0"
    """ready/desired, for `kubectl get`."""
    running: int | None = None
    """Requests running on the role's ready engines (last scrape)."""
    waiting: int | None = None
    """Requests waiting on the role's ready engines (last scrape)."""
    kv_cache_usage: float | None = None
    """Mean KV-cache usage of the role's ready engines, 0-1 (last scrape)."""
    prefix_hit_rate: float | None = None
    """Prefix-cache hits over lookups since the engines started, 0-1."""
    load: str | None = None
    """running/waiting, KV usage and prefix hit rate, for `kubectl get -o wide`."""


class RolesStatus(BaseModel):
    """Replica counts per role."""

    model_config = ConfigDict(
        use_attribute_docstrings=True, alias_generator=camel, populate_by_name=True
    )

    prefill: RoleStatus = Field(default_factory=RoleStatus)
    """The prefill pool."""
    decode: RoleStatus = Field(default_factory=RoleStatus)
    """The decode pool."""
    gateway: RoleStatus = Field(default_factory=RoleStatus)
    """The gateway."""


class ScalingRecord(BaseModel):
    """One replica change made by the autoscaler."""

    model_config = ConfigDict(
        use_attribute_docstrings=True, alias_generator=camel, populate_by_name=True
    )

    role: str
    """prefill or decode."""
    from_: int = Field(alias="from")
    """Replicas before."""
    to: int
    """Replicas after."""
    reason: str
    """Why, in the policy's words (metric, value and target)."""
    time: str
    """When (RFC 3339)."""
    applied: bool = True
    """False in mode Advisory: the autoscaler computed the change and left
    the replicas as they were."""

    @classmethod
    def change(
        cls, role: str, before: int, after: int, reason: str, time: str, *, applied: bool
    ) -> ScalingRecord:
        """One change (``from`` is a Python keyword: no keyword argument can name it)."""
        return cls.model_validate(
            {
                "role": role,
                "from": before,
                "to": after,
                "reason": reason,
                "time": time,
                "applied": applied,
            }
        )


class AutoscalingStatus(BaseModel):
    """What the autoscaler did."""

    model_config = ConfigDict(
        use_attribute_docstrings=True, alias_generator=camel, populate_by_name=True
    )

    mode: Literal["Active", "Advisory"] | None = None
    """The mode of the latest decisions recorded (spec.autoscaling.mode)."""
    last_decisions: list[ScalingRecord] = Field(default_factory=list)
    """The most recent replica changes (applied or, in mode Advisory, advised),
    newest last."""
    last_scale_time: str | None = None
    """When replicas last changed (RFC 3339)."""


class InferenceServiceStatus(BaseModel):
    """Observed state, written by the operator."""

    model_config = ConfigDict(
        use_attribute_docstrings=True, alias_generator=camel, populate_by_name=True
    )

    phase: Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"] = "Pending"
    """Pending (nothing ready yet), Progressing (rolling out), Ready, Degraded
    (serving with some roles not ready), or Failed (invalid spec)."""
    url: str | None = None
    """OpenAI base URL of the gateway Service."""
    observed_generation: int | None = None
    """The spec generation last acted on."""
    compat_hash: str | None = None
    """Hash of what prefill and decode must agree on; stamped on pods."""
    conditions: list[Condition] = Field(default_factory=list)
    """Ready, PrefillReady, DecodeReady, GatewayReady, KVTransferHealthy."""
    roles: RolesStatus = Field(default_factory=RolesStatus)
    """Replica counts per role."""
    autoscaling: AutoscalingStatus = Field(default_factory=AutoscalingStatus)
    """What the autoscaler did."""


# --------------------------------------------------------------------------
# the whole object


class ObjectMeta(BaseModel):
    """The part of metadata pdfleet reads."""

    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=MAX_NAME_LENGTH, pattern=NAME_PATTERN)
    namespace: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class InferenceService(BaseModel):
    """A whole InferenceService object."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["pdfleet.dev/v1alpha1"] = Field(alias="apiVersion")
    kind: Literal["InferenceService"]
    metadata: ObjectMeta
    spec: InferenceServiceSpec

    @property
    def name(self) -> str:
        return self.metadata.name


def parse_spec(spec: dict[str, Any] | None) -> InferenceServiceSpec:
    """Validate a live object's ``spec``; ``ValueError`` names each bad field."""
    try:
        return InferenceServiceSpec.model_validate(spec or {}, by_name=False)
    except ValidationError as e:
        raise ValueError(format_validation_error(e, "spec", InferenceServiceSpec)) from None


def load_inference_service(source: str | os.PathLike[str] | dict[str, Any]) -> InferenceService:
    """Load an InferenceService from a YAML file (or an already parsed dict).

    A file may hold several YAML documents; exactly one must be an
    InferenceService. Errors are ``ValueError``s naming the field path, e.g.
    ``spec.prefill.replicas: Input should be greater than or equal to 0``.
    """
    where = "the InferenceService"
    if isinstance(source, dict):
        data = source
    else:
        where = os.fspath(source)
        try:
            with open(source) as f:
                docs = [d for d in yaml.safe_load_all(f) if d is not None]
        except OSError as e:
            raise ValueError(f"cannot read {where}: {e.strerror}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"{where} is not valid YAML: {e}") from None
        found = [d for d in docs if isinstance(d, dict) and d.get("kind") == KIND]
        if len(found) != 1:
            raise ValueError(
                f"{where} must hold exactly one document with kind: {KIND} (found {len(found)})"
            )
        data = found[0]
    try:
        return InferenceService.model_validate(data, by_name=False)
    except ValidationError as e:
        raise ValueError(
            f"{where}:\n{format_validation_error(e, model=InferenceService)}"
        ) from None


def is_valid_name(name: str) -> bool:
    return len(name) <= MAX_NAME_LENGTH and re.fullmatch(NAME_PATTERN, name) is not None
