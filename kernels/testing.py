"""Random paged-attention inputs, shared by the kernel tests and the GPU check."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32


def make_paged_case(
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    poison: bool = True,
) -> PagedCase:
    """Sequences ``s`` with ``seq_lens[s]`` tokens in context, the last
    ``q_lens[s]`` of them new (queries), whose blocks lie scattered through the
    cache in random order.

    With ``poison``, every slot no sequence owns (the tails of last blocks,
    spare blocks, block 0) holds NaN and unused block-table entries point at
    block 0, so a kernel that reads past a context poisons its output.
    """
    if len(seq_lens) != len(q_lens) or any(q > n for q, n in zip(q_lens, seq_lens, strict=True)):
        raise ValueError("need one q_len per sequence, each at most its seq_len")
    device = torch.device(device)
    cpu_gen = torch.Generator().manual_seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks + 1
    order = torch.randperm(num_blocks - 1, generator=cpu_gen) + 1  # block 0 is never owned
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    fill = float("nan") if poison else 0.0
    k_cache = torch.full(shape, fill, dtype=dtype, device=device)
    v_cache = torch.full(shape, fill, dtype=dtype, device=device)
    width = max(blocks_per_seq, default=0) + 2
    block_table = torch.zeros((len(seq_lens), width), dtype=torch.int32)
    slots = []
    used = 0
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        ids = order[used : used + nb]
        used += nb
        block_table[s, :nb] = ids.to(torch.int32)
        offsets = torch.arange(nb * block_size)
        slots.append((ids.repeat_interleave(block_size) * block_size + offsets % block_size)[:n])
    owned = torch.cat(slots).to(device) if slots else torch.empty(0, dtype=torch.long)
    rows = (owned.numel(), num_kv_heads, head_dim)
    k_cache.view(-1, num_kv_heads, head_dim)[owned] = torch.randn(
        rows, generator=gen, device=device
    ).to(dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[owned] = torch.randn(
        rows, generator=gen, device=device
    ).to(dtype)
    q = torch.randn((sum(q_lens), num_heads, head_dim), generator=gen, device=device).to(dtype)
    starts = torch.tensor([0, *q_lens]).cumsum(0)
    return PagedCase(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_table=block_table.to(device),
        query_start_loc=starts.to(torch.int32).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference over the largest reference magnitude; inf
    when either holds a NaN where the other does not."""
    out, ref = out.float(), ref.float()
    if not torch.equal(out.isnan(), ref.isnan()):
        return float("inf")
    diff = (out - ref).nan_to_num(0.0).abs().max().item() if out.numel() else 0.0
    scale = ref.nan_to_num(0.0).abs().max().item() if ref.numel() else 0.0
    return diff / max(scale, 1e-30)
