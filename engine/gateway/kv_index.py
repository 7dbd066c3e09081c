"""Exact prefix routing: an index of which engine caches which block, from KV events.

Every engine with ``--kv-events-config`` publishes the blocks entering and
leaving its prefix cache (docs/kv_events.md). The gateway subscribes to each
engine's stream (the endpoint comes with the engine's discovery entry, or
``--kv-events-port`` on the engine's host) and keeps one table: block id ->
the engines holding it, on the device tier or the host tier. A request's
prompt is hashed with the engines' own function (``contracts/block_hash.py``), and an
engine's score is the number of leading prompt blocks it holds, a host-tier
block counting ``--kv-host-weight`` of a device one (it must be copied back).

- **Gaps and late joins.** Batches carry contiguous sequence numbers. On a
  jump, or on joining a stream already running, the missing batches are
  asked of the engine's replay socket; when it no longer holds them (or has
  none) the engine's entries are dropped and rebuilt from what follows.
- **Restarts.** A publisher starts with ``AllBlocksCleared`` and sequence 0;
  a sequence that goes backwards, or that batch, drops the engine's entries.
- **Staleness.** Engines send a heartbeat batch when idle; an engine whose
  stream said nothing for ``--kv-index-stale-after`` seconds is not scored
  from the index (routing falls back to the approximate table for it).
- **Bounded memory.** At most ``--kv-index-max-blocks`` ids; beyond, the
  least recently stored ids go first. The order depends on the streams
  alone, never on lookups, so every gateway replica that saw the same events
  holds the same index and makes the same choice for the same load.

Engines live in bit slots of one Python int per block id: slot ``s`` uses bit
``2s`` for the device tier and ``2s+1`` for the host tier. Dropping an
engine's entries retires its slot (its bits stop counting at once) and a
sweep clears the bits in the background before the slot is reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from ..contracts.kv_events import (
    AllBlocksCleared,
    BlockStored,
    EventBatch,
    KVEvent,
    curve_server_keys,
    pack_seq,
    unpack_seq,
)
from .metrics import GatewayMetrics

if TYPE_CHECKING:
    from ..config.gateway import GatewayConfig
    from .engines import EnginePool, EngineState
    from .prompt import PromptAnalyzer

logger = logging.getLogger("pdfleet.gateway")

REPLAY_TIMEOUT = 2.0
"""Seconds a replay may take before it counts as failed."""
FOLLOW_RETRY_BASE = 0.5
"""Seconds before a failed stream is followed again; doubled per failure in a row."""
FOLLOW_RETRY_MAX = 30.0
"""The longest wait before following a failed stream again."""
SWEEP_CHUNK = 20_000
"""Entries cleared of retired slots per sweep step (one event-loop turn)."""


@dataclass
class EngineEntry:
    """What the index knows about one engine's stream."""

    slot: int
    last_event: float = -float("inf")
    """monotonic time of the last batch (a heartbeat counts)."""
    next_seq: int | None = None
    """The sequence number expected next (None before the first batch)."""


