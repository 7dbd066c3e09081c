"""The composed engine configuration and its cross-field rules."""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .admission import AdmissionConfig
from .cache import CacheConfig
from .compilation import CompilationConfig
from .device import DeviceConfig
from .fields import to_jsonable
from .hashing import hash_factors
from .kv_events import KVEventsConfig
from .kv_transfer import KVTransferConfig
from .load import LoadConfig
from .lora import LoRAConfig
from .model import ModelConfig
from .observability import ObservabilityConfig
from .parallel import ParallelConfig
from .scheduler import SchedulerConfig

logger = logging.getLogger(__name__)

PerformanceMode = Literal["balanced", "interactivity", "throughput"]
PDFLEET_CONFIG_VERSION = "1"


def default_capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, multiples of 8 below 256, then multiples of 16 up to max_size."""
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    if max_size >= 8:
        sizes += list(range(8, min(max_size + 1, 256), 8))
    if max_size >= 256:
        sizes += list(range(256, max_size + 1, 16))
    return sizes


@functools.cache
def pdfleet_version() -> str:
    """The installed pdfleet version ("0+unknown" when run from a bare source tree)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdfleet")
    except PackageNotFoundError:
        return "0+unknown"


SAMPLER_VERSION = 1
"""Bumped when the seeded draw (``sample/sampler.py``, ``step_seed``) or the
order of the sampling steps changes what a seed and position draw: engines of
two versions must not continue each other's seeded requests."""

# The files of a tokenizer directory that decide its ids, its text and its
# chat template (and the model's default sampling parameters).
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


@functools.cache
def tokenizer_digest(directory: str) -> str:
    """A digest of ``directory``'s tokenizer files by name and content (the same
    tokenizer copied to another path digests the same); the path itself when
    it is no directory (a hub name)."""
    root = Path(directory)
    if not root.is_dir():
        return directory
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = root / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:32]


