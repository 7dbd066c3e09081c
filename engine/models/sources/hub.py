"""``hf://ORG/NAME`` model sources: download from the Hugging Face Hub (or a mirror).

``download_hf_model`` runs ``huggingface_hub.snapshot_download`` restricted
to the files the engine reads (config, tokenizer, safetensors; or one GGUF
file for ``hf://ORG/NAME/FILE.gguf``) into a Hugging Face cache directory.
Downloads resume, and a second process sharing the cache downloads nothing.
A pinned revision (a 40-character commit) is checked against the commit the
Hub serves. Used by ``pdfleet fetch-model`` (the operator's init container,
and ``pdfleet up``). Torch-free; see docs/models.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from ...contracts.model_source import (
    ENDPOINT_ENV,
    TOKEN_ENV,
    TOKEN_PATH_ENV,
    HFSource,
    parse_hf_uri,
)

# What the engine reads from a safetensors checkpoint (nothing else is fetched).
SAFETENSORS_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "model.safetensors.index.json",
    "*.safetensors",
)
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


# What a LoRA adapter repository holds that the engine reads (PEFT's format).
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


def allow_patterns(source: HFSource, adapter: bool = False) -> list[str]:
    """The files of ``source`` a download fetches (``adapter``: a PEFT LoRA adapter's)."""
    if adapter:
        return list(ADAPTER_FILES)
    return [source.filename] if source.filename else list(SAFETENSORS_FILES)


def _explain(source: HFSource, revision: str, endpoint: str, error: BaseException) -> str:
    """One line saying what went wrong, from huggingface_hub's exception chain."""
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    chain: list[BaseException] = []
    e: BaseException | None = error
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    where = f"hf://{source.repo_id} at {endpoint}"
    for e in chain:
        if isinstance(e, RevisionNotFoundError):
            return f"{where}: revision {revision!r} does not exist"
        if isinstance(e, GatedRepoError):
            return f"{where}: the repository is gated; accept its terms and pass a token that may read it"
        if isinstance(e, RepositoryNotFoundError):
            return (
                f"{where}: repository not found (check the name; a private repository "
                f"needs a token in {TOKEN_ENV} or {TOKEN_PATH_ENV})"
            )
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(e, HfHubHTTPError) and status in (401, 403):
            return f"{where}: the Hub refused the token (HTTP {status}); check the token ({TOKEN_ENV} or {TOKEN_PATH_ENV})"
    return f"{where}: download failed: {type(error).__name__}: {error}"


def download_hf_model(
    uri: str,
    revision: str | None = None,
    *,
    cache_dir: str | None = None,
    token: str | None = None,
    endpoint: str | None = None,
    say: Callable[[str], None] | None = None,
    adapter: bool = False,
) -> str:
    """Download what the engine needs; return the model directory (or the
    GGUF file) in the cache. ``adapter``: the repository is a LoRA adapter
    (adapter_config.json and adapter_model.safetensors). Raises
    ``ValueError`` with the reason."""
    from huggingface_hub import HfApi, snapshot_download

    source = parse_hf_uri(uri)
    revision = revision or "main"
    token = token or _token_from_env()
    endpoint = (endpoint or os.environ.get(ENDPOINT_ENV) or "https://huggingface.co").rstrip("/")
    if say is not None:
        files = source.filename or (
            "LoRA adapter" if adapter else "config, tokenizer and safetensors"
        )
        say(f"fetching {files} of hf://{source.repo_id}@{revision} from {endpoint} ...")
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(source.repo_id, revision=revision)
    except Exception as e:  # huggingface_hub raises many types; all are explained
        if not _is_offline(e):
            raise ValueError(_explain(source, revision, endpoint, e)) from None
        info = None  # unreachable Hub: a complete cached snapshot still serves
    if info is not None:
        if _COMMIT.match(revision) and info.sha != revision:
            raise ValueError(
                f"hf://{source.repo_id}: revision {revision} was asked for but {endpoint} "
                f"serves commit {info.sha}; refusing a different snapshot"
            )
        names = {s.rfilename for s in info.siblings or ()}
        if source.filename is not None and source.filename not in names:
            raise ValueError(f"hf://{source.repo_id}@{revision} has no file {source.filename!r}")
        if adapter and "adapter_model.safetensors" not in names:
            raise ValueError(
                f"hf://{source.repo_id}@{revision} is not a LoRA adapter in safetensors "
                "(no adapter_model.safetensors)"
            )
        if source.filename is None and not any(n.endswith(".safetensors") for n in names):
            raise ValueError(
                f"hf://{source.repo_id}@{revision} has no *.safetensors weights; name one of "
                "its GGUF files (hf://ORG/NAME/FILE.gguf) or use another repository"
            )
        revision = info.sha or revision
    try:
        path = snapshot_download(
            source.repo_id,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=allow_patterns(source, adapter),
            token=token,
            endpoint=endpoint,
        )
    except Exception as e:
        raise ValueError(_explain(source, revision, endpoint, e)) from None
    return os.path.join(path, source.filename) if source.filename else path


def _token_from_env() -> str | None:
    if os.environ.get(TOKEN_ENV):
        return os.environ[TOKEN_ENV].strip()
    path = os.environ.get(TOKEN_PATH_ENV)
    if path:
        try:
            with open(path) as f:
                return f.read().strip() or None
        except OSError as e:
            raise ValueError(f"{TOKEN_PATH_ENV}={path}: cannot read the token: {e}") from None
    return None


def _is_offline(error: BaseException) -> bool:
    """The Hub could not be reached (no answer at all, not an HTTP error)."""
    names = {"ConnectError", "ConnectTimeout", "ReadTimeout", "TimeoutException"}
    return any(klass.__name__ in names for klass in type(error).__mro__)