class KVIndex:
    """Block id -> engines holding it; pure data, no sockets (the follower feeds it).

    Mutating methods say so; ``matched`` only reads.
    """

    def __init__(
        self,
        max_blocks: int = 1_000_000,
        stale_after: float = 10.0,
        host_weight: float = 0.5,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        if max_blocks < 1:
            raise ValueError(f"--kv-index-max-blocks must be >= 1, got {max_blocks}")
        if not 0.0 <= host_weight <= 1.0:
            raise ValueError(f"--kv-host-weight must be within [0, 1], got {host_weight}")
        self.max_blocks = max_blocks
        self.stale_after = stale_after
        self.host_weight = host_weight
        self.metrics = metrics
        self.table: OrderedDict[int, int] = OrderedDict()
        self.engines: dict[str, EngineEntry] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._retired: set[int] = set()
        self._retired_mask = 0
        self._sweep_keys: list[int] = []
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.table)

    # -- engines -----------------------------------------------------------------

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        self._next_slot += 1
        return self._next_slot - 1

    def engine(self, url: str) -> EngineEntry:
        """Mutates: the entry of ``url`` (created on first use)."""
        entry = self.engines.get(url)
        if entry is None:
            entry = self.engines[url] = EngineEntry(self._take_slot())
        return entry

    def is_fresh(self, url: str, now: float | None = None) -> bool:
        """Whether ``url``'s entries count: its stream spoke within ``stale_after``."""
        entry = self.engines.get(url)
        if entry is None:
            return False
        return (time.monotonic() if now is None else now) - entry.last_event <= self.stale_after

    def drop(self, url: str, reason: str, forget: bool = False) -> None:
        """Mutates: ``url``'s entries stop counting now (its slot is retired and
        swept); with ``forget`` the engine itself is forgotten (removed from the pool)."""
        entry = self.engines.get(url)
        if entry is None:
            return
        self._retired.add(entry.slot)
        self._retired_mask |= 3 << (2 * entry.slot)
        # A full pass after the latest retirement (rare: restarts, clears, removals).
        self._sweep_keys = list(self.table)
        if forget:
            del self.engines[url]
        else:
            entry.slot = self._take_slot()
        if self.metrics is not None:
            self.metrics.kv_index_resets.labels(url, reason).inc()

    def sweep(self, budget: int = SWEEP_CHUNK) -> bool:
        """Mutates: clear retired slots' bits from up to ``budget`` entries; when a
        pass is done, the slots are free again. True while work is left."""
        if not self._retired:
            return False
        keep = ~self._retired_mask
        table = self.table
        keys = self._sweep_keys
        for _ in range(min(budget, len(keys))):
            key = keys.pop()
            bits = table.get(key)
            if bits is None:
                continue
            bits &= keep
            if bits:
                table[key] = bits  # an update keeps the key's place in the LRU order
            else:
                del table[key]
        if keys:
            return True
        self._free_slots.extend(self._retired)
        self._retired.clear()
        self._retired_mask = 0
        self._update_size()
        return False

    # -- events ------------------------------------------------------------------

    def apply(self, url: str, events: Iterable[KVEvent]) -> None:
        """Mutates: apply one batch of ``url``'s events."""
        entry = self.engine(url)
        table = self.table
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                self.drop(url, "cleared")
                continue
            bit = 1 << (2 * entry.slot + (1 if ev.host else 0))
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    table[h] = table.get(h, 0) | bit
                    table.move_to_end(h)
            else:
                for h in ev.block_hashes:
                    bits = table.get(h)
                    if bits is None:
                        continue
                    bits &= ~bit
                    if bits & ~self._retired_mask:
                        table[h] = bits
                    else:
                        del table[h]
            if self.metrics is not None:
                self.metrics.kv_index_events.labels(url, type(ev).__name__).inc()
        while len(table) > self.max_blocks:
            table.popitem(last=False)
            self.evictions += 1
        entry.last_event = time.monotonic()
        self._update_size()

    def _update_size(self) -> None:
        if self.metrics is not None:
            self.metrics.kv_index_blocks.set(len(self.table))

    # -- lookups -----------------------------------------------------------------

    def matched(
        self, hashes: list[int], urls: Iterable[str], now: float | None = None
    ) -> dict[str, tuple[int, float]]:
        """For each fresh engine among ``urls``: (leading prompt blocks it holds
        on either tier, their weight with host-tier blocks at ``host_weight``).
        Engines absent from the answer are stale or unknown: score them another way."""
        now = time.monotonic() if now is None else now
        slots: dict[int, str] = {}
        live = 0
        for url in urls:
            entry = self.engines.get(url)
            if entry is not None and now - entry.last_event <= self.stale_after:
                slots[entry.slot] = url
                live |= 1 << (2 * entry.slot)
        if not slots:
            return {}
        run = dict.fromkeys(slots, 0)
        host_blocks = dict.fromkeys(slots, 0)
        alive = live  # device-tier bit of each engine whose run has not ended
        table = self.table
        for n, h in enumerate(hashes):
            bits = table.get(h, 0)
            held = (bits | (bits >> 1)) & alive
            if held != alive:  # some runs end here
                for slot in slots:
                    if alive >> (2 * slot) & 1 and not held >> (2 * slot) & 1:
                        run[slot] = n
                alive = held
                if not alive:
                    break
            host_only = (bits >> 1) & ~bits & alive
            if host_only:
                for slot in slots:
                    if host_only >> (2 * slot) & 1:
                        host_blocks[slot] += 1
        else:
            for slot in slots:
                if alive >> (2 * slot) & 1:
                    run[slot] = len(hashes)
        w = self.host_weight
        return {
            url: (run[slot], run[slot] - host_blocks[slot] * (1.0 - w))
            for slot, url in slots.items()
        }

    def on_device(self, hashes: list[int], url: str) -> bool:
        """Whether ``url`` holds every one of ``hashes`` on its device tier (a lend
        of them leases at once, with no step to copy a block back)."""
        entry = self.engines.get(url)
        if entry is None:
            return False
        bit = 1 << (2 * entry.slot)
        table = self.table
        return all(table.get(h, 0) & bit for h in hashes)


