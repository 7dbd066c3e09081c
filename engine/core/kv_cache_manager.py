"""Per-request block tables over the block pool, with prefix-cache lookups.

With a host tier (``--kv-offload-bytes``, docs/kv_offload.md) the manager
also decides the copies between the tiers: cached blocks that become free are
queued for a device-to-host store (a bounded number per step and in flight),
and a prefix that continues in the host tier past the device hits is loaded
back into freshly allocated device blocks instead of being recomputed.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from ..contracts.block_hash import get_hash_fn
from ..request import Request
from .block_pool import BlockPool, KVBlock, KVCacheEvent
from .host_tier import HostBlock, HostTier, KVOffloadOps

MAX_STORES_PER_STEP = 32
"""Device-to-host block copies queued per step (on CPU they run inside the step)."""
MAX_STORES_IN_FLIGHT = 256
"""Device-to-host block copies started and not yet reported done (CUDA)."""


@dataclass
class PrefixCacheStats:
    """Cumulative counters, in tokens (as vLLM's prefix_cache_* metrics)."""

    queries: int = 0
    hits: int = 0
    host_hits: int = 0
    """Of ``hits``, tokens loaded back from the host tier."""


@dataclass
class HostTierStats:
    """Host tier counters (cumulative, in blocks) and its occupancy."""

    num_blocks: int = 0
    used_blocks: int = 0
    stored_blocks: int = 0
    """Device-to-host copies that landed."""
    loaded_blocks: int = 0
    """Host-to-device copies (prefix hits on the host tier)."""
    evicted_blocks: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        hash_algo: str = "sha256",
        record_events: bool = False,
        num_host_blocks: int = 0,
        max_stores_per_step: int = MAX_STORES_PER_STEP,
        max_stores_in_flight: int = MAX_STORES_IN_FLIGHT,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_fn(hash_algo)
        self._pool = BlockPool(num_blocks, enable_caching, record_events)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # Number of leading blocks of each request already published in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        self._host: HostTier | None = None
        if num_host_blocks > 0 and enable_caching:
            self._host = HostTier(num_host_blocks, record_events)
            self._pool.offload_candidates = collections.deque(maxlen=num_blocks)
            self._pool.before_evict = self._store_before_evict
        self.max_stores_per_step = max_stores_per_step
        self.max_stores_in_flight = max_stores_in_flight
        # Host slot -> device block id, for stores in flight.
        self._storing: dict[int, int] = {}
        self._ops = KVOffloadOps()
        self._num_loaded = 0

    @property
    def has_host_tier(self) -> bool:
        return self._host is not None

    def host_stats(self) -> HostTierStats:
        host = self._host
        if host is None:
            return HostTierStats()
        return HostTierStats(
            host.num_slots, host.num_used, host.num_stored, self._num_loaded, host.num_evictions
        )

    @property
    def usage(self) -> float:
        return self._pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self._pool.num_blocks - 1

    @property
    def num_evictions(self) -> int:
        """Cached blocks evicted to make room, since the start."""
        return self._pool.num_evictions

    @property
    def num_requests(self) -> int:
        """Requests that hold blocks."""
        return len(self._req_blocks)

    def num_request_blocks(self, request_id: str) -> int:
        """Blocks allocated to a request (0 for one that holds none)."""
        return len(self._req_blocks.get(request_id, ()))

    def take_events(self) -> list[KVCacheEvent]:
        """KV-cache events (stored, removed) of both tiers since the last call; clears them."""
        events = self._pool.take_events()
        if self._host is not None:
            events += self._host.take_events()
        return events

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block of both tiers (only when no request holds blocks)."""
        if not self._pool.reset_prefix_cache():
            return False
        if self._host is not None:
            self._host.clear()
            if self._pool.offload_candidates is None:
                raise RuntimeError("broken invariant: self._pool.offload_candidates is not None")
            self._pool.offload_candidates.clear()
        return True

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks (at most num_tokens - 1 tokens,
        so the last prompt token is always computed and yields logits)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVBlock] = []
        parent_id: int | None = None
        tokens = request.all_token_ids
        bs = self.block_size
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self._pool.get_cached_block(
                block_hash, tuple(tokens[i * bs : (i + 1) * bs]), parent_id
            )
            if block is None:
                break
            blocks.append(block)
            parent_id = block.block_id
        return blocks, len(blocks) * bs

    def get_host_hits(self, request: Request, num_device_blocks: int) -> list[HostBlock]:
        """Ready host-tier blocks that continue the prefix after the first
        ``num_device_blocks`` (device hits), under the same cap as device hits;
        reads only. A block whose store is still in flight is not a hit."""
        host = self._host
        if host is None or request.sampling_params.prompt_logprobs is not None:
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        tokens = request.all_token_ids
        bs = self.block_size
        hits: list[HostBlock] = []
        for i in range(num_device_blocks, min(max_blocks, len(hashes))):
            entry = host.get(
                hashes[i], tuple(tokens[i * bs : (i + 1) * bs]), hashes[i - 1] if i else None
            )
            if entry is None:
                break
            hits.append(entry)
        return hits

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one prefix-cache query (when the request is actually scheduled)."""
        if self.enable_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens

    def num_new_blocks(
        self, request: Request, num_new_tokens: int, computed: list[KVBlock], num_host: int = 0
    ) -> int:
        """Blocks to allocate: host hits need fresh device blocks like new tokens do."""
        held = len(self._req_blocks.get(request.request_id, ())) + len(computed)
        total = (
            request.num_computed_tokens
            + (len(computed) + num_host) * self.block_size
            + num_new_tokens
        )
        return max(0, -(-total // self.block_size) - held)

    def shortfall(
        self, request: Request, num_new_tokens: int, computed: list[KVBlock], num_host: int = 0
    ) -> int:
        """The free blocks that :meth:`allocate_slots` with these arguments lacks
        (0 or less: it fits)."""
        # Cached hits that are currently free leave the free list when taken.
        reclaim = sum(1 for b in computed if b.ref_cnt == 0)
        new = self.num_new_blocks(request, num_new_tokens, computed, num_host)
        return new + reclaim - self.num_free_blocks

    def can_fit(
        self, request: Request, num_new_tokens: int, computed: list[KVBlock], num_host: int = 0
    ) -> bool:
        return self.shortfall(request, num_new_tokens, computed, num_host) <= 0

    def blocks_freed_by(
        self, requests: Iterable[Request], computed: list[KVBlock]
    ) -> Iterator[int]:
        """For each request in turn, the blocks that freeing it and the ones before
        it would make free for a request whose prefix hits are ``computed``: their
        blocks that nothing else references (a block shared with a request not
        freed, or held for a transfer, stays taken), less its hits (freed, a hit
        leaves the free list again when taken)."""
        hits = {b.block_id for b in computed}
        refs: dict[int, int] = {}
        freed = 0
        for request in requests:
            for b in self._req_blocks.get(request.request_id, ()):
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
                if refs[b.block_id] == b.ref_cnt and b.block_id not in hits:
                    freed += 1
            yield freed

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
        publish: bool = True,
        host_hits: list[HostBlock] | None = None,
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``computed_blocks`` are prefix-cache hits (first scheduling only). Returns
        the newly allocated blocks, or None (nothing changed) when the pool is
        short. Full blocks whose tokens are known are published in the cache
        right away: a request scheduled in the same step reads them after the
        step's KV writes, which happen before attention in every layer.
        ``publish=False`` is for blocks whose content arrives later (remote loads).
        ``host_hits`` (from :meth:`get_host_hits`, first scheduling only) follow
        the device hits: the first new blocks receive them, copied from the
        host tier before the step's forward pass.
        """
        computed_blocks = computed_blocks or []
        host_hits = host_hits or []
        if not self.can_fit(request, num_new_tokens, computed_blocks, len(host_hits)):
            return None
        num_new = self.num_new_blocks(request, num_new_tokens, computed_blocks, len(host_hits))
        rid = request.request_id
        held = self._req_blocks.setdefault(rid, [])
        if (computed_blocks or host_hits) and held:
            raise RuntimeError("prefix hits are only taken at first scheduling")
        if computed_blocks:
            self._pool.touch(computed_blocks)
            held.extend(computed_blocks)
            self.num_cached_blocks[rid] = len(computed_blocks)
        if host_hits:
            if self._host is None:
                raise RuntimeError("broken invariant: self._host is not None")
            # Before allocating: a store it triggers must not take these slots.
            for entry in host_hits:
                self._host.pin(entry.slot)
                self._host.touch(entry.block_hash)
        new = self._pool.allocate(num_new)
        held.extend(new)
        if host_hits:
            for entry, block in zip(host_hits, new, strict=False):
                self._ops.loads.append((entry.slot, block.block_id))
            self._num_loaded += len(host_hits)
            self.stats.host_hits += len(host_hits) * self.block_size
        if publish:
            known = (
                request.num_computed_tokens
                + (len(computed_blocks) + len(host_hits)) * self.block_size
            )
            self.cache_full_blocks(request, min(known + num_new_tokens, request.num_tokens))
        return new

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self._req_blocks.get(rid, [])
        start = self.num_cached_blocks.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(start, end):
            parent_hash = request.block_hashes[i - 1] if i else None
            self._pool.cache_block(
                blocks[i],
                request.block_hashes[i],
                tuple(tokens[i * bs : (i + 1) * bs]),
                parent_hash,
            )
        self.num_cached_blocks[rid] = max(start, end)

    def uncache(self, request_id: str) -> None:
        """Unpublish a request's blocks: blocks are published when allocated, before
        the step that writes them, so a step that failed leaves them unwritten."""
        self._pool.uncache(self._req_blocks.get(request_id, []))
        self.num_cached_blocks.pop(request_id, None)

    def uncache_uncomputed(self, request: Request) -> None:
        """Unpublish the blocks past a request's computed tokens: published when
        allocated for a step that will not compute them (the request is preempted
        before that step's forward)."""
        blocks = self._req_blocks.get(request.request_id, [])
        self._pool.uncache(blocks[request.num_computed_tokens // self.block_size :])

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first (tail blocks are evicted first)."""
        blocks = self._req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self._pool.free(reversed(blocks))

    def take_blocks(self, request: Request) -> list[KVBlock]:
        """Detach a request's blocks without freeing them (a KV connector now owns
        them, e.g. a producer holding them for a consumer under a lease)."""
        self.num_cached_blocks.pop(request.request_id, None)
        return self._req_blocks.pop(request.request_id, [])

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        self._pool.free(reversed(blocks))

    # -- host tier ------------------------------------------------------------------

    def begin_step(self) -> None:
        """Mutates: queue this step's device-to-host stores (host tier only).

        Called before the step allocates anything, so a block freed by the
        previous step is stored even if this step evicts it (the step's writes
        then wait for the copy: ``wait_stores``). Stores go in the order blocks
        became free, which is the order the device cache evicts them in.
        """
        host, queue = self._host, self._pool.offload_candidates
        if host is None or queue is None:
            return
        budget = min(self.max_stores_per_step, self.max_stores_in_flight - len(self._storing))
        while budget > 0 and queue:
            block, block_hash = queue.popleft()
            if block.block_hash != block_hash:
                continue  # evicted since it was freed: too late
            if block_hash in host:
                host.touch(block_hash)
                continue
            if block.token_ids is None:  # a cached block has its tokens
                raise RuntimeError("broken invariant: block.token_ids is not None")
            entry = host.reserve(block_hash, block.token_ids, block.parent_hash)
            if entry is None:
                queue.appendleft((block, block_hash))  # every host slot is in flight
                break
            self._queue_store(block, entry.slot)
            budget -= 1

    def _store_before_evict(self, block: KVBlock) -> None:
        """Mutates: ``block`` (free, cached) is being evicted for reuse by this
        step; if the host tier lacks it, store it now (the step's copies run
        before its forward pass, which waits for them: ``wait_stores``), so a
        burst of frees larger than the per-step budget loses no block."""
        host = self._host
        block_hash = block.block_hash
        if host is None or block_hash is None or block.token_ids is None:
            raise RuntimeError(
                "broken invariant: host is not None and block_hash is not None and block.token_ids is not None"
            )
        if block_hash in host:
            return  # ready or pending there already
        entry = host.reserve(block_hash, block.token_ids, block.parent_hash)
        if entry is None:
            return  # every host slot is in flight
        self._queue_store(block, entry.slot)

    def _queue_store(self, block: KVBlock, slot: int) -> None:
        """Mutates: this step copies ``block`` into host ``slot`` (reserved for it)."""
        self._ops.stores.append((block.block_id, slot))
        self._storing[slot] = block.block_id
        storing = self._pool.storing
        storing[block.block_id] = storing.get(block.block_id, 0) + 1

    def take_offload_ops(self) -> KVOffloadOps | None:
        """Mutates: the step's host-tier copies for the worker (None: nothing to do)."""
        if self._host is None:
            return None
        self._host.unpin_all()
        ops, self._ops = self._ops, KVOffloadOps()
        ops.wait_stores = self._pool.overwrote_storing
        self._pool.overwrote_storing = False
        return ops if ops else None

    @property
    def has_offload_work(self) -> bool:
        """Stores in flight, or freed cached blocks not yet considered for one."""
        return bool(self._storing) or bool(self._pool.offload_candidates)

    def stores_done(self, slots: list[int], failed: bool = False) -> None:
        """Mutates: the worker finished these device-to-host copies; their blocks
        become host-tier hits. ``failed``: they never ran (forgotten instead)."""
        if self._host is None:
            return
        storing = self._pool.storing
        for slot in slots:
            block_id = self._storing.pop(slot, None)
            if block_id is None:
                continue
            left = storing.get(block_id, 0) - 1
            if left > 0:
                storing[block_id] = left
            else:
                storing.pop(block_id, None)
            if failed:
                self._host.store_failed(slot)
            else:
                self._host.store_done(slot)
