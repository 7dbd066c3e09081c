"""How a pod gets its model: volumes, mounts and the init container that writes it.

Pure functions of ``spec.model``. ``pvc://`` mounts a claim read-only;
``builtin://`` models are written into an emptyDir by the image itself;
``hf://`` models are downloaded by ``pdfleet fetch-model`` (which runs
``huggingface_hub.snapshot_download`` restricted to what the engine reads)
into a Hugging Face cache — a PersistentVolumeClaim shared between pods when
``spec.model.cache`` names one, else an emptyDir — and linked at the path the
engine loads. See docs/models.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..engine.contracts.model_source import CACHE_DIR_ENV, ENDPOINT_ENV, TOKEN_PATH_ENV
from .resource import AdapterSpec, ModelSpec
from .roles import (
    ADAPTERS_DIR,
    MODELS_DIR,
    adapter_claim,
    adapter_key,
    adapter_path,
    model_source,
    secret_file,
)

HF_CACHE_DIR = "/hf-cache"
"""Where the Hugging Face cache is mounted (init container read-write, others read-only)."""
HF_TOKEN_DIR = "/etc/pdfleet/hf-token"
"""Where the token Secret is mounted in the init container: a file (huggingface_hub
reads it through HF_TOKEN_PATH), never an environment value."""


@dataclass(frozen=True)
class InitStep:
    """One init container's work: what it runs, with which variables and mounts."""

    name: str
    command: list[str]
    env: list[dict[str, Any]] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class ModelVolumes:
    volumes: list[dict[str, Any]]
    """Pod volumes the model needs."""
    mounts: list[dict[str, Any]]
    """Mounts of the main container: read-only, but for the Hugging Face cache
    of a pod that may download adapters at run time (:func:`pod_volumes`)."""
    init: list[InitStep]
    """Init containers that write the model before the main container starts."""
    env: list[dict[str, Any]] = field(default_factory=list)
    """Variables of the main container (its run-time adapter downloads)."""


def model_volumes(model: ModelSpec) -> ModelVolumes:
    source = model_source(model.uri)
    if source.scheme == "pvc":
        volume = {
            "name": "models",
            "persistentVolumeClaim": {"claimName": source.claim, "readOnly": True},
        }
        mount = {"name": "models", "mountPath": f"{MODELS_DIR}/{source.claim}", "readOnly": True}
        return ModelVolumes([volume], [mount], [])
    models = {"name": "models", "emptyDir": {}}
    models_ro = {"name": "models", "mountPath": MODELS_DIR, "readOnly": True}
    writable = [{"name": "models", "mountPath": MODELS_DIR}]
    if source.scheme == "builtin":
        # Written by the image itself: every pod writes the same model.
        if source.builtin == "tiny":
            command = ["pdfleet", "tiny-model", source.path]
        else:
            command = ["pdfleet", "fetch-model", model.uri, "--output", source.path]
        return ModelVolumes([models], [models_ro], [InitStep("write-model", command, [], writable)])
    if source.scheme == "hf":
        return _hf_volumes(model, source.path, models, models_ro, writable)
    return ModelVolumes([], [], [])


def _hf_volumes(
    model: ModelSpec,
    path: str,
    models: dict[str, Any],
    models_ro: dict[str, Any],
    writable: list[dict[str, Any]],
) -> ModelVolumes:
    command = ["pdfleet", "fetch-model", model.uri, "--cache-dir", HF_CACHE_DIR]
    command += ["--output", path]
    if model.revision:
        command += ["--revision", model.revision]
    hub_volumes, env, hub_mounts = _hub_parts(model)
    volumes = [models, *hub_volumes]
    step = InitStep("fetch-model", command, env, [*writable, *hub_mounts])
    # The engine follows the link in /models into the cache, so it mounts both.
    mounts = [models_ro, {"name": "hf-cache", "mountPath": HF_CACHE_DIR, "readOnly": True}]
    return ModelVolumes(volumes, mounts, [step])