# -- following the engines' streams ----------------------------------------------


@dataclass
class Source:
    """Where one engine's events come from."""

    url: str
    endpoint: str
    replay: str | None = None
    topic: str = ""


def sources_for(engines: Iterable[EngineState], config: GatewayConfig) -> list[Source]:
    """The event streams of ``engines``: each one's own endpoints, else
    ``--kv-events-port`` / ``--kv-events-replay-port`` on its host."""
    out = []
    for e in engines:
        host = urlsplit(e.url).hostname or ""
        host = f"[{host}]" if ":" in host else host
        endpoint, replay = e.kv_events, e.kv_events_replay
        if endpoint is None and config.kv_events_port is not None:
            endpoint = f"tcp://{host}:{config.kv_events_port}"
        if replay is None and config.kv_events_replay_port is not None:
            replay = f"tcp://{host}:{config.kv_events_replay_port}"
        if endpoint is not None:
            out.append(Source(e.url, endpoint, replay, config.kv_events_topic))
    return out


class KVEventFollower:
    """Subscribes to every known engine's stream and feeds the index (asyncio).

    ``sync`` (called with the pool's engines) starts and stops subscriptions;
    each runs as its own task with its own SUB socket, and a DEALER socket for
    replays.
    """

    def __init__(
        self,
        index: KVIndex,
        metrics: GatewayMetrics | None = None,
        secret: bytes | None = None,
    ) -> None:
        """``secret``: the fleet secret, to subscribe with CURVE (publishers whose
        key pair derives from it); None subscribes in the clear."""
        self.index = index
        self.metrics = metrics
        self.secret = secret
        self.ctx = zmq.asyncio.Context()
        self.sources: dict[str, Source] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._syncer: asyncio.Task[None] | None = None
        self._warned: set[str] = set()
        self._failures: dict[str, int] = {}
        """Failures in a row of each URL's follow task (reset by a batch applied)."""
        self._retry_at: dict[str, float] = {}
        """monotonic time before which a failed URL's task is not restarted."""

    def start(self, pool: EnginePool, analyzer: PromptAnalyzer, config: GatewayConfig) -> None:
        """Follow the pool's engines from now on (re-synced every scrape interval);
        the analyzer hashes prompts exactly while at least one stream is followed."""

        def sync() -> None:
            self.sync(sources_for(pool.engines.values(), config))
            analyzer.exact = bool(self.sources)
            analyzer.hash_algo = pool.hash_algo

        async def loop() -> None:
            while True:
                try:
                    sync()
                except Exception:  # never let the loop die: routing falls back meanwhile
                    logger.exception("following the engines' KV events failed")
                await asyncio.sleep(config.scrape_interval)

        sync()
        self._syncer = asyncio.create_task(loop(), name="pdfleet-kv-events-sync")

    def sync(self, sources: Iterable[Source]) -> None:
        """Mutates: follow exactly ``sources`` (one per engine URL)."""
        wanted = {s.url: s for s in sources}
        for url in list(self.tasks):
            if wanted.get(url) != self.sources.get(url):
                self.tasks.pop(url).cancel()
                self.sources.pop(url, None)
                self._failures.pop(url, None)
                self._retry_at.pop(url, None)
                if url not in wanted:
                    self.index.drop(url, "removed", forget=True)
                    self._set_fresh(url, None)
        now = time.monotonic()
        for url, src in wanted.items():
            task = self.tasks.get(url)
            if task is not None and task.done():
                # Its stream ended with an error: follow it again, after a
                # backoff that grows with the failures in a row.
                if now < self._retry_at.get(url, 0.0):
                    continue
                del self.tasks[url]
            if url not in self.tasks:
                self.sources[url] = src
                self.tasks[url] = asyncio.create_task(
                    self._follow(src), name=f"pdfleet-kv-events-{url}"
                )
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep(), name="pdfleet-kv-index-sweep")

    def _set_fresh(self, url: str, fresh: bool | None) -> None:
        if self.metrics is None:
            return
        if fresh is None:
            with contextlib.suppress(KeyError):
                self.metrics.kv_index_fresh.remove(url)
        else:
            self.metrics.kv_index_fresh.labels(url).set(1 if fresh else 0)

    async def _sweep(self) -> None:
        """Clears retired slots a chunk per turn, and keeps the freshness gauges true."""
        while True:
            while self.index.sweep():  # noqa: ASYNC110 (yields to the loop between chunks of work; not a wait)
                await asyncio.sleep(0)
            for url in self.sources:
                self._set_fresh(url, self.index.is_fresh(url))
            await asyncio.sleep(0.5)

    async def _follow(self, src: Source) -> None:
        sub = self.ctx.socket(zmq.SUB)
        self._secure(sub)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode())
        try:
            sub.connect(src.endpoint)
            while True:
                try:
                    _topic, seq_bytes, payload = await sub.recv_multipart()
                    seq = unpack_seq(seq_bytes)
                except ValueError:
                    continue  # not a 3-frame message, or no sequence frame
                await self._on_batch(src, seq, payload)
        except asyncio.CancelledError:
            raise
        except Exception:
            n = self._failures.get(src.url, 0) + 1
            self._failures[src.url] = n
            delay = min(FOLLOW_RETRY_MAX, FOLLOW_RETRY_BASE * 2 ** (n - 1))
            self._retry_at[src.url] = time.monotonic() + delay
            logger.exception(
                "KV event stream of %s failed; its entries stop counting, following again in %.1fs",
                src.url,
                delay,
            )
        finally:
            sub.close(0)

    def _secure(self, sock: zmq.Socket[Any]) -> None:
        """A CURVE client of the fleet's publishers (a throwaway key pair of its own:
        knowing the server's public key, derived from the secret, is the proof)."""
        if self.secret is None:
            return
        public, private = zmq.curve_keypair()
        server = curve_server_keys(self.secret)[0]
        sock.setsockopt(zmq.CURVE_SERVERKEY, server)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, private)

    async def _on_batch(self, src: Source, seq: int, payload: bytes) -> None:
        entry = self.index.engine(src.url)
        expected = entry.next_seq
        if expected is not None and seq < expected:
            # Sequence went backwards (replays never overlap live batches): a new
            # engine process.
            logger.info("KV events of %s restarted at %d (expected %d)", src.url, seq, expected)
            self.index.drop(src.url, "restart")
            entry.next_seq = expected = None
        if expected is None and seq > 0:
            # A late join: what happened before is in the replay buffer, if anywhere.
            expected = 0
        if expected is not None and seq > expected:
            await self._replay(src, expected, seq)
        self._apply(src, payload)
        entry.next_seq = seq + 1

    def _apply(self, src: Source, payload: bytes) -> None:
        try:
            events = EventBatch.decode(payload).events
        except ValueError as e:
            if src.url not in self._warned:
                self._warned.add(src.url)
                logger.warning("KV events of %s: undecodable batch skipped (%s)", src.url, e)
            self.index.engine(src.url).last_event = time.monotonic()
            return
        self.index.apply(src.url, events)
        self._failures.pop(src.url, None)

    async def _replay(self, src: Source, start: int, until: int) -> None:
        """Fetch batches ``start .. until-1`` from the replay socket and apply them;
        drop the engine's entries when they cannot all be had."""
        outcome, got = "failed", start
        if src.replay:
            dealer = self.ctx.socket(zmq.DEALER)
            self._secure(dealer)
            dealer.setsockopt(zmq.LINGER, 0)
            try:
                dealer.connect(src.replay)
                await dealer.send_multipart([b"", pack_seq(start)])
                deadline = time.monotonic() + REPLAY_TIMEOUT
                first = True
                while True:
                    left = deadline - time.monotonic()
                    if left <= 0 or not await dealer.poll(int(left * 1000)):
                        break
                    frames = await dealer.recv_multipart()
                    seq_bytes, payload = frames[-2], frames[-1]
                    seq = unpack_seq(seq_bytes)
                    if seq == -1:
                        outcome = "ok" if got >= until else "partial"
                        break
                    if first and seq > start:
                        self.index.drop(src.url, "gap")  # the start is gone from the buffer
                    first = False
                    if start <= seq < until and seq >= got:
                        self._apply(src, payload)
                        got = seq + 1
            finally:
                dealer.close(0)
            if outcome == "partial" and got >= until:
                outcome = "ok"
        if outcome != "ok":
            if got < until and start > 0:
                self.index.drop(src.url, "gap")
            logger.info("KV events of %s: replay of %d..%d %s", src.url, start, until - 1, outcome)
        if self.metrics is not None:
            self.metrics.kv_index_replays.labels(src.url, outcome).inc()

    async def stop(self) -> None:
        tasks = list(self.tasks.values())
        tasks += [t for t in (self._sweeper, self._syncer) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.tasks.clear()
        self.ctx.term()
