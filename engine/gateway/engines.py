"""The engine pool: discovery diffs, health checks, metric scrapes, ejection.

Every ``scrape_interval`` seconds each engine's ``/health`` and ``/metrics``
are fetched concurrently. An engine enters routing after its first good check;
it is ejected after ``eject_after`` consecutive failed checks, at once when
it says it is not ready (503: loading or draining) or when a request finds
its port closed; it comes back after ``readmit_after`` consecutive good
checks. Load (waiting, running, KV usage) and the P/D compatibility hash come
from the scrape: the pdfleet names first, the vLLM names as a fallback, so
vLLM pods can be driven too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ..config.gateway import GatewayConfig
from ..contracts import metrics as m
from .discovery import Discovery, Endpoint
from .metrics import GatewayMetrics

logger = logging.getLogger("pdfleet.gateway")

DEFAULT_BLOCK_SIZE = 16

# Load field -> the series it reads (native name, then vLLM's); summed over label sets.
_GAUGES = {
    "waiting": m.names(m.ENGINE_NUM_REQUESTS_WAITING),
    "running": m.names(m.ENGINE_NUM_REQUESTS_RUNNING),
    "kv_usage": m.names(m.ENGINE_KV_CACHE_USAGE),
}
# Counters: tokens computed (the stall watchdog's evidence of progress) and
# KV pulls (the KV circuit breaker's, on decode engines).
_COUNTERS = {
    "prompt_tokens": m.names(m.ENGINE_PROMPT_TOKENS),
    "generation_tokens": m.names(m.ENGINE_GENERATION_TOKENS),
    "kv_transfers": m.names(m.ENGINE_KV_TRANSFERS),
    "kv_failures": m.names(m.ENGINE_KV_TRANSFER_FAILURES),
}
_INFO = m.names(m.ENGINE_CACHE_CONFIG)
_WANTED = tuple(n for names in (*_GAUGES.values(), *_COUNTERS.values(), _INFO) for n in names)


@dataclass
class EngineLoad:
    """What one scrape of an engine's /metrics says."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    compat_hash: str | None = None
    """None for engines that publish none (vLLM): those pair only with each other."""
    block_size: int | None = None
    hash_algo: str | None = None
    """The engine's ``prefix_caching_hash_algo`` (pdfleet engines publish it)."""
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    kv_transfers: float = 0.0
    kv_failures: float = 0.0
    """Completed and failed KV pulls so far (decode engines with a connector)."""


def parse_engine_metrics(text: str) -> EngineLoad:
    """Read the routing inputs out of Prometheus text; absent gauges read 0
    (an engine that has not stepped yet exports none)."""
    # Parse only the few lines needed: engines export hundreds of histogram lines.
    scrape = m.parse_metrics(text, only=_WANTED)
    load = EngineLoad()
    for attr, names in _GAUGES.items():
        value = scrape.total(*names)
        if value is not None:
            setattr(load, attr, value)
    for attr, names in _COUNTERS.items():
        value = scrape.total(*names)
        if value is not None:
            setattr(load, attr, value)
    labels = scrape.labels(*_INFO)
    if labels is not None:
        load.compat_hash = labels.get("compat_hash") or None
        with contextlib.suppress(KeyError, ValueError):
            load.block_size = int(labels["block_size"])
        load.hash_algo = labels.get("prefix_caching_hash_algo") or None
    return load


@dataclass
class EngineState:
    url: str
    role: str
    name: str = ""
    kv_events: str | None = None
    """ZMQ endpoints of the engine's KV event stream and replay socket."""
    kv_events_replay: str | None = None
    state: str = "pending"
    """pending (never checked good yet), healthy (routable) or ejected."""
    load: EngineLoad = field(default_factory=EngineLoad)
    inflight: int = 0
    """Requests the gateway has on this engine now (exact, unlike the scrape)."""
    failures: int = 0
    successes: int = 0
    last_error: str = ""
    last_progress: float = 0.0
    """monotonic time of the last byte from the engine (or of the start of its
    first in-flight request): the stall watchdog's clock."""
    stalled: bool = False
    """Ejected for a stall (until readmitted): legs waiting on it have given up."""
    waiters: set[Any] = field(default_factory=set)
    """The deadlines (``proxy.Deadline``) of legs waiting on the engine; a
    stall fires them at once."""
    inflight_gauge: Any = field(default=None, repr=False, compare=False)
    """Its in-flight metric series (the proxy's, made on first use)."""

    @property
    def routable(self) -> bool:
        return self.state == "healthy"

    def serves(self, role: str) -> bool:
        return self.role == role or self.role == "both"

    def queue(self) -> float:
        """Requests on the engine: the scrape, or the gateway's own count when
        larger (the scrape lags a burst by up to one interval)."""
        return max(self.load.running + self.load.waiting, float(self.inflight))


