"""Reference attention over the paged KV cache in plain torch.

Correct for any mix of prefill chunks (with cached prefixes) and decodes.
Decodes are batched: their keys are gathered once per step into a padded
[num_decodes, max_len] index shared by all layers. Prefill chunks run one
sequence at a time through ``scaled_dot_product_attention`` with a causal
mask offset by the cached prefix.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import AttentionBackend, AttentionMetadata


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write new keys/values to their slots (slot -1 = padding, skipped)."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_flat = k_cache.view(num_slots, *k_cache.shape[2:])
    v_flat = v_cache.view(num_slots, *v_cache.shape[2:])
    if bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    k_flat.index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_flat.index_copy_(0, slot_mapping, v.to(v_cache.dtype))


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        device = meta.block_table.device
        q_lens, s_lens = meta.query_lens_cpu, meta.seq_lens_cpu
        decode = [i for i, q in enumerate(q_lens) if q == 1]
        prefill = [i for i, q in enumerate(q_lens) if q > 1]
        meta.cache["decode_seqs"] = decode
        meta.cache["prefill_seqs"] = prefill
        starts = meta.query_start_loc.tolist()
        meta.cache["starts"] = starts
        if decode:
            idx = torch.tensor(decode, device=device)
            max_len = max(s_lens[i] for i in decode)
            pos = torch.arange(max_len, device=device)
            table = meta.block_table[idx]  # [D, max_blocks]
            blocks = table[:, pos // block_size].long()  # [D, max_len]
            # Flat slot indices: index_select copies rows far faster than advanced indexing.
            meta.cache["decode_slots"] = (blocks * block_size + pos % block_size).reshape(-1)
            meta.cache["decode_shape"] = (len(decode), max_len)
            seq_lens = meta.seq_lens[idx].long()
            meta.cache["decode_valid"] = pos[None, :] < seq_lens[:, None]  # [D, max_len]
            meta.cache["decode_pos"] = (seq_lens - 1)[:, None] - pos[None, :]  # distance i - j
            meta.cache["decode_masks"] = {}
            meta.cache["decode_tokens"] = torch.tensor([starts[i] for i in decode], device=device)
        slots = {}
        for i in prefill:
            pos = torch.arange(s_lens[i], device=device)
            blocks = meta.block_table[i, pos // block_size].long()
            slots[i] = blocks * block_size + pos % block_size
        meta.cache["prefill_slots"] = slots

    @staticmethod
    def _decode_mask(
        meta: AttentionMetadata, window: int | None, dtype: torch.dtype
    ) -> torch.Tensor:
        masks = meta.cache["decode_masks"]
        key = (window, dtype)
        if key not in masks:
            valid = meta.cache["decode_valid"]
            if window is not None:
                valid = valid & (meta.cache["decode_pos"] < window)
            mask = torch.zeros(valid.shape, dtype=dtype, device=valid.device)
            masks[key] = mask.masked_fill(~valid, float("-inf"))[:, None, None, :]
        cached: torch.Tensor = masks[key]
        return cached

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
        store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if "starts" not in meta.cache:
            self.prepare(meta, k_cache.shape[1])
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        k_flat = k_cache.view(num_slots, *k_cache.shape[2:])
        v_flat = v_cache.view(num_slots, *v_cache.shape[2:])
        out = torch.empty_like(q)
        starts = meta.cache["starts"]
        decode = meta.cache["decode_seqs"]
        if decode:
            n, length = meta.cache["decode_shape"]
            heads_kv, dim = k_cache.shape[2], k_cache.shape[3]
            group = q.shape[1] // heads_kv
            slots = meta.cache["decode_slots"]  # [D * L]
            keys = k_flat.index_select(0, slots).view(n, length, heads_kv, dim)
            values = v_flat.index_select(0, slots).view(n, length, heads_kv, dim)
            keys = keys.transpose(1, 2).to(q.dtype)  # [D, Hkv, L, Dh]
            values = values.transpose(1, 2).to(q.dtype)
            tokens = meta.cache["decode_tokens"]
            # The G query heads sharing a KV head act as G queries over the same keys:
            # no KV expansion, and SDPA's fused CPU kernel applies (it rejects enable_gqa
            # with a mask). The additive mask is built once per step and window.
            query = q[tokens].view(n, heads_kv, group, dim)
            mask = self._decode_mask(meta, sliding_window, q.dtype)
            o = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale)
            out[tokens] = o.reshape(n, heads_kv * group, dim)
        for i in meta.cache["prefill_seqs"]:
            start, end = starts[i], starts[i + 1]
            slots = meta.cache["prefill_slots"][i]
            seq_len = slots.shape[0]
            q_len = end - start
            keys = k_flat.index_select(0, slots).transpose(0, 1).to(q.dtype)  # [Hkv, S, Dh]
            values = v_flat.index_select(0, slots).transpose(0, 1).to(q.dtype)
            heads_kv = keys.shape[0]
            group = q.shape[1] // heads_kv
            # SDPA's fused CPU kernel rejects enable_gqa: expand K/V for a causal prompt
            # (half the work of a masked one), or fold each KV head's G query heads into
            # its query length when a cached prefix or a window needs an explicit mask.
            if seq_len == q_len and sliding_window is None:
                # 4-D inputs: the fused kernel does not take 3-D ones.
                query = q[start:end].transpose(0, 1)[None]  # [1, H, q_len, Dh]
                expanded_k = keys.repeat_interleave(group, dim=0)[None]
                expanded_v = values.repeat_interleave(group, dim=0)[None]
                o = F.scaled_dot_product_attention(
                    query, expanded_k, expanded_v, is_causal=True, scale=scale
                )[0]
            else:
                qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
                kpos = torch.arange(seq_len, device=q.device)[None, :]
                allowed = kpos <= qpos
                if sliding_window is not None:
                    allowed = allowed & (qpos - kpos < sliding_window)
                mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
                mask = mask.masked_fill(~allowed, float("-inf")).repeat(group, 1)
                dim = q.shape[2]
                # [q_len, H, Dh] -> [Hkv, G * q_len, Dh] (head h = kv * G + g)
                query = q[start:end].view(q_len, heads_kv, group, dim).permute(1, 2, 0, 3)
                query = query.reshape(heads_kv, group * q_len, dim)
                o = F.scaled_dot_product_attention(
                    query[None], keys[None], values[None], attn_mask=mask, scale=scale
                )[0]
                o = o.view(heads_kv, group, q_len, dim).reshape(heads_kv * group, q_len, dim)
            out[start:end] = o.transpose(0, 1)
        return out
