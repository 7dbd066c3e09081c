"""Reading a PEFT LoRA directory: ``adapter_config.json`` plus
``adapter_model.safetensors`` (or ``adapter_model.bin`` is refused: nothing is
unpickled).

PEFT names a tensor ``base_model.model.model.layers.{i}.{self_attn|mlp}.
{module}.lora_{A|B}.weight``; ``lora_A`` is [r, in_features], ``lora_B``
[out_features, r]. The delta a module adds is ``x A^T B^T * scaling`` with
``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` under ``use_rslora``);
the scaling is folded into B here, once. Every way an adapter can be wrong
raises :class:`LoRAError` naming the adapter and what is wrong, before
anything of it reaches a model.

Both files are read into memory once, and the adapter's digest is the
sha256 of exactly those bytes (:func:`adapter_digest`): the weights served,
their scaling (``lora_alpha``, ``use_rslora``, the patterns) and the digest
always agree, and no tensor aliases a file that may be rewritten later.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

# The projections an adapter may target, by their Hugging Face names.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# Column-parallel modules split their outputs over TP ranks (B's rows); the
# row-parallel ones split their inputs (A's columns).
COLUMN_MODULES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_MODULES = ("o_proj", "down_proj")
# PEFT's shorthand for every linear layer but the output head, and the
# targets it picks when a config names none (the same for all four families).
ALL_LINEAR = "all-linear"
DEFAULT_TARGETS = ("q_proj", "v_proj")

_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\."
    r"lora_([AB])(?:\.default)?\.weight$"
)

# (module name, tensor) -> this TP rank's part of it (models/parallel.WeightSlicer).
Slicer = Callable[[str, Any], torch.Tensor]


class LoRAError(ValueError):
    """An adapter that cannot be served (the message names it). ``name_taken``:
    an adapter is already loaded under the name; ``already_loaded``: from
    these very weights, so what was asked for holds; ``wrong_id``: an unload
    named the adapter with another ``lora_int_id`` than it is loaded under;
    ``bad_name``: the name itself cannot be served (invalid, or the base
    model's)."""

    def __init__(
        self,
        message: str,
        already_loaded: bool = False,
        name_taken: bool = False,
        wrong_id: bool = False,
        bad_name: bool = False,
    ) -> None:
        super().__init__(message)
        self.already_loaded = already_loaded
        self.name_taken = name_taken or already_loaded
        self.wrong_id = wrong_id
        self.bad_name = bad_name


@dataclass(frozen=True)
class LoRARequest:
    """An adapter a request runs with (vLLM's ``LoRARequest``): its served
    name, a unique positive id (a new id for every load, so a name loaded
    again with other weights is never served from a stale cache) and its
    PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise LoRAError(f"LoRA adapter {self.lora_name!r}: lora_int_id must be an integer")
        if self.lora_int_id < 1:
            raise LoRAError(f"LoRA adapter {self.lora_name!r}: lora_int_id must be >= 1")


@dataclass
class LoRAAdapter:
    """One adapter's weights for this rank: per (layer, module) the pair
    (A [r, in], B [out, r] with the scaling folded in)."""

    name: str
    int_id: int
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)
    read_seconds: float = 0.0
    """How long reading and checking it took."""
    digest: str = ""
    """The hex sha256 of the bytes it was read from (:func:`adapter_digest`)."""

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _pattern_value(patterns: dict[str, Any], layer: int, module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern: a key matches a module whose dotted
    name ends with it (keys are regular expressions)."""
    full = f"model.layers.{layer}.{'mlp' if module in ('gate_proj', 'up_proj', 'down_proj') else 'self_attn'}.{module}"
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", full):
            return value
    return default


def read_adapter_config(name: str, path: str) -> dict[str, Any]:
    """The checked ``adapter_config.json`` of ``path``."""
    return _parse_adapter_config(name, _read_config_bytes(name, path))


def _read_config_bytes(name: str, path: str) -> bytes:
    if not os.path.isdir(path):
        raise LoRAError(f"LoRA adapter {name!r}: {path!r} is not a directory")
    cfg_path = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(cfg_path):
        raise LoRAError(f"LoRA adapter {name!r}: {path!r} has no adapter_config.json")
    try:
        with open(cfg_path, "rb") as f:
            return f.read()
    except OSError as e:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is unreadable ({e})") from None


def _parse_adapter_config(name: str, raw: bytes) -> dict[str, Any]:
    try:
        cfg = json.loads(raw)
    except ValueError as e:
        raise LoRAError(
            f"LoRA adapter {name!r}: adapter_config.json is not readable JSON ({e})"
        ) from None
    if not isinstance(cfg, dict):
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json is not a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(
            f"LoRA adapter {name!r}: peft_type {cfg.get('peft_type')!r} is not supported (LORA only)"
        )
    unsupported = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (full copies of base modules)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layouts)",
        "layer_replication": "layer_replication",
        "trainable_token_indices": "trainable_token_indices",
        "target_parameters": "target_parameters",
        "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    }
    for key, what in unsupported.items():
        if cfg.get(key):
            raise LoRAError(f"LoRA adapter {name!r}: {what} is not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise LoRAError(f"LoRA adapter {name!r}: LoRA biases are not supported (bias must be none)")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_config.json r must be a positive integer")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise LoRAError(f"LoRA adapter {name!r}: lora_alpha must be a number")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = cfg.get(key) or {}
        if not isinstance(pattern, dict):
            raise LoRAError(f"LoRA adapter {name!r}: {key} must be a JSON object")
        for regex, value in pattern.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise LoRAError(
                    f"LoRA adapter {name!r}: {key}[{regex!r}] must be a positive number"
                )
            try:
                re.compile(regex)
            except re.error as e:
                raise LoRAError(
                    f"LoRA adapter {name!r}: {key} key {regex!r} is not a regular expression ({e})"
                ) from None
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        bad = [t for t in targets if str(t).split(".")[-1] not in TARGET_MODULES]
        if bad:
            raise LoRAError(
                f"LoRA adapter {name!r}: target module(s) {', '.join(map(str, bad))} are not "
                f"supported (supported: {', '.join(TARGET_MODULES)})"
            )
    _check_targeting(name, cfg)
    return cfg


