"""Where a model comes from: the ``hf://`` URI, the variables a fetch reads, the cache.

The operator writes these for its model init container (``pdfleet fetch-model
URI``, with ``HF_TOKEN_PATH`` naming a mounted Secret, ``HF_ENDPOINT`` a
mirror, ``PDFLEET_CACHE_DIR`` the cache volume) and the fetch reads them
(``models/sources/``), so both sides use the names here. The URI's grammar is
checked when a resource is admitted, long before anything is downloaded.
See docs/models.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

HF_SCHEME = "hf"
TOKEN_ENV = "HF_TOKEN"
TOKEN_PATH_ENV = "HF_TOKEN_PATH"
"""A file holding the token (how the operator passes a Secret); huggingface_hub reads it."""
ENDPOINT_ENV = "HF_ENDPOINT"
CACHE_DIR_ENV = "PDFLEET_CACHE_DIR"
"""pdfleet's cache: prepared GGUF directories, built-in models, the tiny test model."""
_LEGACY_CACHE_DIR_ENV = "PDFLEET_CACHE"
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


@dataclass(frozen=True)
class HFSource:
    repo_id: str
    """ORG/NAME."""
    filename: str | None = None
    """One GGUF file of the repository, or None for a safetensors checkpoint."""


def parse_hf_uri(uri: str) -> HFSource:
    """``hf://ORG/NAME`` or ``hf://ORG/NAME/FILE.gguf``."""
    scheme, sep, rest = uri.partition("://")
    if scheme != HF_SCHEME or not sep:
        raise ValueError(f"{uri!r} is not an hf:// URI (hf://ORG/NAME)")
    parts = rest.strip("/").split("/")
    repo = "/".join(parts[:2])
    if not _REPO.match(repo) or len(parts) > 3:
        raise ValueError(
            f"{uri!r}: name a Hub repository, hf://ORG/NAME, or one GGUF file in it, "
            "hf://ORG/NAME/FILE.gguf"
        )
    filename = parts[2] if len(parts) == 3 else None
    if filename is not None and not filename.endswith(".gguf"):
        raise ValueError(f"{uri!r}: only a .gguf file may follow the repository name")
    return HFSource(repo, filename)


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """pdfleet's cache: ``$PDFLEET_CACHE_DIR``, else ``$XDG_CACHE_HOME/pdfleet``,
    else ``~/.cache/pdfleet``. (``$PDFLEET_CACHE`` is read too, for older setups.)"""
    environ = os.environ if environ is None else environ
    explicit = environ.get(CACHE_DIR_ENV) or environ.get(_LEGACY_CACHE_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    xdg = environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(xdg) / "pdfleet"
