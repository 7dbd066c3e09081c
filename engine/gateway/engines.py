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

import httpx

from pdfleet.engine.config import metrics as m
from pdfleet.engine.config.gateway import GatewayConfig

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
_INFO = m.names(m.ENGINE_CACHE_CONFIG)
_WANTED = (*(n for names in _GAUGES.values() for n in names), *_INFO)


@dataclass
class EngineLoad:
    """What one scrape of an engine's /metrics says."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    compat_hash: str | None = None
    """None for engines that publish none (vLLM): those pair only with each other."""
    block_size: int | None = None


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
    labels = scrape.labels(*_INFO)
    if labels is not None:
        load.compat_hash = labels.get("compat_hash") or None
        with contextlib.suppress(KeyError, ValueError):
            load.block_size = int(labels["block_size"])
    return load


@dataclass
class EngineState:
    url: str
    role: str
    name: str = ""
    state: str = "pending"
    """pending (never checked good yet), healthy (routable) or ejected."""
    load: EngineLoad = field(default_factory=EngineLoad)
    inflight: int = 0
    """Requests the gateway has on this engine now (exact, unlike the scrape)."""
    failures: int = 0
    successes: int = 0
    last_error: str = ""

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
    ) -> None:
        self.config = config
        self.discovery = discovery
        self.metrics = metrics
        self.client = client
        self.on_eject = on_eject
        self.engines: dict[str, EngineState] = {}
        self.block_size = DEFAULT_BLOCK_SIZE
        self.check_timeout = httpx.Timeout(
            max(2.0, 2 * config.scrape_interval), connect=config.connect_timeout
        )
        self._task: asyncio.Task | None = None

    # -- membership ------------------------------------------------------------

    def apply(self, endpoints: list[Endpoint]) -> None:
        """Make the pool equal to ``endpoints`` (a URL listed with two roles serves both)."""
        roles: dict[str, Endpoint] = {}
        for ep in endpoints:
            prev = roles.get(ep.url)
            if prev is not None and prev.role != ep.role:
                ep = Endpoint(ep.url, "both", ep.name or prev.name)
            roles[ep.url] = ep
        for url in list(self.engines):
            e = self.engines[url]
            if url not in roles or roles[url].role != e.role:
                logger.info("engine %s (%s) removed", url, e.role)
                del self.engines[url]
                self.metrics.forget_engine(url, e.role)
                self.on_eject(url)
        for url, ep in roles.items():
            if url not in self.engines:
                logger.info("engine %s (%s) added", url, ep.role)
                self.engines[url] = EngineState(url, ep.role, ep.name)
                self.metrics.engine_healthy.labels(url, ep.role).set(0)
                self.metrics.engine_inflight.labels(url, ep.role).set(0)

    def candidates(self, role: str) -> list[EngineState]:
        return [e for e in self.engines.values() if e.routable and e.serves(role)]

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
        e.state = state
        e.successes = e.failures = 0
        self.metrics.engine_healthy.labels(e.url, e.role).set(1 if state == "healthy" else 0)

    def record_success(self, e: EngineState, load: EngineLoad) -> None:
        e.load = load
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

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
