"""The bytes of the host KV tier (``--kv-offload-bytes``) and the copies to and from it.

The scheduler decides which block goes where (``core/host_tier.py``); this
side only moves bytes. The host buffer is ``[slots, layers, 2, block_size,
kv_heads, head_dim]``, so one slot is one contiguous run of bytes (one
memcpy each way). On CUDA it is pinned, stores run on a side stream that
first waits for the compute stream (so they see every earlier KV write), and
an event per batch tells when they landed; loads run on the compute stream
ahead of the forward pass, which therefore sees them. On CPU both are plain
tensor copies inside the step. See docs/kv_offload.md.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..core.host_tier import KVOffloadOps
from .kv_cache import GiB, available_ram

logger = logging.getLogger(__name__)


def physical_memory() -> int:
    """Bytes of physical memory on this host (``os.sysconf``)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_memory(offload_bytes: int, per_block: int) -> int:
    """Host-tier blocks for ``offload_bytes``; refuses a size this host cannot hold."""
    physical, available = physical_memory(), available_ram()
    if offload_bytes > physical or offload_bytes > available:
        raise ValueError(
            f"--kv-offload-bytes {offload_bytes} ({offload_bytes / GiB:.2f} GiB) is more than "
            f"this host can hold: {physical / GiB:.2f} GiB physical memory, "
            f"{available / GiB:.2f} GiB available now; lower --kv-offload-bytes"
        )
    num = offload_bytes // per_block
    if num < 1:
        raise ValueError(
            f"--kv-offload-bytes {offload_bytes} is smaller than one KV block "
            f"({per_block} bytes); raise it or leave it unset"
        )
    return num


class HostKVCache:
    """Host slots for KV blocks and the stream-ordered copies in and out."""

    def __init__(self, kv_buffer: torch.Tensor, num_slots: int) -> None:
        # kv_buffer: [layers, 2, blocks, block_size, kv_heads, head_dim]
        self.device_buffer = kv_buffer
        self.device = kv_buffer.device
        self.cuda = self.device.type == "cuda"
        layers, two, _blocks, *rest = kv_buffer.shape
        shape = (num_slots, layers, two, *rest)
        self.buffer = torch.empty(shape, dtype=kv_buffer.dtype, pin_memory=self.cuda)
        self.block_bytes = self.buffer[0].numel() * self.buffer.element_size()
        self.stream: Any = torch.cuda.Stream(self.device) if self.cuda else None
        # Store batches in flight (CUDA): (event, host slots).
        self.pending: list[tuple[Any, list[int]]] = []
        self.done: list[int] = []
        self.stored_bytes = 0
        self.loaded_bytes = 0
        logger.info(
            "host KV tier: %d blocks (%.2f GiB%s)",
            num_slots,
            num_slots * self.block_bytes / GiB,
            ", pinned" if self.cuda else "",
        )

    def run(self, ops: KVOffloadOps) -> None:
        """Issue a step's copies: stores, the wait when asked, then loads (in
        that order: a load never reads a slot a store of the same step fills)."""
        if ops.stores:
            self._store(ops.stores)
        if ops.wait_stores and self.cuda:
            current = torch.cuda.current_stream(self.device)
            for event, _slots in self.pending:
                current.wait_event(event)
        if ops.loads:
            self._load(ops.loads)

    def _store(self, stores: list[tuple[int, int]]) -> None:
        slots = [s for _, s in stores]
        self.stored_bytes += len(stores) * self.block_bytes
        if not self.cuda:
            # One copy per block: a host slot is contiguous and a device block
            # is layers x 2 contiguous runs, so this runs at memcpy speed (a
            # batched index_select + index_copy_ goes through a strided
            # temporary and is 2-3x slower on CPU).
            for block_id, slot in stores:
                self.buffer[slot].copy_(self.device_buffer[:, :, block_id])
            self.done.extend(slots)
            return
        block_ids = torch.tensor([b for b, _ in stores], dtype=torch.long)
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            # Gathered on the side stream (and freed there, after the copies).
            ids = block_ids.to(self.device, non_blocking=True)
            blocks = self.device_buffer.index_select(2, ids).movedim(2, 0).contiguous()
            for j, slot in enumerate(slots):
                self.buffer[slot].copy_(blocks[j], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.pending.append((event, slots))

    def _load(self, loads: list[tuple[int, int]]) -> None:
        self.loaded_bytes += len(loads) * self.block_bytes
        if not self.cuda:
            for slot, block_id in loads:  # memcpy speed, as in _store
                self.device_buffer[:, :, block_id].copy_(self.buffer[slot])
            return
        block_ids = torch.tensor([b for _, b in loads], dtype=torch.long)
        staged = torch.empty(
            (len(loads), *self.buffer.shape[1:]), dtype=self.buffer.dtype, device=self.device
        )
        for j, (slot, _b) in enumerate(loads):
            staged[j].copy_(self.buffer[slot], non_blocking=True)
        ids = block_ids.to(self.device, non_blocking=True)
        self.device_buffer.index_copy_(2, ids, staged.movedim(0, 2))

    def finished(self) -> list[int]:
        """Host slots whose stores landed since the last call (never blocks)."""
        while self.pending and self.pending[0][0].query():
            self.done.extend(self.pending.pop(0)[1])
        done, self.done = self.done, []
        return done

    def issued(self, slot: int) -> bool:
        """Whether a store into ``slot`` was issued and not yet reported."""
        return slot in self.done or any(slot in slots for _e, slots in self.pending)