def _hub_parts(
    model: ModelSpec,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, env, init mounts) every hf:// download shares: the cache
    (spec.model.cache or an emptyDir), the endpoint and the token Secret."""
    if model.cache is not None:
        cache = {"name": "hf-cache", "persistentVolumeClaim": {"claimName": model.cache.claim}}
    else:
        cache = {"name": "hf-cache", "emptyDir": {}}
    env: list[dict[str, Any]] = [
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        {"name": CACHE_DIR_ENV, "value": "/tmp/pdfleet"},
    ]
    if model.hf_endpoint:
        env.append({"name": ENDPOINT_ENV, "value": model.hf_endpoint})
    volumes = [cache]
    mounts = [{"name": "hf-cache", "mountPath": HF_CACHE_DIR}]
    if model.token_secret is not None:
        token_volume, token_mount, token_env = secret_file(
            "hf-token",
            model.token_secret.name,
            model.token_secret.key,
            HF_TOKEN_DIR,
            "token",
            TOKEN_PATH_ENV,
        )
        env.append(token_env)
        volumes.append(token_volume)
        mounts.append(token_mount)
    return volumes, env, mounts


def adapter_claim_volume(claim: str) -> str:
    """The pod volume of an adapter claim (a DNS label whatever the claim's length)."""
    return f"adapters-{adapter_key(claim)[:12]}"


HUB_CACHE_ENV = "HF_HUB_CACHE"
"""huggingface_hub's cache directory: set in an engine container that may
download hf:// adapters at run time (what :func:`hub_access` looks for)."""


def hub_access(container: dict[str, Any]) -> bool:
    """Whether an engine container can download hf:// adapters itself."""
    return any(e.get("name") == HUB_CACHE_ENV for e in container.get("env") or [])


def pod_volumes(model: ModelSpec, adapters: list[AdapterSpec], hub: bool = False) -> ModelVolumes:
    """The model's volumes and init steps, plus the adapters': each pvc://
    claim mounted read-only under ADAPTERS_DIR/pvc/CLAIM, and one init step per
    hf:// adapter, which fetches it (``pdfleet fetch-model --adapter``) into
    the model's Hugging Face cache with its token and links it at
    :func:`adapter_path`. file:// adapters need nothing.

    ``hub`` (a service with spec.adapters): the engine container itself may
    download hf:// adapters loaded at run time, so it gets the same cache
    (read-write, as ``HF_HUB_CACHE``), token file and endpoint as the init
    steps, whatever adapters the pod starts with: adding an hf:// adapter then
    changes nothing in the pod."""
    base = model_volumes(model)
    volumes, mounts, init = list(base.volumes), list(base.mounts), list(base.init)
    engine_env: list[dict[str, Any]] = []
    if hub:
        hub_volumes, env, hub_mounts = _hub_parts(model)
        names = {v["name"] for v in volumes}
        volumes += [v for v in hub_volumes if v["name"] not in names]
        mounts = [m for m in mounts if m["name"] != "hf-cache"] + hub_mounts
        engine_env = [e for e in env if e["name"] != CACHE_DIR_ENV]
        engine_env.append({"name": HUB_CACHE_ENV, "value": HF_CACHE_DIR})
    for claim in dict.fromkeys(c for a in adapters if (c := adapter_claim(a)) is not None):
        volume = adapter_claim_volume(claim)
        volumes.append(
            {"name": volume, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        )
        mounts.append(
            {"name": volume, "mountPath": f"{ADAPTERS_DIR}/pvc/{claim}", "readOnly": True}
        )
    fetched = [a for a in adapters if a.source.startswith("hf://")]
    if not fetched:
        return ModelVolumes(volumes, mounts, init, engine_env)
    names = {v["name"] for v in volumes}
    hub_volumes, env, hub_mounts = _hub_parts(model)
    volumes += [v for v in hub_volumes if v["name"] not in names]
    volumes.append({"name": "adapters-hf", "emptyDir": {}})
    if not any(m["name"] == "hf-cache" for m in mounts):
        mounts.append({"name": "hf-cache", "mountPath": HF_CACHE_DIR, "readOnly": True})
    mounts.append({"name": "adapters-hf", "mountPath": f"{ADAPTERS_DIR}/hf", "readOnly": True})
    writable = {"name": "adapters-hf", "mountPath": f"{ADAPTERS_DIR}/hf"}
    for adapter in fetched:
        command = ["pdfleet", "fetch-model", adapter.source, "--adapter"]
        command += ["--cache-dir", HF_CACHE_DIR, "--output", adapter_path(adapter)]
        if adapter.revision:
            command += ["--revision", adapter.revision]
        step_name = f"fetch-adapter-{adapter_key(adapter.name)[:12]}"
        init.append(InitStep(step_name, command, list(env), [writable, *hub_mounts]))
    return ModelVolumes(volumes, mounts, init, engine_env)
