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
            meta.cache["decode_slots"] = blocks * block_size + pos % block_size
            seq_lens = meta.seq_lens[idx].long()
            meta.cache["decode_valid"] = pos[None, :] < seq_lens[:, None]  # [D, max_len]
            meta.cache["decode_pos"] = (seq_lens - 1)[:, None] - pos[None, :]  # distance i - j
            meta.cache["decode_tokens"] = torch.tensor([starts[i] for i in decode], device=device)
        slots = {}
        for i in prefill:
            pos = torch.arange(s_lens[i], device=device)
            blocks = meta.block_table[i, pos // block_size].long()
            slots[i] = blocks * block_size + pos % block_size
        meta.cache["prefill_slots"] = slots

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, sliding_window):
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
            slots = meta.cache["decode_slots"]  # [D, L]
            mask = meta.cache["decode_valid"]
            if sliding_window is not None:
                mask = mask & (meta.cache["decode_pos"] < sliding_window)
            keys = k_flat[slots].transpose(1, 2).to(q.dtype)  # [D, Hkv, L, Dh]
            values = v_flat[slots].transpose(1, 2).to(q.dtype)
            tokens = meta.cache["decode_tokens"]
            query = q[tokens].unsqueeze(2)  # [D, H, 1, Dh]
            o = F.scaled_dot_product_attention(
                query,
                keys,
                values,
                attn_mask=mask[:, None, None, :],
                scale=scale,
                enable_gqa=True,
            )
            out[tokens] = o.squeeze(2)
        for i in meta.cache["prefill_seqs"]:
            start, end = starts[i], starts[i + 1]
            slots = meta.cache["prefill_slots"][i]
            seq_len = slots.shape[0]
            q_len = end - start
            keys = k_flat[slots].transpose(0, 1).to(q.dtype)  # [Hkv, S, Dh]
            values = v_flat[slots].transpose(0, 1).to(q.dtype)
            query = q[start:end].transpose(0, 1)  # [H, q_len, Dh]
            if seq_len == q_len and sliding_window is None:
                o = F.scaled_dot_product_attention(
                    query, keys, values, is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
                kpos = torch.arange(seq_len, device=q.device)[None, :]
                mask = kpos <= qpos
                if sliding_window is not None:
                    mask = mask & (qpos - kpos < sliding_window)
                o = F.scaled_dot_product_attention(
                    query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
                )
            out[start:end] = o.transpose(0, 1)
        return out
