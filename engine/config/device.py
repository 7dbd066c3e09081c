"""Which device the engine runs on and which attention kernels it uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .hashing import hash_fields

Device = Literal["auto", "cuda", "cpu"]
AttentionBackend = Literal["torch", "triton"]


def detect_device() -> Literal["cuda", "cpu"]:
    """``cuda`` when torch sees a GPU, else ``cpu`` (torch is optional here)."""
    try:
        import torch  # lazy: this package must import without torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


def query_device(device: str, memory: int | None, name: str | None) -> tuple[int, str]:
    """Total memory and name of the target device: the hints when given, else
    what torch reports for a present GPU, else (0, "") for generic defaults."""
    if memory is not None or device != "cuda":
        return memory or 0, name or ""
    try:
        import torch  # lazy: the target device may not be on this machine

        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            return int(props.total_memory), name or props.name
    except ImportError:
        pass
    return 0, name or ""


@dataclass
class DeviceConfig:
    """Device and kernel selection."""

    device: Device = "auto"
    """Device type for the engine: `cuda`, `cpu`, or `auto` (cuda when a GPU is
    visible, else cpu). A device that is not present may be named: the
    configuration then resolves as it would on that device."""
    attention_backend: AttentionBackend | None = None
    """Attention implementation: `triton` (the default on cuda) or `torch` (the
    reference over the paged cache; the default on cpu)."""

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cuda", "cpu"):
            raise ValueError(f"device: {self.device!r} is not one of auto, cuda, cpu")
        if self.device == "auto":
            self.device = detect_device()
        if self.attention_backend is None:
            self.attention_backend = "triton" if self.device == "cuda" else "torch"
        if self.attention_backend not in ("torch", "triton"):
            raise ValueError(
                f"attention_backend: {self.attention_backend!r} is not one of torch, triton"
            )

    @property
    def device_type(self) -> str:
        return self.device

    def compute_hash(self) -> str:
        return hash_fields(self, ("device", "attention_backend"))
