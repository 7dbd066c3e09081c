"""GGUF weights: read with llama.cpp's ``gguf`` package, dequantized at load time.

Each tensor is memory-mapped, dequantized to float32 by ``gguf.quants``, cast
to the engine dtype and handed to the model under its Hugging Face name, one
tensor at a time: the peak beyond the model itself is one float32 tensor.
llama.cpp stores the query and key projections of Llama-family models with
their rows permuted for its RoPE layout; they are permuted back here, as
transformers does. Config and tokenizer come from the file's metadata
(``pdfleet.engine.models.sources.gguf``). Supported types are listed in
docs/models.md.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator

import numpy as np
import torch

from ..config import ModelConfig

logger = logging.getLogger(__name__)

# GGML types pdfleet dequantizes (gguf.quants has a numpy dequantizer for each).
SUPPORTED_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q8_0",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
# GGUF architectures whose q/k rows llama.cpp's converter permutes.
_PERMUTED_QK = ("llama",)
# GGUF tensors the engine computes itself instead of loading.
_IGNORED = ("rope_freqs.weight",)
_PROGRESS_BAR_BYTES = 256 << 20


def _hf_names(config: ModelConfig) -> list[str]:
    """Every Hugging Face tensor name a Llama-family checkpoint can have."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            names += [f"{prefix}self_attn.{proj}.weight", f"{prefix}self_attn.{proj}.bias"]
        names += [f"{prefix}self_attn.q_norm.weight", f"{prefix}self_attn.k_norm.weight"]
        names += [f"{prefix}mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [f"{prefix}input_layernorm.weight", f"{prefix}post_attention_layernorm.weight"]
    return names


def gguf_to_hf_names(arch: str, config: ModelConfig) -> dict[str, str]:
    """GGUF tensor name -> Hugging Face name, from gguf's own name tables."""
    import gguf

    by_name = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in by_name:
        raise ValueError(f"GGUF architecture {arch!r} is unknown to the gguf package")
    table = gguf.get_tensor_name_map(by_name[arch], config.num_hidden_layers)
    out: dict[str, str] = {}
    for hf in _hf_names(config):
        base, suffix = hf.rsplit(".", 1)
        name = table.get_name(base)
        if name is not None:
            out[f"{name}.{suffix}"] = hf
    return out


def _unpermute(w: np.ndarray, num_heads: int) -> np.ndarray:
    # [num_heads * head_dim, hidden]: llama.cpp interleaved each head's two
    # rotary halves; restore [head, half, pair] -> [head, pair, half] order.
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_tensors(path: str) -> tuple[str | None, list[tuple[str, str, np.ndarray]]]:
    """(architecture, [(name, GGML type name, raw array)]) of a GGUF file.

    Uses the tensor index of a prepared directory when it describes this
    very file (same size and mtime), else gguf's reader.
    """
    import gguf

    from .sources.gguf import TENSOR_INDEX

    index_path = os.path.join(os.path.dirname(path), TENSOR_INDEX)
    st = os.stat(path)
    if os.path.isfile(index_path):
        with open(index_path) as f:
            index = json.load(f)
        if index["file_size"] == st.st_size and index["file_mtime_ns"] == st.st_mtime_ns:
            data = np.memmap(path, dtype=np.uint8, mode="r")
            tensors = [
                (
                    t["name"],
                    t["type"],
                    data[t["offset"] : t["offset"] + t["n_bytes"]]
                    .view(np.dtype(t["dtype"]))
                    .reshape(t["shape"]),
                )
                for t in index["tensors"]
            ]
            return index["architecture"], tensors
    reader = gguf.GGUFReader(path)
    field = reader.get_field("general.architecture")
    arch = field.contents() if field is not None else None
    return arch, [(t.name, t.tensor_type.name, t.data) for t in reader.tensors]


def iterate_gguf_weights(
    path: str, config: ModelConfig, dtype: torch.dtype, show_progress: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in ``dtype``) for every weight in ``path``."""
    import gguf
    from gguf.quants import dequantize

    arch, tensors = _read_tensors(path)
    if arch is None:
        raise ValueError(f"{path!r} has no general.architecture: not a model GGUF file")
    names = gguf_to_hf_names(arch, config)
    unknown = sorted(n for n, _, _ in tensors if n not in names and n not in _IGNORED)
    if unknown:
        raise ValueError(
            f"{path!r}: tensors {', '.join(unknown[:6])} have no place in a "
            f"{config.architecture} model"
        )
    bad = sorted({kind for _, kind, _ in tensors} - set(SUPPORTED_TYPES))
    if bad:
        raise ValueError(
            f"{path!r} holds {', '.join(bad)} tensors; pdfleet dequantizes "
            f"{', '.join(SUPPORTED_TYPES)}"
        )
    total = sum(int(raw.nbytes) for _, _, raw in tensors)
    bar = None
    if show_progress and total >= _PROGRESS_BAR_BYTES:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="Dequantizing GGUF")
    permute = arch in _PERMUTED_QK
    try:
        for name, kind, raw in tensors:
            if name in _IGNORED:
                continue
            hf = names[name]
            # float32, [rows, cols] in Hugging Face order
            w = dequantize(raw, gguf.GGMLQuantizationType[kind])
            if permute and hf.endswith("q_proj.weight"):
                w = _unpermute(w, config.num_attention_heads)
            elif permute and hf.endswith("k_proj.weight"):
                w = _unpermute(w, config.num_key_value_heads)
            if not w.flags.writeable:  # F32/F16 tensors are views of the read-only map
                w = w.copy()
            yield hf, torch.from_numpy(np.ascontiguousarray(w)).to(dtype)
            if bar is not None:
                bar.update(int(raw.nbytes))
    finally:
        if bar is not None:
            bar.close()
    logger.info("Dequantized %s (%s) to %s", os.path.basename(path), arch, dtype)