def _check_targeting(name: str, cfg: dict[str, Any]) -> None:
    """The fields that say which modules and layers the adapter covers."""
    for key in ("target_modules", "exclude_modules"):
        _check_name_set(name, key, cfg.get(key))
    layers = cfg.get("layers_to_transform")
    if layers is not None and not (
        _is_int(layers) or (isinstance(layers, list) and all(_is_int(i) for i in layers))
    ):
        raise LoRAError(
            f"LoRA adapter {name!r}: layers_to_transform must be an integer or a list of integers"
        )
    pattern = cfg.get("layers_pattern")
    if pattern is not None:
        patterns = [pattern] if isinstance(pattern, str) else pattern
        if not isinstance(patterns, list) or not all(isinstance(p, str) for p in patterns):
            raise LoRAError(
                f"LoRA adapter {name!r}: layers_pattern must be a string or a list of strings"
            )
        for p in patterns:
            _compile(name, "layers_pattern", p)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _compile(name: str, key: str, regex: str) -> re.Pattern[str]:
    try:
        return re.compile(regex)
    except re.error as e:
        raise LoRAError(
            f"LoRA adapter {name!r}: {key} {regex!r} is not a regular expression ({e})"
        ) from None


def _check_name_set(name: str, key: str, value: Any) -> None:
    """``target_modules`` / ``exclude_modules``: absent, a list of module
    names (suffix match) or one regular expression (full match)."""
    if value is None:
        return
    if isinstance(value, str):
        if value.lower() != ALL_LINEAR:
            _compile(name, key, value)
        return
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise LoRAError(
            f"LoRA adapter {name!r}: {key} must be a list of module names or a regular expression"
        )


def module_key(layer: int, module: str) -> str:
    """The module's dotted name in a Hugging Face causal LM of the four
    families, the name PEFT matches its config against."""
    block = "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"
    return f"model.layers.{layer}.{block}.{module}"


