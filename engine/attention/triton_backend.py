"""Attention with pdfleet's Triton kernels (the default on CUDA).

Decode-only batches go to the flash-decoding kernel (graph-safe: no host
syncs, shapes only); prefill or mixed batches go to the paged prefill kernel,
with the single-token sequences of a mixed batch split off to the decode
kernel (a prefill tile would waste most of its rows on them).
"""

from __future__ import annotations

import torch

from .backend import AttentionBackend, AttentionMetadata


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        import os

        import torch as _torch

        if not _torch.cuda.is_available():
            # Without a GPU the kernels run under Triton's interpreter (slow; for tests).
            os.environ.setdefault("TRITON_INTERPRET", "1")
        from ... import kernels

        self.kernels = kernels

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        if meta.is_decode_only or not meta.query_lens_cpu:
            return
        q_lens = meta.query_lens_cpu
        decode = [i for i, q in enumerate(q_lens) if q == 1]
        if not decode or len(decode) == len(q_lens):
            return
        # Mixed batch: index sets for the decode kernel and a re-based prefill batch.
        device = meta.block_table.device
        prefill = [i for i, q in enumerate(q_lens) if q > 1]
        starts = meta.query_start_loc.tolist()
        dec_idx = torch.tensor(decode, device=device)
        pre_idx = torch.tensor(prefill, device=device)
        pre_tokens = torch.cat(
            [torch.arange(starts[i], starts[i + 1], device=device) for i in prefill]
        )
        lens = [q_lens[i] for i in prefill]
        qsl = torch.zeros(len(prefill) + 1, dtype=torch.int32, device=device)
        qsl[1:] = torch.tensor(lens, dtype=torch.int32, device=device).cumsum(0)
        meta.cache["mixed"] = {
            "dec_seqs": dec_idx,
            "dec_tokens": torch.tensor([starts[i] for i in decode], device=device),
            "pre_seqs": pre_idx,
            "pre_tokens": pre_tokens,
            "pre_qsl": qsl,
        }

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:
        kernels = self.kernels
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        # self.kernels is the pdfleet.kernels module: its functions return tensors.
        if meta.is_decode_only:
            decoded: torch.Tensor = kernels.paged_decode_attention(
                q, k_cache, v_cache, meta.block_table, meta.seq_lens, scale, sliding_window
            )
            return decoded
        mixed = meta.cache.get("mixed")
        if mixed is None:
            prefilled: torch.Tensor = kernels.paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                meta.block_table,
                meta.query_start_loc,
                meta.seq_lens,
                scale,
                sliding_window,
            )
            return prefilled
        out = torch.empty_like(q)
        dec_tokens = mixed["dec_tokens"]
        out[dec_tokens] = kernels.paged_decode_attention(
            q[dec_tokens].contiguous(),
            k_cache,
            v_cache,
            meta.block_table[mixed["dec_seqs"]].contiguous(),
            meta.seq_lens[mixed["dec_seqs"]].contiguous(),
            scale,
            sliding_window,
        )
        pre_tokens = mixed["pre_tokens"]
        out[pre_tokens] = kernels.paged_prefill_attention(
            q[pre_tokens].contiguous(),
            k_cache,
            v_cache,
            meta.block_table[mixed["pre_seqs"]].contiguous(),
            mixed["pre_qsl"],
            meta.seq_lens[mixed["pre_seqs"]].contiguous(),
            scale,
            sliding_window,
        )
        return out
