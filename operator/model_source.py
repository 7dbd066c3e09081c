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
from .resource import ModelSpec
from .roles import MODELS_DIR, model_source, secret_file

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
    """Read-only mounts of the main container."""
    init: list[InitStep]
    """Init containers that write the model before the main container starts."""


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
    if model.cache is not None:
        cache = {"name": "hf-cache", "persistentVolumeClaim": {"claimName": model.cache.claim}}
    else:
        cache = {"name": "hf-cache", "emptyDir": {}}
    command = ["pdfleet", "fetch-model", model.uri, "--cache-dir", HF_CACHE_DIR]
    command += ["--output", path]
    if model.revision:
        command += ["--revision", model.revision]
    env: list[dict[str, Any]] = [
        {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        {"name": CACHE_DIR_ENV, "value": "/tmp/pdfleet"},
    ]
    if model.hf_endpoint:
        env.append({"name": ENDPOINT_ENV, "value": model.hf_endpoint})
    volumes = [models, cache]
    init_mounts = [*writable, {"name": "hf-cache", "mountPath": HF_CACHE_DIR}]
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
        init_mounts.append(token_mount)
    step = InitStep("fetch-model", command, env, init_mounts)
    # The engine follows the link in /models into the cache, so it mounts both.
    mounts = [models_ro, {"name": "hf-cache", "mountPath": HF_CACHE_DIR, "readOnly": True}]
    return ModelVolumes(volumes, mounts, [step])
