"""LoRA serving limits (vLLM's ``--enable-lora`` family of flags)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Annotated

from annotated_types import Ge, Interval

from .fields import OneOf

# The ranks vLLM accepts for --max-lora-rank (its kernels are tuned for these).
POSSIBLE_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# A served adapter name: it appears in `model`, in metrics labels and in URLs.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


def check_adapter_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(
            f"LoRA adapter name {name!r} is not valid: 1-128 characters of letters, digits, "
            "'.', '_', ':', '/' or '-', starting with a letter or digit"
        )
    return name


def parse_lora_modules(
    entries: list[str] | None, base_names: list[str] | None = None
) -> dict[str, str]:
    """``--lora-modules`` as {name: path}. Each entry is vLLM's ``name=path`` or
    its JSON form ``{"name": ..., "path": ..., "base_model_name": ...}``; a
    ``base_model_name`` must be one of ``base_names`` (the served names: an
    adapter is always served on this engine's model). A malformed or
    repeated entry raises naming it."""
    out: dict[str, str] = {}
    for entry in entries or []:
        text = str(entry)
        if text.lstrip().startswith("{"):
            name, path = _json_module(text, base_names or [])
        else:
            name, sep, path = text.partition("=")
            if not sep or not name or not path:
                raise ValueError(
                    f"--lora-modules: {entry!r} is not of the form name=path "
                    '(or {"name": ..., "path": ...})'
                )
        check_adapter_name(name)
        if name in out:
            raise ValueError(f"--lora-modules: the adapter name {name!r} is given twice")
        out[name] = path
    return out


_JSON_KEYS = ("name", "path", "base_model_name")


def _json_module(text: str, base_names: list[str]) -> tuple[str, str]:
    try:
        module = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--lora-modules: {text!r} is not valid JSON ({e})") from None
    if not isinstance(module, dict):
        raise ValueError(f"--lora-modules: {text!r} is not a JSON object")
    unknown = sorted(set(module) - set(_JSON_KEYS))
    if unknown:
        raise ValueError(
            f"--lora-modules: {text!r}: unknown field {unknown[0]!r} "
            f"(the fields are {', '.join(_JSON_KEYS)})"
        )
    name, path, base = module.get("name"), module.get("path"), module.get("base_model_name")
    for key, value in (("name", name), ("path", path)):
        if not isinstance(value, str) or not value:
            raise ValueError(f"--lora-modules: {text!r}: {key} must be a non-empty string")
    if base is not None and (not isinstance(base, str) or base not in base_names):
        raise ValueError(
            f"--lora-modules: {text!r}: base_model_name {base!r} is not this engine's model "
            f"(served as {', '.join(map(repr, base_names))}); adapters are served on it"
        )
    return str(name), str(path)


@dataclass
class LoRAConfig:
    """How many LoRA adapters an engine holds, and how large they may be."""

    max_loras: Annotated[int, Interval(ge=1, le=256)] = 1
    """Most distinct LoRA adapters in one batch (their weights are in device
    memory at once: one slot each)."""
    max_lora_rank: Annotated[int, OneOf(POSSIBLE_MAX_LORA_RANKS)] = 16
    """Largest rank an adapter may have (one of 1, 8, 16, 32, 64, 128, 256,
    320, 512); a larger adapter is refused when it is loaded."""
    max_cpu_loras: Annotated[int, Ge(1)] | None = None
    """Most adapters kept in host memory, least recently used evicted (they
    are read from disk again when asked for); at least --max-loras. Default:
    --max-loras."""
    lora_modules: dict[str, str] = field(default_factory=dict)
    """Adapters loaded at start, as name=path (PEFT directories)."""

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"--{name.replace('_', '-')} must be a positive integer, got {value!r}"
                )
        if self.max_loras > 256:
            raise ValueError(f"--max-loras must be at most 256, got {self.max_loras}")
        if self.max_lora_rank not in POSSIBLE_MAX_LORA_RANKS:
            raise ValueError(
                f"--max-lora-rank must be one of {', '.join(map(str, POSSIBLE_MAX_LORA_RANKS))}, "
                f"got {self.max_lora_rank}"
            )
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif isinstance(self.max_cpu_loras, bool) or not isinstance(self.max_cpu_loras, int):
            raise ValueError(f"--max-cpu-loras must be an integer, got {self.max_cpu_loras!r}")
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"--max-cpu-loras ({self.max_cpu_loras}) must be at least --max-loras "
                f"({self.max_loras})"
            )
        for name in self.lora_modules:
            check_adapter_name(name)
