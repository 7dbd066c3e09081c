"""GGUF files as model directories: config and tokenizer from the file's metadata.

A GGUF file carries the model's hyperparameters, its tokenizer and its chat
template besides the weights. The engine reads everything else from a Hugging
Face directory, so the first time a GGUF file is used its metadata is turned
(by transformers, which reads GGUF metadata with llama.cpp's ``gguf``
package) into ``config.json``, ``generation_config.json`` and tokenizer files
in a cache directory beside a link to the file itself. The weights stay in
the GGUF file and are dequantized when the engine loads them
(``pdfleet.engine.models.gguf``). See docs/models.md.

Torch-free: transformers and gguf are imported inside the functions.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ...contracts.model_source import cache_dir

logger = logging.getLogger(__name__)

GGUF_LINK = "model.gguf"
"""Name of the link to the GGUF file inside a prepared directory."""
TENSOR_INDEX = "gguf_tensors.json"
"""Where each tensor lies in the GGUF file, as gguf's reader found it. Reading
the whole metadata again (the tokenizer's ~100k strings) takes longer than
dequantizing a small model, so the loader uses this index when the file is
unchanged."""
# Bump when the prepared files change shape, so stale caches are rebuilt.
_PREPARED_FORMAT = "2"
# transformers' model_type -> the architecture pdfleet runs for it.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def is_gguf_file(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def gguf_in_dir(directory: str) -> str | None:
    """The one GGUF file a directory holds (``model.gguf`` first), or None."""
    if not os.path.isdir(directory):
        return None
    link = os.path.join(directory, GGUF_LINK)
    if os.path.exists(link):
        return link
    found = sorted(f for f in os.listdir(directory) if f.endswith(".gguf"))
    if len(found) > 1:
        raise ValueError(
            f"{directory!r} holds several GGUF files ({', '.join(found)}); pass the path of one"
        )
    return os.path.join(directory, found[0]) if found else None


def _prepared_path(gguf_path: str) -> Path:
    real = os.path.realpath(gguf_path)
    st = os.stat(real)
    key = hashlib.sha256(
        f"{real}\0{st.st_size}\0{st.st_mtime_ns}\0{_PREPARED_FORMAT}".encode()
    ).hexdigest()[:16]
    stem = os.path.basename(real)[: -len(".gguf")]
    return cache_dir() / "gguf" / f"{stem}-{key}"


def prepare_gguf_dir(
    gguf_path: str,
    say: Callable[[str], None] | None = None,
    out: str | None = None,
    extra: Callable[[Path], None] | None = None,
) -> str:
    """The model directory for ``gguf_path``: config, tokenizer and a link to
    the file, written on first use (a few seconds) into the cache, or into
    ``out``, and reused after. ``extra(directory)`` adds files before the
    directory appears (a built-in model's chat template). Safe when several
    processes prepare the same file at once."""
    if not is_gguf_file(gguf_path):
        raise ValueError(f"{gguf_path!r} is not a GGUF file")
    target = Path(out) if out is not None else _prepared_path(gguf_path)
    if (target / "config.json").is_file():
        _repoint_link(target, os.path.realpath(gguf_path))
        return str(target)
    (say or logger.info)(
        f"reading config and tokenizer of {os.path.basename(gguf_path)} from its GGUF "
        f"metadata (once) into {target}"
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".prep-", dir=target.parent))
    tmp.chmod(0o755)  # a shared cache: other users read it
    try:
        _write_metadata(os.path.realpath(gguf_path), tmp)
        if extra is not None:
            extra(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process finished first: its files are the same.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _repoint_link(directory: Path, gguf_path: str) -> None:
    """Point a reused directory's link at ``gguf_path``. A directory keyed by name
    (a built-in model) outlives the environment that prepared it: after a
    reinstall elsewhere its link would dangle or name another copy."""
    link = directory / GGUF_LINK
    if os.path.realpath(link) == gguf_path:
        return
    fresh = directory / f".{GGUF_LINK}.{os.getpid()}.{secrets.token_hex(4)}"
    os.symlink(gguf_path, fresh)
    try:
        os.replace(fresh, link)  # atomic: a concurrent reader sees one link or the other
    except OSError:
        fresh.unlink(missing_ok=True)
        raise


def _write_metadata(gguf_path: str, out: Path) -> None:
    try:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    except ImportError:
        raise ValueError(
            "loading GGUF files needs transformers (pip install pdfleet[engine])"
        ) from None
    try:
        import gguf  # noqa: F401 (transformers needs it to read GGUF metadata)
    except ImportError:
        raise ValueError("loading GGUF files needs the gguf package (pip install gguf)") from None
    directory, name = os.path.split(gguf_path)
    try:
        config = AutoConfig.from_pretrained(directory, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError, OSError, NotImplementedError) as e:
        raise ValueError(f"cannot read the model configuration of {gguf_path!r}: {e}") from None
    arch = _ARCHITECTURES.get(config.model_type)
    if arch is None:
        raise ValueError(
            f"{gguf_path!r} holds a {config.model_type!r} model; pdfleet runs GGUF files of "
            f"the {', '.join(_ARCHITECTURES)} families"
        )
    config.architectures = [arch]
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name, local_files_only=True)
    except (ValueError, KeyError, OSError, NotImplementedError) as e:
        raise ValueError(f"cannot build the tokenizer of {gguf_path!r}: {e}") from None
    tokenizer.save_pretrained(out)
    write_tensor_index(gguf_path, out / TENSOR_INDEX)
    os.symlink(gguf_path, out / GGUF_LINK)


def write_tensor_index(gguf_path: str, index_path: Path) -> None:
    """Name, type, byte range and array shape of every tensor (gguf's reader)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    if reader.byte_order != "I":
        return  # a file of the other byte order: the loader reads it with gguf each time
    field = reader.get_field("general.architecture")
    st = os.stat(gguf_path)
    index = {
        "file_size": st.st_size,
        "file_mtime_ns": st.st_mtime_ns,
        "architecture": field.contents() if field is not None else None,
        "tensors": [
            {
                "name": t.name,
                "type": t.tensor_type.name,
                "dtype": str(t.data.dtype),
                "shape": [int(n) for n in t.data.shape],
                "offset": int(t.data_offset),
                "n_bytes": int(t.n_bytes),
            }
            for t in reader.tensors
        ],
    }
    index_path.write_text(json.dumps(index))


def resolve_model_dir(model: str, say: Callable[[str], None] | None = None) -> str:
    """The directory the engine reads config and tokenizer from: ``model``
    itself, or for a GGUF file (or a directory holding only a GGUF file and no
    config.json) the prepared directory."""
    path = os.path.expanduser(model)
    if is_gguf_file(path):
        return prepare_gguf_dir(path, say)
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "config.json")):
        found = gguf_in_dir(path)
        if found is not None:
            return prepare_gguf_dir(found, say)
    return path
