"""How model weights are loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .hashing import hash_factors

LoadFormat = Literal["auto", "safetensors", "gguf", "dummy"]


@dataclass
class LoadConfig:
    """Weight loading."""

    load_format: LoadFormat = "auto"
    """Weight format: `safetensors` reads the model directory's safetensors
    files (single file or a sharded index); `gguf` reads a GGUF file and
    dequantizes it to the engine dtype (see docs/models.md); `auto` takes
    safetensors when the directory has them, else its GGUF file; `dummy`
    fills the weights with seeded random values, for benchmarks and
    profiling."""
    use_tqdm_on_load: bool = True
    """Show a progress bar while loading weights."""

    def __post_init__(self) -> None:
        if self.load_format not in ("auto", "safetensors", "gguf", "dummy"):
            raise ValueError(
                f"load_format: {self.load_format!r} is not supported; "
                "use auto, safetensors, gguf or dummy"
            )

    def compute_hash(self) -> str:
        # The weight format does not change the computation graph.
        return hash_factors([])
