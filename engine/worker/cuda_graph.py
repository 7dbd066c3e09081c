"""CUDA-graph capture and replay of decode steps.

One graph per capture size (the config's ``cudagraph_capture_sizes``), all
reading the same static input buffers. A decode batch is padded to the next
captured size: padding rows have slot -1 (their K/V are not stored) and
context length 0 (the decode kernel returns zeros for them), so they cost a
little compute and change nothing. With ``capture=False`` the same padded
buffers run eagerly, which is how the padding is tested without a GPU.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from ..attention import AttentionBackend, AttentionMetadata
from ..models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        backend: AttentionBackend,
        sizes: list[int],
        max_blocks: int,
        device: torch.device,
        capture: bool = True,
    ) -> None:
        if backend.name != "triton":
            raise ValueError("CUDA graphs need the triton attention backend (graph-safe kernels)")
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        self.capture_enabled = capture
        n, d = self.max_size, device
        self.input_ids = torch.zeros(n, dtype=torch.long, device=d)
        self.positions = torch.zeros(n, dtype=torch.long, device=d)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.long, device=d)
        self.block_table = torch.zeros((n, max_blocks), dtype=torch.int32, device=d)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=d)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=d)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_tokens=size,
            num_seqs=size,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            max_query_len=1,
            max_seq_len=self.block_table.shape[1],
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[1] * size,
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self.model(
            self.input_ids[:size],
            self.positions[:size],
            self.kv_caches,
            self._meta(size),
            self.backend,
        )
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        if not self.capture_enabled:
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                for _ in range(2):  # warm up (Triton compiles, allocator settles)
                    self._forward(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._forward(size)
                self.graphs[size] = (graph, logits)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info(
            "Captured %d decode CUDA graphs (batch %d..%d) in %.1fs",
            len(self.graphs),
            self.sizes[0],
            self.max_size,
            time.perf_counter() - start,
        )

    def padded_size(self, n: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, n)]

    def fits(self, num_seqs: int) -> bool:
        return 0 < num_seqs <= self.max_size

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Logits [num_seqs, vocab] of a decode-only batch, via the padded graph."""
        n = meta.num_seqs
        size = self.padded_size(n)
        width = meta.block_table.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_table[:n, :width].copy_(meta.block_table)
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(-1)
            self.seq_lens[n:size].zero_()
        if size in self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
            return logits[:n]
        return self._forward(size)[:n]
