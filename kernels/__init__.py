"""Triton kernels for the engine's hot path, each beside its torch reference.

One kernel per module: the ``@triton.jit`` kernel(s), a launcher that checks
shapes, dtypes, devices and strides (raising ``ValueError``), and the plain
torch ``*_reference`` it is tested against. Without a GPU the kernels run under
Triton's interpreter (``TRITON_INTERPRET=1``, set before this package is
imported).

This package imports nothing of pdfleet (checked by import-linter).
"""

try:
    import triton  # noqa: F401
except ImportError as e:  # pragma: no cover - Triton ships with torch on Linux
    raise ImportError(
        "pdfleet.kernels needs Triton (Linux; `pip install triton`); "
        "use the engine's torch attention backend without it"
    ) from e

from .activation import silu_and_mul, silu_and_mul_reference
from .decode_attention import (
    choose_num_splits,
    paged_decode_attention,
    paged_decode_attention_reference,
)
from .lora import sgmv_lora, sgmv_lora_reference
from .prefill_attention import paged_prefill_attention, paged_prefill_attention_reference
from .rms_norm import (
    fused_add_rms_norm,
    fused_add_rms_norm_reference,
    rms_norm,
    rms_norm_reference,
)
from .rotary import (
    build_cos_sin_cache,
    rope_inv_freq,
    rotary_embedding,
    rotary_embedding_reference,
)
from .store_kv import store_kv, store_kv_reference

__all__ = [
    "build_cos_sin_cache",
    "choose_num_splits",
    "fused_add_rms_norm",
    "fused_add_rms_norm_reference",
    "paged_decode_attention",
    "paged_decode_attention_reference",
    "paged_prefill_attention",
    "paged_prefill_attention_reference",
    "rms_norm",
    "rms_norm_reference",
    "rope_inv_freq",
    "rotary_embedding",
    "rotary_embedding_reference",
    "sgmv_lora",
    "sgmv_lora_reference",
    "silu_and_mul",
    "silu_and_mul_reference",
    "store_kv",
    "store_kv_reference",
]
