"""Fixed pool of KV-cache blocks: O(1) free list, reference counts, prefix cache.

The free list is a doubly linked list rather than a deque because a cached
block that is free (ref count 0) can be claimed again by a prefix-cache hit
and must leave the list from the middle in O(1). Freed blocks go to the tail
and allocation takes from the head, so the least recently freed cached block
is evicted first (LRU). Block 0 is a null block that is never handed out:
padding entries of block tables point at it.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is in the prefix cache.
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None
    parent_id: int | None = None
    parent_hash: bytes | None = None
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and remove."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self.head = KVBlock(-1)
        self.tail = KVBlock(-2)
        self.head.next_free, self.tail.prev_free = self.tail, self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev_free
        if last is None or block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(
                f"block {block.block_id} is already free (or the free list is corrupt)"
            )
        last.next_free, block.prev_free = block, last
        block.next_free, self.tail.prev_free = self.tail, block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not free")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        block = self.head.next_free
        if block is None or block is self.tail:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def __iter__(self) -> Iterator[KVBlock]:
        node = self.head.next_free
        while node is not None and node is not self.tail:
            yield node
            node = node.next_free


@dataclass
class KVCacheEvent:
    """A block entered (``stored``) or left (``removed``) the prefix cache, or
    the whole cache was dropped (``cleared``, with an empty hash).

    ``medium`` is the tier that holds (or held) the block, named as vLLM names
    them: ``GPU`` for the device cache (whatever the device), ``CPU`` for the
    host-memory tier (``--kv-offload-bytes``, ``core/host_tier.py``).
    """

    kind: str
    block_hash: bytes
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    block_size: int = 0
    medium: str = "GPU"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, record_events: bool = False) -> None:
        if num_blocks < 2:
            raise ValueError(f"the KV cache needs at least 2 blocks, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.ref_cnt = 1  # never freed, never allocated
        self.free_queue = FreeBlockQueue(self.blocks[1:])
        self.cached: dict[bytes, KVBlock] = {}
        self.record_events = record_events
        self.events: list[KVCacheEvent] = []
        self.num_evictions = 0
        # Host tier (``--kv-offload-bytes``) only: cached blocks that became free,
        # in the order they did (the order they will be evicted in), with the
        # hash they had then; and device blocks a store still reads (block id ->
        # stores in flight).
        self.offload_candidates: collections.deque[tuple[KVBlock, bytes]] | None = None
        self.storing: dict[int, int] = {}
        self.overwrote_storing = False
        self.before_evict: Callable[[KVBlock], None] | None = None
        """Host tier only: called with a free cached block that ``allocate`` is
        about to evict and reuse, so a block not yet copied to the host tier
        can still be (the copy reads it before the step writes it)."""

    # -- queries ---------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free counts as free)."""
        usable = self.num_blocks - 1
        return 1.0 - self.num_free_blocks / usable

    def get_cached_block(
        self, block_hash: bytes, token_ids: tuple[int, ...], parent_id: int | None
    ) -> KVBlock | None:
        """The cached block for this hash, only if its tokens and parent also match."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent_id != parent_id:
            return None
        return block

    # -- mutations -------------------------------------------------------------

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on (cached) blocks; free ones leave the free list."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {n} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None and self.before_evict is not None:
                self.before_evict(block)
            if block.block_id in self.storing:
                self.overwrote_storing = True
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference; blocks reaching zero go to the free-list tail in order."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    block.token_ids = block.parent_id = None
                elif self.offload_candidates is not None:
                    self.offload_candidates.append((block, block.block_hash))
                self.free_queue.append(block)

    def cache_block(
        self,
        block: KVBlock,
        block_hash: bytes,
        token_ids: tuple[int, ...],
        parent_hash: bytes | None,
    ) -> None:
        """Publish a full block in the prefix cache (first writer wins).

        The block records the cached block of its parent hash, so a lookup
        only matches when the whole chain of blocks before it matched too.
        """
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return  # an identical block is already cached; this one stays private
        if parent_hash is None:
            parent_id = None
        else:
            parent = self.cached.get(parent_hash)
            if parent is None:
                return  # the chain above was evicted: nothing could reach this block
            parent_id = parent.block_id
        block.block_hash = block_hash
        block.token_ids = token_ids
        block.parent_id = parent_id
        block.parent_hash = parent_hash
        self.cached[block_hash] = block
        if self.record_events:
            self.events.append(
                KVCacheEvent("stored", block_hash, parent_hash, token_ids, len(token_ids))
            )

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Take blocks out of the prefix cache (their KV may never have been written,
        e.g. after a failed step); they stay allocated to their holders."""
        for block in blocks:
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        if self.record_events:
            self.events.append(KVCacheEvent("removed", block.block_hash))
        block.block_hash = block.token_ids = block.parent_id = block.parent_hash = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (only when no request holds blocks)."""
        if self.num_free_blocks != self.num_blocks - 1:
            return False
        record, self.record_events = self.record_events, False
        for block in list(self.cached.values()):
            self._evict(block)
        self.record_events = record
        if record:
            self.events.append(KVCacheEvent("cleared", b""))
        return True

    def take_events(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events
