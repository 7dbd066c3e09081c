"""Per-request block tables over the block pool, with prefix-cache lookups."""

from __future__ import annotations

from dataclasses import dataclass

from ..request import Request
from .block_hash import get_hash_fn
from .block_pool import BlockPool, KVBlock


@dataclass
class PrefixCacheStats:
    """Cumulative counters, in tokens (as vLLM's prefix_cache_* metrics)."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        hash_algo: str = "sha256",
        record_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_fn = get_hash_fn(hash_algo)
        self.pool = BlockPool(num_blocks, enable_caching, record_events)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        # Number of leading blocks of each request already published in the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_usable_blocks(self) -> int:
        return self.pool.num_blocks - 1

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

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
            block = self.pool.get_cached_block(
                block_hash, tuple(tokens[i * bs : (i + 1) * bs]), parent_id
            )
            if block is None:
                break
            blocks.append(block)
            parent_id = block.block_id
        return blocks, len(blocks) * bs

    def record_lookup(self, request: Request, num_hit_tokens: int) -> None:
        """Count one prefix-cache query (when the request is actually scheduled)."""
        if self.enable_caching:
            self.stats.queries += request.num_tokens
            self.stats.hits += num_hit_tokens

    def _num_new_blocks(
        self, request: Request, num_new_tokens: int, computed: list[KVBlock]
    ) -> int:
        held = len(self.req_blocks.get(request.request_id, ())) + len(computed)
        total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        return max(0, -(-total // self.block_size) - held)

    def can_fit(self, request: Request, num_new_tokens: int, computed: list[KVBlock]) -> bool:
        # Cached hits that are currently free leave the free list when taken.
        reclaim = sum(1 for b in computed if b.ref_cnt == 0)
        return self._num_new_blocks(request, num_new_tokens, computed) + reclaim <= (
            self.num_free_blocks
        )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVBlock] | None = None,
        publish: bool = True,
    ) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``computed_blocks`` are prefix-cache hits (first scheduling only). Returns
        the newly allocated blocks, or None (nothing changed) when the pool is
        short. Full blocks whose tokens are known are published in the cache
        right away: a request scheduled in the same step reads them after the
        step's KV writes, which happen before attention in every layer.
        ``publish=False`` is for blocks whose content arrives later (remote loads).
        """
        computed_blocks = computed_blocks or []
        if not self.can_fit(request, num_new_tokens, computed_blocks):
            return None
        num_new = self._num_new_blocks(request, num_new_tokens, computed_blocks)
        rid = request.request_id
        held = self.req_blocks.setdefault(rid, [])
        if computed_blocks:
            assert not held, "prefix hits are only taken at first scheduling"
            self.pool.touch(computed_blocks)
            held.extend(computed_blocks)
            self.num_cached_blocks[rid] = len(computed_blocks)
        new = self.pool.allocate(num_new)
        held.extend(new)
        if publish:
            known = request.num_computed_tokens + len(computed_blocks) * self.block_size
            self.cache_full_blocks(request, min(known + num_new_tokens, request.num_tokens))
        return new

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        if not self.enable_caching:
            return
        rid = request.request_id
        blocks = self.req_blocks.get(rid, [])
        start = self.num_cached_blocks.get(rid, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes), len(blocks))
        bs = self.block_size
        tokens = request.all_token_ids
        for i in range(start, end):
            parent_hash = request.block_hashes[i - 1] if i else None
            self.pool.cache_block(
                blocks[i],
                request.block_hashes[i],
                tuple(tokens[i * bs : (i + 1) * bs]),
                parent_hash,
            )
        self.num_cached_blocks[rid] = max(start, end)

    def uncache(self, request_id: str) -> None:
        """Unpublish a request's blocks: blocks are published when allocated, before
        the step that writes them, so a step that failed leaves them unwritten."""
        self.pool.uncache(self.req_blocks.get(request_id, []))
        self.num_cached_blocks.pop(request_id, None)

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first (tail blocks are evicted first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def take_blocks(self, request: Request) -> list[KVBlock]:
        """Detach a request's blocks without freeing them (a KV connector now owns
        them, e.g. a producer holding them for a consumer under a lease)."""
        self.num_cached_blocks.pop(request.request_id, None)
        return self.req_blocks.pop(request.request_id, [])

    def free_blocks(self, blocks: list[KVBlock]) -> None:
        self.pool.free(reversed(blocks))
