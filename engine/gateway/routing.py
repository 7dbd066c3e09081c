"""Choosing engines: load- and prefix-aware scoring, P/D pairing, disaggregation.

An engine's score is llm-d's weighted sum (docs/gateway.md, "Routing")::

    score = 2 · prefix + 1 · queue + 1 · kv
    prefix = leading prompt blocks the engine likely caches / blocks hashed
    queue  = (max_q − q) / (max_q − min_q) over the candidates (1 when all equal)
    kv     = 1 − KV-cache usage

with q the engine's requests (scraped running + waiting, or the gateway's own
in-flight count when larger). With the exact prefix index (``kv_index.py``)
an engine whose KV event stream is fresh is scored from it instead: the
leading prompt blocks it actually holds, host-tier blocks weighted lower;
then ties go to the candidate that rendezvous-hashes highest with the
prompt's longest block id, so every gateway replica picks the same engine for
the same prompt and load. As in SGLang's cache-aware policy, a prefix
match does not count on an engine whose queue exceeds the shortest by more
than ``max(4, min_q / 2)``: a popular prefix must not pile every request onto
one engine. Ties go round-robin.

The decode engine is chosen first; a prefill engine is then chosen among those
with the decode engine's P/D compatibility hash (never the same process).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .. import tracing
from ..config.gateway import GatewayConfig
from ..contracts.gateway_events import KVPairEvent, KVPairFailed, KVPairUsed
from .engines import EngineLoad, EnginePool, EngineState
from .kv_index import KVIndex
from .metrics import GatewayMetrics
from .prompt import PromptInfo

logger = logging.getLogger("pdfleet.gateway")

PREFIX_WEIGHT = 2.0
QUEUE_WEIGHT = 1.0
KV_WEIGHT = 1.0
IMBALANCE_ABS = 4.0
IMBALANCE_REL = 0.5


def rendezvous(key: int, url: str) -> int:
    """A stable (not per-process) 64-bit weight of ``url`` for ``key``: the
    highest wins, the same in every gateway replica."""
    digest = hashlib.blake2b(f"{key}|{url}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class PrefixAffinity:
    """Bounded LRU table: block hash -> engines that likely cache it.

    "Likely": an engine may have evicted the block since; a wrong guess costs
    a recomputation, never a wrong answer. ``capacity`` counts hashes. The
    holders of a hash are a bit mask (one bit per engine, reused when an
    engine is forgotten), so a full table of 100,000 hashes is ~15 MB, not
    the ~40 MB of a set of URLs per hash.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.table: OrderedDict[int, int] = OrderedDict()
        self.bits: dict[str, int] = {}
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self.table)

    def _bit(self, url: str) -> int:
        bit = self.bits.get(url)
        if bit is None:
            bit = self._free.pop() if self._free else 1 << len(self.bits)
            self.bits[url] = bit
        return bit

    def record(self, hashes: list[int], url: str) -> None:
        """Mutates: ``url`` now holds these blocks; evicts the least recently used."""
        bit = self._bit(url)
        table = self.table
        for h in hashes:
            holders = table.get(h)
            if holders is None:
                table[h] = bit
            else:
                table[h] = holders | bit
                table.move_to_end(h)
        while len(table) > self.capacity:
            table.popitem(last=False)

    def matched(self, hashes: list[int], urls: Iterable[str]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each URL likely holds (touches what matched)."""
        counts = dict.fromkeys(urls, 0)
        bits = {u: self.bits[u] for u in counts if u in self.bits}
        remaining = 0
        for bit in bits.values():
            remaining |= bit
        for h in hashes:
            holders = self.table.get(h, 0) & remaining
            if not holders:
                break
            remaining = holders
            self.table.move_to_end(h)
            for url, bit in bits.items():
                if holders & bit:
                    counts[url] += 1
        return counts

    def forget(self, url: str) -> None:
        """Mutates: drop an engine (ejected, removed or restarted: its cache is gone)."""
        bit = self.bits.pop(url, None)
        if bit is None:
            return
        table = self.table
        for h in [h for h, holders in table.items() if holders & bit]:
            left = table[h] & ~bit
            if left:
                table[h] = left
            else:
                del table[h]
        self._free.append(bit)


class KVPairBreaker:
    """A circuit breaker per (prefill, decode) engine pair.

    A hand-off fails when the decode engine reports failed KV pulls in the
    scrape interval in which the pair was used (with ``recompute`` the client
    still gets its answer, so only the engine's counter says so), or when the
    decode leg after the pair's prefill leg fails. ``threshold`` consecutive
    failures open the breaker: the pair is not used for disaggregation for
    ``cooldown`` seconds (another prefill engine is, or the request goes
    decode-only), then it is tried again. Only pairs of known engines are
    kept (``forget`` on removal), so the table is bounded by the fleet.

    With ``--workers N`` every worker keeps the same counts: ``share`` (set by
    the gateway) hands a failed decode leg, and the first hand-off of a pair
    in each scrape interval, to the other workers, which apply them with
    ``shared=True``; the scrape verdicts each worker derives itself, from the
    same engine counters and the same pairs used.
    """

    def __init__(self, threshold: int, cooldown: float, metrics: GatewayMetrics) -> None:
        self.threshold, self.cooldown, self.metrics = threshold, cooldown, metrics
        self.failures: dict[tuple[str, str], int] = {}
        self.open_until: dict[tuple[str, str], float] = {}
        self.used: dict[str, set[str]] = {}
        """decode URL -> prefill URLs that handed it KV since its last scrape."""
        self.share: Callable[[KVPairEvent], None] | None = None
        """Sends an event to the other workers (None: one process)."""

    def is_open(self, prefill: str, decode: str, now: float | None = None) -> bool:
        until = self.open_until.get((prefill, decode))
        if until is None:
            return False
        if (time.monotonic() if now is None else now) < until:
            return True
        del self.open_until[(prefill, decode)]  # cool-down over: try the pair again
        self.failures.pop((prefill, decode), None)
        self.metrics.kv_pair_open.labels(prefill, decode).set(0)
        logger.info("KV pair %s -> %s closed again after its cool-down", prefill, decode)
        return False

    def handed_off(self, prefill: str, decode: str, shared: bool = False) -> None:
        """Mutates: ``prefill`` handed KV to ``decode`` (here, or in another
        worker when ``shared``); judged at ``decode``'s next scrape."""
        used = self.used.setdefault(decode, set())
        if prefill in used:
            return
        used.add(prefill)
        if self.share is not None and not shared:
            self.share(KVPairUsed(prefill, decode))

    def leg_failed(self, prefill: str, decode: str, shared: bool = False) -> None:
        """Mutates: a decode leg after the pair's prefill leg failed (here, or
        in another worker when ``shared``)."""
        self.record(prefill, decode, ok=False)
        if self.share is not None and not shared:
            self.share(KVPairFailed(prefill, decode))

    def apply_shared(self, event: KVPairEvent) -> None:
        """Mutates: another worker's ``share`` event."""
        if isinstance(event, KVPairUsed):
            self.handed_off(event.prefill, event.decode, shared=True)
        else:
            self.leg_failed(event.prefill, event.decode, shared=True)

    def record(self, prefill: str, decode: str, ok: bool, now: float | None = None) -> None:
        """Mutates: one hand-off's outcome over the pair."""
        pair = (prefill, decode)
        if ok:
            self.failures.pop(pair, None)
            return
        self.failures[pair] = n = self.failures.get(pair, 0) + 1
        if n >= self.threshold and pair not in self.open_until:
            self.open_until[pair] = (time.monotonic() if now is None else now) + self.cooldown
            self.metrics.kv_pair_open.labels(prefill, decode).set(1)
            logger.warning(
                "KV pair %s -> %s: %d failed hand-offs in a row; not used for P/D for %.0fs",
                prefill,
                decode,
                n,
                self.cooldown,
            )

    def scraped(self, e: EngineState, old: EngineLoad, new: EngineLoad) -> None:
        """A decode engine's pull counters moved: judge the pairs used since."""
        used = self.used.pop(e.url, None)
        if not used or new.kv_failures < old.kv_failures:  # unused, or restarted
            return
        failed = new.kv_failures > old.kv_failures
        if failed or new.kv_transfers > old.kv_transfers:
            for prefill in used:
                self.record(prefill, e.url, ok=not failed)
        else:
            self.used[e.url] = used  # nothing pulled yet: judge at the next scrape

    def forget(self, url: str) -> None:
        """Mutates: drop every pair with a removed engine."""
        self.used.pop(url, None)
        for prefill, decode in [p for p in self.open_until if url in p]:
            self.metrics.kv_pair_open.labels(prefill, decode).set(0)
        for table in (self.failures, self.open_until):
            for pair in [p for p in table if url in p]:
                del table[pair]
        for used in self.used.values():
            used.discard(url)


class NoEngineError(Exception):
    """No routable engine for a request (answered 503)."""


@dataclass
class Route:
    decode: EngineState
    prefill: EngineState | None
    decision: str
    """prefill_decode or decode_only."""
    reason: str
    """always, long_prompt, short_prompt, cached_prefix, disabled, batch,
    prompt_logprobs, no_prefill_engine, kv_pair_open, adapter_fallback (a
    LoRA adapter could not be loaded on the chosen engine: one that serves it
    runs the request) or peer_holder (peer pulls: the decode engine that holds
    the prompt's prefix serves it alone, ``proxy.planned_route``)."""


class Router:
    def __init__(
        self,
        config: GatewayConfig,
        pool: EnginePool,
        affinity: PrefixAffinity,
        breaker: KVPairBreaker | None = None,
        kv_index: KVIndex | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.affinity = affinity
        self.breaker = breaker
        self.kv_index = kv_index
        self._rr = 0

    def pick(
        self,
        candidates: list[EngineState],
        hashes: list[int],
        exact: list[int] | None = None,
    ) -> tuple[EngineState, int] | None:
        """The best-scoring candidate and how many leading blocks it (likely) caches.

        ``exact``: the prompt's block ids as KV events name them; candidates
        the exact index follows are scored from it, the others from the
        approximate table with ``hashes``.
        """
        if not candidates:
            return None
        queues = [c.queue() for c in candidates]
        lo, hi = min(queues), max(queues)
        urls = [c.url for c in candidates]
        matched = self.affinity.matched(hashes, urls) if hashes else {}
        held = self.kv_index.matched(exact, urls) if exact and self.kv_index is not None else {}
        slack = max(IMBALANCE_ABS, IMBALANCE_REL * lo)
        scored = []
        for c, q in zip(candidates, queues, strict=True):
            queue_score = 1.0 if hi == lo else (hi - q) / (hi - lo)
            kv_score = 1.0 - min(1.0, max(0.0, c.load.kv_usage))
            if c.url in held:
                if exact is None:  # held is only filled from exact ids
                    raise RuntimeError("broken invariant: exact is not None")
                blocks, weight = held[c.url]
                fraction = weight / len(exact)
            else:
                blocks = matched.get(c.url, 0)
                fraction = blocks / len(hashes) if hashes else 0.0
            prefix_score = fraction if q - lo <= slack else 0.0
            score = PREFIX_WEIGHT * prefix_score + QUEUE_WEIGHT * queue_score + KV_WEIGHT * kv_score
            scored.append((score, c, blocks))
        tracing.route_scores(scored)
        top = max(s for s, _, _ in scored)
        best = [(c, b) for s, c, b in scored if s >= top - 1e-9]
        if exact and len(best) > 1:
            return max(best, key=lambda cb: rendezvous(exact[-1], cb[0].url))
        self._rr += 1
        return best[self._rr % len(best)]

    def count_pick(self) -> None:
        """A pick made without scoring (one candidate): the round-robin turns
        on as it would have."""
        self._rr += 1

    def pick_prefill(
        self, decode: EngineState, info: PromptInfo, exclude: set[str]
    ) -> EngineState | None:
        """A prefill engine that can hand its KV to ``decode`` (equal compat hash)."""
        candidates = prefer_adapter_holders(
            self.prefill_candidates(decode, exclude), info.adapter, self._identity(info)
        )
        picked = self.pick(candidates, info.block_hashes, info.exact_hashes)
        return picked[0] if picked else None

    def _identity(self, info: PromptInfo) -> str | None:
        """The lora_identity requests of ``info``'s adapter are routed to."""
        chosen = self.pool.adapter(info.adapter) if info.adapter else None
        return chosen[0] if chosen else None

    def prefill_candidates(
        self, decode: EngineState, exclude: set[str] | None = None
    ) -> list[EngineState]:
        """The routable prefill engines that can hand their KV to ``decode``: another
        engine, an equal compat hash, no open breaker for the pair."""
        want = decode.load.compat_hash
        return [
            e
            for e in self.pool.candidates("prefill")
            if e.url != decode.url
            and e.url not in (exclude or ())
            and e.load.compat_hash == want
            and not (self.breaker and self.breaker.is_open(e.url, decode.url))
        ]

    def route(
        self,
        info: PromptInfo,
        exclude_decode: set[str] | None = None,
        exclude_prefill: set[str] | None = None,
    ) -> Route:
        """Choose the decode engine, then whether (and where) to prefill first
        (never on an engine of ``exclude_prefill``: those at capacity)."""
        candidates = [
            e for e in self.pool.candidates("decode") if e.url not in (exclude_decode or ())
        ]
        candidates = prefer_adapter_holders(candidates, info.adapter, self._identity(info))
        picked = self.pick(candidates, info.block_hashes, info.exact_hashes)
        if picked is None:
            known = sum(1 for e in self.pool.engines.values() if e.serves("decode"))
            raise NoEngineError(
                f"no healthy decode engine is available ({known} known, none routable); retry later"
            )
        decode, cached_blocks = picked
        mode = self.config.disaggregation_mode
        if mode == "Disabled":
            return Route(decode, None, "decode_only", "disabled")
        if info.batch:
            # One kv_transfer_params slot per response: several prompts cannot share it.
            return Route(decode, None, "decode_only", "batch")
        if info.prompt_logprobs:
            # Only an engine that computes the whole prompt has its logprobs.
            return Route(decode, None, "decode_only", "prompt_logprobs")
        reason = "always"
        if mode == "Conditional":
            threshold = self.config.min_prompt_tokens
            if info.num_tokens < threshold:
                return Route(decode, None, "decode_only", "short_prompt")
            uncached = info.num_tokens - cached_blocks * self.pool.block_size
            if uncached < threshold:
                return Route(decode, None, "decode_only", "cached_prefix")
            reason = "long_prompt"
        prefill = self.pick_prefill(decode, info, exclude_prefill or set())
        if prefill is None:
            blocked = self.breaker is not None and any(
                self.breaker.is_open(p.url, decode.url) for p in self.pool.candidates("prefill")
            )
            return Route(
                decode, None, "decode_only", "kv_pair_open" if blocked else "no_prefill_engine"
            )
        return Route(decode, prefill, "prefill_decode", reason)


# How warm an adapter is on an engine, best first: its weights in a device
# slot, in host memory only, registered (served, read from its directory when
# a step needs it), or not served at all (the proxy loads it first).
ADAPTER_TIERS = ("device", "host", "registered")


def adapter_tier(e: EngineState, adapter: str, identity: str | None = None) -> int:
    """0 (device) .. 2 (registered), 3 when ``e`` does not serve ``adapter``, by
    its last scrape (and the gateway's own routing since: ``AdapterLoader.ensure``
    in ``adapters.py``); 4 when it serves the name with other weights than
    ``identity``."""
    served = e.load.adapters.get(adapter)
    if served is None:
        return 3
    if identity is not None and served[0] != identity:
        return 4
    resident = e.load.resident.get(adapter)
    return ADAPTER_TIERS.index(resident) if resident in ADAPTER_TIERS[:2] else 2


def mark_routed(e: EngineState, adapter: str) -> None:
    """The gateway's own update of its view between scrapes: running a request
    of ``adapter`` puts it into a device slot of ``e``; with ``--max-loras``
    known, the device adapters marked or scraped longest ago beyond that many
    count as host-resident (the engine evicts its least recently used slot;
    its host cache keeps the copy)."""
    resident = e.load.resident
    resident.pop(adapter, None)
    resident[adapter] = "device"  # insertion order: most recently routed last
    slots = e.load.max_loras
    if slots:
        device = [name for name, tier in resident.items() if tier == "device"]
        for name in device[:-slots]:
            resident[name] = "host"


def prefer_adapter_holders(
    candidates: list[EngineState], adapter: str | None, identity: str | None = None
) -> list[EngineState]:
    """LoRA-aware routing: for a request that names ``adapter``, the candidates
    where it is warmest, weighed against load. Tier by tier (device slot, then
    host memory, then registered), the candidates at that tier or a warmer
    one, as soon as the least busy of them has no more requests than the
    least busy candidate plus the prefix slack (``max(4, min_q / 2)``); when
    no tier passes, all candidates, scored as usual, and the proxy loads the
    adapter on the chosen engine (``AdapterLoader.ensure`` in ``adapters.py``). A hot adapter
    thus spreads to more engines under load instead of queueing on the few
    that hold it. Cost: one pass over the candidates (a dict lookup or two
    each) plus one per tier tried, no I/O. ``identity``: the weights the
    name is routed to (``EnginePool.adapter``); an engine serving the name
    with others is never a candidate (it cannot load these under that name)."""
    if adapter is None:
        return candidates
    tiers = [adapter_tier(c, adapter, identity) for c in candidates]
    if 4 in tiers:
        kept = [(c, t) for c, t in zip(candidates, tiers, strict=True) if t != 4]
        candidates, tiers = [c for c, _ in kept], [t for _, t in kept]
    queues = [c.queue() for c in candidates]
    lo = min(queues, default=0.0)
    slack = max(IMBALANCE_ABS, IMBALANCE_REL * lo)
    for tier in range(len(ADAPTER_TIERS)):
        warm = [i for i, t in enumerate(tiers) if t <= tier]
        if len(warm) == len(candidates):
            return candidates
        if warm and min(queues[i] for i in warm) - lo <= slack:
            return [candidates[i] for i in warm]
    return candidates
