"""Load a model's weights: safetensors (single file or sharded index) or GGUF."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ..config import EngineConfig
from ..distributed import get_tp_group
from .llama import LlamaForCausalLM
from .parallel import WeightSlicer
from .registry import get_model_class

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_PROGRESS_BAR_BYTES = 256 << 20


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    files = sorted(
        os.path.join(model_dir, f) for f in os.listdir(model_dir) if f.endswith(".safetensors")
    )
    if not files:
        raise ValueError(
            f"no *.safetensors weights in {model_dir!r} (use --load-format dummy for random weights)"
        )
    return files


# (name, tensor or safetensors slice) -> this rank's part of the tensor.
Slicer = Callable[[str, Any], torch.Tensor]


def iterate_weights(
    files: list[str], show_progress: bool, slicer: Slicer | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the files; with ``slicer`` only this rank's slice is read."""
    from safetensors import safe_open

    total = sum(os.path.getsize(f) for f in files)
    bar = None
    if show_progress and total >= _PROGRESS_BAR_BYTES:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="B", unit_scale=True, desc="Loading weights")
    try:
        for path in files:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if slicer is None:
                        yield name, f.get_tensor(name)
                    else:
                        yield name, slicer(name, f.get_slice(name))
            if bar is not None:
                bar.update(os.path.getsize(path))
    finally:
        if bar is not None:
            bar.close()


def load_model(config: EngineConfig, device: torch.device) -> LlamaForCausalLM:
    """Build the model on ``device`` and fill its weights."""
    m = config.model_config
    dtype = torch_dtype(m.dtype)
    cls = get_model_class(m.architecture)
    with torch.device("meta"):
        model = cls(m, dtype)
    model = model.to_empty(device=device)
    model.init_buffers()
    expected = {name for name, _ in model.named_parameters()}
    if config.load_config.load_format == "dummy":
        _fill_dummy(model, m.seed)
        return model.eval()
    loaded = model.load_weights(_checkpoint(config, dtype))
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"the checkpoint in {m.model!r} lacks weights: {', '.join(missing[:8])}")
    logger.info("Loaded %s (%d tensors, %s) from %s", m.architecture, len(loaded), m.dtype, m.model)
    return model.eval()


def _checkpoint(config: EngineConfig, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors in ``dtype``, from safetensors or a GGUF file."""
    from .sources.gguf import gguf_in_dir

    m = config.model_config
    directory = m.model_dir or m.model
    fmt = config.load_config.load_format
    progress = config.load_config.use_tqdm_on_load
    tp = get_tp_group()
    slicer: Slicer | None = None
    if tp.size > 1:
        slicer = WeightSlicer(
            m.num_attention_heads,
            m.num_key_value_heads,
            m.head_dim,
            int(m.hf_config["intermediate_size"]),
            m.vocab_size,
            tp,
        )
    has_safetensors = any(f.endswith(".safetensors") for f in os.listdir(directory))
    if fmt == "gguf" or (fmt == "auto" and not has_safetensors):
        gguf_file = gguf_in_dir(directory)
        if gguf_file is not None:
            from .gguf import iterate_gguf_weights

            weights = iterate_gguf_weights(gguf_file, m, dtype, progress)
            if slicer is None:
                return weights
            return ((name, slicer(name, t).contiguous()) for name, t in weights)
        if fmt == "gguf":
            raise ValueError(f"--load-format gguf: {m.model!r} is not and holds no .gguf file")
    files = safetensors_files(directory)
    return ((name, t.to(dtype)) for name, t in iterate_weights(files, progress, slicer))


@torch.no_grad()
def _fill_dummy(model: torch.nn.Module, seed: int) -> None:
    """Seeded random weights (uniform ±1e-3; norms 1) for benchmarks."""
    gens: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        if param.device not in gens:
            gens[param.device] = torch.Generator(device=param.device).manual_seed(seed)
        param.uniform_(-1e-3, 1e-3, generator=gens[param.device])