def _matches(names: str | list[str], key: str) -> bool:
    if isinstance(names, str):
        return re.fullmatch(names, key) is not None
    return key in names or any(key.endswith(f".{n}") for n in names)


def untargeted_reason(cfg: dict[str, Any], layer: int, module: str) -> str | None:
    """``None`` when PEFT would apply this adapter to (layer, module) given
    its ``adapter_config.json``; otherwise the config field that leaves the
    module out. PEFT's rules: ``exclude_modules`` first (list: exact or
    dotted-suffix match; string: full regular-expression match); then
    ``target_modules`` the same way, ``"all-linear"`` meaning every
    projection, absent meaning PEFT's default for these families (q_proj
    and v_proj); ``layers_to_transform`` (with ``layers_pattern``) narrows
    only a list of targets, as in PEFT."""
    key = module_key(layer, module)
    exclude = cfg.get("exclude_modules")
    if exclude and _matches(exclude, key):
        return "exclude_modules"
    targets = cfg.get("target_modules")
    if targets is None:
        targets = list(DEFAULT_TARGETS)
    if isinstance(targets, str):
        if targets.lower() == ALL_LINEAR:
            return None
        return None if _matches(targets, key) else "target_modules"
    if not _matches(targets, key):
        return "target_modules"
    layers = cfg.get("layers_to_transform")
    if layers is None or layers == []:
        return None
    pattern = cfg.get("layers_pattern")
    patterns = [pattern] if isinstance(pattern, str) else (pattern or [])
    index: int | None = None
    if not patterns:
        m = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", key)
        index = int(m.group("idx")) if m else None
    else:
        for p in patterns:
            m = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", key)
            if m is not None:
                index = int(m.group("idx"))
                break
        if index is None:
            return "layers_pattern"
    if index is None or index not in ([layers] if _is_int(layers) else layers):
        return "layers_to_transform"
    return None