class EnginePool:
    def __init__(
        self,
        config: GatewayConfig,
        discovery: Discovery,
        metrics: GatewayMetrics,
        client: httpx.AsyncClient,
        on_eject: Callable[[str], None] = lambda url: None,
        on_add: Callable[[str], None] = lambda url: None,
    ) -> None:
        self.config = config
        self.discovery = discovery
        self.metrics = metrics
        self.client = client
        self.on_eject = on_eject
        self.on_add = on_add
        self.engines: dict[str, EngineState] = {}
        self.block_size = DEFAULT_BLOCK_SIZE
        self.hash_algo = "sha256"
        """The engines' (most common) prefix-cache hash algorithm."""
        self.check_timeout = httpx.Timeout(
            max(2.0, 2 * config.scrape_interval), connect=config.connect_timeout
        )
        self._task: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None
        # Set (and replaced) whenever an engine becomes routable: held requests wait on it.
        self._routable = asyncio.Event()
        self.on_scrape: Callable[[EngineState, EngineLoad, EngineLoad], None] = lambda e, old, new: (
            None
        )
        self.on_stall: Callable[[EngineState], None] = lambda e: None
        """Called for each engine this process ejects for a stall (``--workers
        N``: the other workers are told, ``stalled_elsewhere``)."""
        self.on_refused: Callable[[EngineState], None] = lambda e: None
        """Called for each engine this process ejects for a refused connection
        (``--workers N``: the other workers are told, ``refused_elsewhere``)."""

    # -- membership ------------------------------------------------------------

    def apply(self, endpoints: list[Endpoint]) -> None:
        """Make the pool equal to ``endpoints`` (a URL listed with two roles serves both)."""
        roles: dict[str, Endpoint] = {}
        for ep in endpoints:
            prev = roles.get(ep.url)
            if prev is not None and prev.role != ep.role:
                ep = Endpoint(
                    ep.url,
                    "both",
                    ep.name or prev.name,
                    ep.kv_events or prev.kv_events,
                    ep.kv_events_replay or prev.kv_events_replay,
                )
            roles[ep.url] = ep
        for url in list(self.engines):
            e = self.engines[url]
            listed = roles.get(url)
            if listed is None or listed.role != e.role:
                logger.info("engine %s (%s) removed", url, e.role)
                del self.engines[url]
                self.metrics.forget_engine(url, e.role)
                self.on_eject(url)
        for url, ep in roles.items():
            known = self.engines.get(url)
            if known is not None:
                known.kv_events, known.kv_events_replay = ep.kv_events, ep.kv_events_replay
            if url not in self.engines:
                logger.info("engine %s (%s) added", url, ep.role)
                self.on_add(url)
                self.engines[url] = EngineState(
                    url, ep.role, ep.name, ep.kv_events, ep.kv_events_replay
                )
                self.metrics.engine_healthy.labels(url, ep.role).set(0)
                self.metrics.engine_inflight.labels(url, ep.role).set(0)

    def candidates(self, role: str) -> list[EngineState]:
        return [e for e in self.engines.values() if e.routable and e.serves(role)]

    def sole_candidate(self, role: str) -> EngineState | None:
        """The one routable engine of ``role``; None when there are none or several."""
        sole = None
        for e in self.engines.values():
            if e.routable and e.serves(role):
                if sole is not None:
                    return None
                sole = e
        return sole

    def counts(self) -> dict[str, int]:
        out = {"prefill": 0, "decode": 0}
        for role in out:
            out[role] = len(self.candidates(role))
        return out

    # -- health ----------------------------------------------------------------

    def _set_state(self, e: EngineState, state: str, reason: str = "") -> None:
        if e.state == state:
            return
        if state == "ejected":
            logger.warning("engine %s (%s) ejected: %s", e.url, e.role, reason)
            if e.state == "healthy":
                self.metrics.ejections.labels(e.url, e.role).inc()
            self.on_eject(e.url)
        elif state == "healthy":
            logger.info(
                "engine %s (%s) %s",
                e.url,
                e.role,
                "readmitted" if e.state == "ejected" else "ready",
            )
            e.stalled = False
            e.last_progress = time.monotonic()
            self._routable.set()
            self._routable = asyncio.Event()
        e.state = state
        e.successes = e.failures = 0
        self.metrics.engine_healthy.labels(e.url, e.role).set(1 if state == "healthy" else 0)

    def record_success(self, e: EngineState, load: EngineLoad) -> None:
        old, e.load = e.load, load
        if (load.prompt_tokens, load.generation_tokens) != (
            old.prompt_tokens,
            old.generation_tokens,
        ):
            self.progress(e)  # computing, even if no answer has come back yet
        self.on_scrape(e, old, load)
        e.failures = 0
        e.successes += 1
        if e.state == "pending" or (
            e.state == "ejected" and e.successes >= self.config.readmit_after
        ):
            self._set_state(e, "healthy")

    def record_failure(self, e: EngineState, reason: str, definitive: bool = False) -> None:
        """A failed check (or request). ``definitive``: the engine said it is
        not ready, or refused the connection: eject without waiting."""
        e.last_error = reason
        e.successes = 0
        e.failures += 1
        if e.state == "healthy" and (definitive or e.failures >= self.config.eject_after):
            self._set_state(e, "ejected", reason)

    def refused(self, e: EngineState, reason: str) -> None:
        """A request's connection to ``e`` was refused: ejected at once."""
        was_routable = e.routable
        self.record_failure(e, reason, definitive=True)
        if was_routable and not e.routable:
            self.on_refused(e)

    def refused_elsewhere(self, url: str) -> bool:
        """Mutates: another worker's connection to ``url`` was refused; ejected
        here too (its health checks readmit it); True when it was ejected."""
        e = self.engines.get(url)
        if e is None or not e.routable:
            return False
        self.record_failure(e, "connection refused (seen by another gateway worker)", True)
        return True

    # -- progress and stalls ---------------------------------------------------------

    def progress(self, e: EngineState) -> None:
        """The engine sent something (an answer's head, an event, a whole answer)."""
        e.last_progress = time.monotonic()

    def started(self, e: EngineState) -> None:
        """A request went to ``e``: an idle engine's stall clock starts now."""
        if e.inflight == 0:
            e.last_progress = time.monotonic()

    def find_stalls(self, now: float | None = None) -> list[EngineState]:
        """Mutates: eject engines whose in-flight requests have made no progress
        for --stall-timeout while another engine made progress since (so a
        fleet that is slow as a whole ejects nothing)."""
        now = time.monotonic() if now is None else now
        limit = self.config.stall_timeout
        stalled = [
            e
            for e in self.engines.values()
            if e.routable and e.inflight > 0 and now - e.last_progress > limit
        ]
        out = []
        for e in stalled:
            # Another engine moved since this one last did: not a slow fleet.
            if not any(
                o is not e and o.last_progress > e.last_progress for o in self.engines.values()
            ):
                continue
            self._eject_stalled(
                e,
                f"stalled: {e.inflight} requests in flight, nothing received for "
                f"{now - e.last_progress:.1f}s while other engines progressed",
            )
            self.on_stall(e)
            out.append(e)
        return out

    def stalled_elsewhere(self, url: str, since: float, now: float | None = None) -> bool:
        """Mutates: another worker ejected ``url`` for a stall (nothing from it
        since the monotonic ``since``, a clock every process on the host
        shares). Ejected here too, unless this process has received from it
        within --stall-timeout; True when it was ejected."""
        e = self.engines.get(url)
        if e is None or not e.routable:
            return False
        now = time.monotonic() if now is None else now
        if (
            e.inflight > 0
            and e.last_progress > since
            and now - e.last_progress <= (self.config.stall_timeout)
        ):
            return False  # it answers this worker: not wedged as far as it can tell
        self._eject_stalled(e, "stalled (seen by another gateway worker)")
        return True

    def _eject_stalled(self, e: EngineState, reason: str) -> None:
        self.metrics.stalls.labels(e.url, e.role).inc()
        self._set_state(e, "ejected", reason)
        e.stalled = True
        for cm in list(e.waiters):  # those legs go to another engine now
            if not cm.expired():
                cm.reschedule(asyncio.get_running_loop().time())

    async def watch_stalls(self) -> None:
        period = min(0.5, self.config.stall_timeout / 4)
        while True:
            await asyncio.sleep(period)
            try:
                self.find_stalls()
            except Exception:  # never let the watchdog die
                logger.exception("stall watchdog failed")

    async def wait_routable(self, role: str, deadline: float) -> bool:
        """Wait (until the monotonic ``deadline``) for an engine of ``role`` to be routable."""
        while not self.candidates(role):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._routable.wait()
        return True

    async def check(self, e: EngineState) -> None:
        try:
            health = await self.client.get(e.url + "/health", timeout=self.check_timeout)
            if health.status_code != 200:
                self.record_failure(e, f"/health answered {health.status_code}", definitive=True)
                return
            scraped = await self.client.get(e.url + "/metrics", timeout=self.check_timeout)
            scraped.raise_for_status()
            load = parse_engine_metrics(scraped.text)
        except Exception as ex:  # any failure of the check counts; the reason is logged
            self.record_failure(e, f"{type(ex).__name__}: {ex}")
            return
        self.record_success(e, load)

    def _update_block_size(self) -> None:
        sizes = Counter(e.load.block_size for e in self.engines.values() if e.load.block_size)
        if sizes:
            self.block_size = sizes.most_common(1)[0][0]
        algos = Counter(e.load.hash_algo for e in self.engines.values() if e.load.hash_algo)
        if algos:
            self.hash_algo = algos.most_common(1)[0][0]

    async def tick(self) -> None:
        endpoints = await self.discovery.poll()
        if endpoints is not None:
            self.apply(endpoints)
        engines = list(self.engines.values())
        await asyncio.gather(*(self.check(e) for e in engines))
        self._update_block_size()

    async def run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # never let the loop die: routing depends on it
                logger.exception("engine pool tick failed")
            await asyncio.sleep(
                max(0.0, self.config.scrape_interval - (time.monotonic() - started))
            )

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name="pdfleet-gateway-pool")
        self._watchdog = asyncio.create_task(self.watch_stalls(), name="pdfleet-gateway-stalls")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._watchdog) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