@dataclass
class EngineConfig:
    """Everything one engine process needs, resolved and cross-checked."""

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    admission_config: AdmissionConfig = field(default_factory=AdmissionConfig)
    device_config: DeviceConfig = field(default_factory=DeviceConfig)
    load_config: LoadConfig = field(default_factory=LoadConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    compilation_config: CompilationConfig = field(default_factory=CompilationConfig)
    kv_transfer_config: KVTransferConfig | None = None
    kv_events_config: KVEventsConfig | None = None
    performance_mode: PerformanceMode = "balanced"
    shutdown_timeout: int = 0
    instance_id: str = ""
    lora_config: LoRAConfig | None = None

    def __post_init__(self) -> None:
        if not self.instance_id:
            self.instance_id = str(time.time_ns())
        self._resolve_cudagraph_mode()
        self._set_cudagraph_sizes()
        self._final_chunked_prefill_switch()
        self._warn_kv_events()

    # -- CUDA graphs -------------------------------------------------------

    def _resolve_cudagraph_mode(self) -> None:
        cc = self.compilation_config
        if self.device_config.device != "cuda":
            # Only CUDA has static graphs.
            cc.cudagraph_mode = "NONE"
            return
        if cc.cudagraph_mode is None:
            cc.cudagraph_mode = "NONE" if self.model_config.enforce_eager else "FULL_DECODE_ONLY"
        if self.model_config.enforce_eager:
            logger.info("CUDA graphs are disabled under enforce_eager")
            cc.cudagraph_mode = "NONE"

    def _set_cudagraph_sizes(self) -> None:
        cc = self.compilation_config
        if self.model_config.enforce_eager or cc.cudagraph_mode == "NONE":
            cc.max_cudagraph_capture_size = 0
            cc.cudagraph_capture_sizes = []
            return
        sched = self.scheduler_config
        max_size = cc.max_cudagraph_capture_size
        if max_size is None:
            max_size = min(sched.max_num_seqs * 2, 512)
        max_size = min(sched.max_num_batched_tokens, max_size)
        if max_size < 1:
            raise ValueError("max_cudagraph_capture_size must be >= 1 when CUDA graphs are used")
        user_sizes = cc.cudagraph_capture_sizes
        if user_sizes is not None:
            if not user_sizes:
                raise ValueError(
                    "cudagraph_capture_sizes must hold at least one size when CUDA graphs are "
                    "used (or set cudagraph_mode NONE / enforce_eager)"
                )
            sizes = sorted(set(user_sizes))
        else:
            sizes = default_capture_sizes(max_size)
        valid_max = sizes[-1] if sizes else 0
        if cc.max_cudagraph_capture_size is not None and cc.max_cudagraph_capture_size != valid_max:
            if user_sizes is not None:
                raise ValueError(
                    f"max_cudagraph_capture_size ({cc.max_cudagraph_capture_size}) must equal the "
                    f"largest of cudagraph_capture_sizes ({valid_max}) when both are given"
                )
            logger.warning("Truncating max_cudagraph_capture_size to %d", valid_max)
        cc.max_cudagraph_capture_size = valid_max
        if user_sizes is not None and len(sizes) < len(user_sizes):
            logger.warning("cudagraph_capture_sizes %s de-duplicated to %s", user_sizes, sizes)
        cc.cudagraph_capture_sizes = sizes

    def pad_for_cudagraph(self, batch_size: int) -> int:
        """The captured size a decode batch pads to (IndexError if above the largest)."""
        return self.compilation_config.padded_size(batch_size)

    # -- chunked prefill / prefix caching ------------------------------------

    def _final_chunked_prefill_switch(self) -> None:
        # Chunked prefill explicitly off and prefix caching not requested: both
        # off. Prefix caching that was asked for stays on.
        sched = self.scheduler_config
        if not sched.enable_chunked_prefill and not self.cache_config.enable_prefix_caching:
            sched.chunked_prefill_enabled = False
            sched.long_prefill_token_threshold = 0
            self.cache_config.enable_prefix_caching = False

    def _warn_kv_events(self) -> None:
        ev = self.kv_events_config
        if ev is None:
            return
        if ev.enable_kv_cache_events and not self.cache_config.enable_prefix_caching:
            logger.warning(
                "KV cache events are on, but prefix caching is not enabled; no block is ever "
                "stored. Use --enable-prefix-caching."
            )
        if ev.publisher != "null" and not ev.enable_kv_cache_events:
            logger.warning(
                "KV cache events are disabled, but a publisher (%s) is configured; set "
                "kv_events_config.enable_kv_cache_events to true to publish.",
                ev.publisher,
            )

    # -- hashes --------------------------------------------------------------

    def compute_hash(self) -> str:
        """Identifies everything that shapes the computation from input ids to
        hidden states. Stable across processes; ignores serving-only settings
        (seed, names, limits, memory fractions)."""
        factors: list[Any] = [PDFLEET_CONFIG_VERSION]
        for sub in (
            self.model_config,
            self.cache_config,
            self.parallel_config,
            self.scheduler_config,
            self.device_config,
            self.load_config,
            self.observability_config,
            self.compilation_config,
        ):
            factors.append(sub.compute_hash())
        # KV transfer and KV events move data around the computation, not through it.
        return hash_factors(factors)

    def compat_factors(self) -> dict[str, Any]:
        """What must be equal for two engines to exchange KV blocks. The pdfleet
        version is one (an image bump may change the KV layout); the tensor-parallel
        size is not (heterogeneous TP maps KV heads across ranks)."""
        m = self.model_config
        return {
            "pdfleet_version": pdfleet_version(),
            "model": m.name,
            "revision": m.revision,
            "architecture": m.architecture,
            "dtype": m.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "block_size": self.cache_config.block_size,
            "num_layers": m.num_hidden_layers,
            "num_kv_heads": m.num_key_value_heads,
            "head_dim": m.head_dim,
        }

    def compat_hash(self) -> str:
        """P/D compatibility hash (the gateway pairs only engines that share it)."""
        return hash_factors(self.compat_factors(), length=16)

    def resume_factors(self, serving: dict[str, Any] | None = None) -> dict[str, Any]:
        """What must be equal for a request migrated between two engines to
        go on with the tokens (and text) it would have had on the first: the
        weights (name, revision, architecture, config.json, dtype), the KV
        cache's dtype (an fp8 cache changes the logits), the tokenizer and its
        template (by their files' content, not their path), the default
        sampling parameters, the context length (a request's default
        ``max_tokens``), the sampler's seeded draw, and ``serving``: the
        server's chat template and parsers (what renders the prompt and cuts
        the text). Unlike the compat hash, it leaves out the KV layout (block
        size), the pdfleet version and every scheduling setting: a request
        resumes by recomputing its tokens, never by reading the other
        engine's blocks, so a rollout that changes only those keeps its
        streams (docs/migration.md)."""
        m = self.model_config
        return {
            "model": m.name,
            "revision": m.revision,
            "architecture": m.architecture,
            "hf_config": {k: v for k, v in m.hf_config.items() if not k.startswith("_")},
            "dtype": m.dtype,
            "kv_cache_dtype": self.kv_cache_dtype,
            "tokenizer": None if m.skip_tokenizer_init else tokenizer_digest(m.tokenizer_path),
            "generation_config": m.generation_config
            if m.generation_config in ("auto", "vllm")
            else tokenizer_digest(m.generation_config),
            "override_generation_config": m.override_generation_config,
            "max_model_len": m.max_model_len,
            "sampler": SAMPLER_VERSION,
            "serving": serving or {},
        }

    def resume_identity(self, serving: dict[str, Any] | None = None) -> str:
        """The migration resume identity (``resume_factors``): the gateway
        resumes a request only on an engine that shares it."""
        return hash_factors(self.resume_factors(serving), length=16)

    @property
    def kv_cache_dtype(self) -> str:
        dtype = self.cache_config.cache_dtype
        return self.model_config.dtype if dtype == "auto" else dtype

    # -- presentation ------------------------------------------------------

    def to_dict(self, include_hf_config: bool = False) -> dict[str, Any]:
        data: dict[str, Any] = to_jsonable(self)
        if not include_hf_config:
            data["model_config"].pop("hf_config", None)
        data["compute_hash"] = self.compute_hash()
        data["compat_hash"] = self.compat_hash()
        return data

    def summary(self) -> str:
        m, c, s = self.model_config, self.cache_config, self.scheduler_config
        kv = self.kv_transfer_config
        role = f"{kv.kv_connector}/{kv.kv_role}" if kv and kv.kv_connector else "none"
        return (
            f"model={m.model!r} arch={m.architecture} dtype={m.dtype} "
            f"max_model_len={m.max_model_len} device={self.device_config.device} "
            f"attention={self.device_config.attention_backend} block_size={c.block_size} "
            f"prefix_caching={c.enable_prefix_caching} chunked_prefill={s.chunked_prefill_enabled} "
            f"max_num_batched_tokens={s.max_num_batched_tokens} max_num_seqs={s.max_num_seqs} "
            f"cudagraph={self.compilation_config.cudagraph_mode} kv_transfer={role} "
            f"hash={self.compute_hash()}"
        )