def load_adapter(
    request: LoRARequest,
    num_layers: int,
    shapes: dict[str, tuple[int, int]],
    max_rank: int,
    dtype: torch.dtype,
    slicer: Slicer | None = None,
) -> LoRAAdapter:
    """Read, check and (with ``slicer``) shard one adapter, on the CPU.

    ``shapes``: each target module's full (in_features, out_features) in the
    base model; an adapter for another model's shapes is refused."""
    name, path = request.lora_name, request.lora_path
    raw_cfg = _read_config_bytes(name, path)
    cfg = _parse_adapter_config(name, raw_cfg)
    raw_weights = _read_weights_bytes(name, path)
    from safetensors.torch import load as load_safetensors

    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    base_r, base_alpha = int(cfg["r"]), float(cfg.get("lora_alpha", 8))
    rslora = bool(cfg.get("use_rslora", False))
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with warnings.catch_warnings():
            # The tensors view read-only bytes; each is copied below before use.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            tensors = load_safetensors(raw_weights)
    except Exception as e:  # a truncated or foreign file
        raise LoRAError(
            f"LoRA adapter {name!r}: adapter_model.safetensors is unreadable ({e})"
        ) from None
    for key, tensor in tensors.items():
        m = _TENSOR.match(key)
        if m is None:
            module = key.rsplit(".", 3)[-3] if key.count(".") >= 3 else key
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {key!r} targets {module!r}, which is not "
                f"supported (supported: {', '.join(TARGET_MODULES)})"
            )
        layer, module, which = int(m.group(1)), m.group(2), m.group(3)
        if module not in TARGET_MODULES:
            raise LoRAError(
                f"LoRA adapter {name!r}: target module {module!r} is not supported "
                f"(supported: {', '.join(TARGET_MODULES)})"
            )
        if layer >= num_layers:
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {key!r} is for layer {layer}; the base "
                f"model has {num_layers}"
            )
        # PEFT loads only what the config targets (and warns about the rest);
        # a tensor outside it is a mismatched file, refused rather than
        # applied where PEFT would not, or dropped where the author meant it.
        reason = untargeted_reason(cfg, layer, module)
        if reason is not None:
            raise LoRAError(
                f"LoRA adapter {name!r}: tensor {key!r} is for {module_key(layer, module)}, "
                f"which adapter_config.json {reason} {cfg.get(reason)!r} leaves out"
            )
        pairs.setdefault((layer, module), {})[which] = tensor
    if not pairs:
        raise LoRAError(f"LoRA adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    out: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    rank = 0
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoRAError(
                f"LoRA adapter {name!r}: {where} lacks lora_{'B' if 'A' in ab else 'A'}"
            )
        a, b = ab["A"], ab["B"]
        if not (a.is_floating_point() and b.is_floating_point()):
            raise LoRAError(
                f"LoRA adapter {name!r}: {where} holds {a.dtype}/{b.dtype} tensors; LoRA "
                "weights are floating point"
            )
        r = a.shape[0]
        if r > max_rank:
            raise LoRAError(
                f"LoRA adapter {name!r}: rank {r} ({where}) exceeds --max-lora-rank {max_rank}"
            )
        expect_r = int(_pattern_value(rank_pattern, layer, module, base_r))
        in_f, out_f = shapes[module]
        if (
            a.dim() != 2
            or b.dim() != 2
            or tuple(a.shape) != (r, in_f)
            or tuple(b.shape) != (out_f, r)
        ):
            raise LoRAError(
                f"LoRA adapter {name!r}: {where} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; the base model needs ({r}, {in_f}) and ({out_f}, {r}) "
                "(an adapter of another model?)"
            )
        if r != expect_r:
            raise LoRAError(
                f"LoRA adapter {name!r}: {where} has rank {r}, adapter_config.json says {expect_r}"
            )
        alpha = float(_pattern_value(alpha_pattern, layer, module, base_alpha))
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        # Copies (owned, writable memory), never views of the bytes read.
        a = a.to(torch.float32, copy=True)
        b = b.to(torch.float32) * scaling
        if slicer is not None:
            # The rank's part: B's rows for column-parallel modules, A's columns
            # for row-parallel ones (the partial deltas sum in the all-reduce).
            if module in COLUMN_MODULES:
                b = slicer(f"{module}.weight", b)
            else:
                a = slicer(f"{module}.weight", a)
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"LoRA adapter {name!r}: {where} holds non-finite values")
        out[(layer, module)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
        rank = max(rank, r)
    return LoRAAdapter(
        name, request.lora_int_id, path, rank, out, digest=_digest(raw_cfg, raw_weights)
    )


def _read_weights_bytes(name: str, path: str) -> bytes:
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(weights_path):
        if os.path.isfile(os.path.join(path, "adapter_model.bin")):
            raise LoRAError(
                f"LoRA adapter {name!r}: only adapter_model.bin (pickle) is present; "
                "convert it to adapter_model.safetensors"
            )
        raise LoRAError(f"LoRA adapter {name!r}: {path!r} has no adapter_model.safetensors")
    try:
        with open(weights_path, "rb") as f:
            return f.read()
    except OSError as e:
        raise LoRAError(
            f"LoRA adapter {name!r}: adapter_model.safetensors is unreadable ({e})"
        ) from None


def _digest(raw_config: bytes, raw_weights: bytes) -> str:
    # Each file's length first, so no two pairs of files hash the same bytes.
    h = hashlib.sha256()
    for raw in (raw_config, raw_weights):
        h.update(len(raw).to_bytes(8, "little"))
        h.update(raw)
    return h.hexdigest()


def adapter_digest(name: str, path: str) -> str:
    """The hex sha256 of an adapter directory's ``adapter_config.json`` and
    ``adapter_model.safetensors`` bytes, as :func:`load_adapter` computes it
    (its identity in the prefix cache, with its name:
    engine/contracts/block_hash.py). Every config field counts, so a change of
    ``lora_alpha`` alone is a new identity. Raises LoRAError naming it."""
    return _digest(_read_config_bytes(name, path), _read_weights_bytes(name, path))


def module_shapes(model_config: Any) -> dict[str, tuple[int, int]]:
    """Each target module's full (in_features, out_features) in a base model
    (a ``ModelConfig``)."""
    m = model_config
    hidden, inter = m.hidden_size, int(m.hf_config["intermediate_size"])
    q, kv = m.num_attention_heads * m.head_dim, m.num_key_value_heads * m.head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
