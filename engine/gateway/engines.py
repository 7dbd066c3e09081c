"""The engine pool: discovery diffs, health checks, metric scrapes, ejection.

Every ``scrape_interval`` seconds each engine's ``/health`` and ``/metrics``
are fetched concurrently. An engine enters routing after its first good check;
it is ejected after ``eject_after`` consecutive failed checks, at once when
it says it is not ready (503: loading or draining) or when a request finds
its port closed; it comes back after ``readmit_after`` consecutive good
checks. Load (waiting, running, KV usage) and the P/D compatibility hash come
from the scrape: the pdfleet names first, the vLLM names as a fallback, so
vLLM pods can be driven too.

Ejection for anything but a definitive answer (a refused connection, a 503)
is relative, so that a fleet slow as a whole ejects nothing:

* a **stall** (in-flight requests, nothing received) counts against the
  engine's own pace: nothing for ``max(--stall-timeout, --stall-step-multiple
  × its longest step in the last STEP_WINDOW_S seconds + --scrape-interval)``,
  the longest step read from its ``pdfleet_engine_step_duration_seconds``
  histogram at each scrape, while an engine that serves the same role made
  progress since; but an engine whose last check (recent, none failed since)
  reported a step in progress (``pdfleet_engine_step_running_seconds``) is
  busy in a long step, not stalled, until that step is ``--stall-max-step``
  old: its HTTP loop answers while the engine thread steps, which a stopped
  process's does not;
* **failed checks** (timeouts, errors) eject only while an engine of the same
  role passes its checks;
* the **last routable engine of a role** is never ejected for either: the
  requests on it wait, each within its own bounds (first token, idle,
  request timeouts).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import Counter, deque
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
    "waiting_for_slot": m.names(m.ENGINE_NUM_REQUESTS_WAITING_FOR_SLOT),
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
# The step-time histogram (pdfleet engines only): the stall watchdog's sense of pace.
_STEP = m.ENGINE_STEP_DURATION
_STEP_BUCKET = _STEP.name + "_bucket"
# The step in progress (pdfleet engines only): its age, answered while it runs.
_STEP_RUNNING = m.ENGINE_STEP_RUNNING.name
_STEP_TOKENS = m.ENGINE_STEP_SCHEDULED_TOKENS.name
# What peer pulls' cost model reads (docs/peer-pull.md): prefill rate, backlog, KV
# bytes per block, and each producer's confirmed pulls into this engine.
_PEER_PULL = {
    "prefill_busy_seconds": m.ENGINE_PREFILL_BUSY_SECONDS.name,
    "waiting_prompt_tokens": m.ENGINE_WAITING_PROMPT_TOKENS.name,
    "kv_block_bytes": m.ENGINE_KV_BLOCK_BYTES.name,
    "step_token_budget": m.ENGINE_MAX_NUM_BATCHED_TOKENS.name,
    "max_num_seqs": m.ENGINE_MAX_NUM_SEQS.name,
}
_PEER_ROWS = (
    m.ENGINE_KV_PEER_PULLS.name,
    m.ENGINE_KV_PEER_PULL_BYTES.name,
    m.ENGINE_KV_PEER_PULL_SECONDS.name,
)
_ADAPTERS = m.ENGINE_LORA_ADAPTER_INFO.name
_RESIDENT = m.ENGINE_LORA_ADAPTER_RESIDENT.name
_LORA_INFO = m.VLLM_LORA_REQUESTS_INFO.name
_WANTED = (
    *(n for names in (*_GAUGES.values(), *_COUNTERS.values(), _INFO) for n in names),
    _ADAPTERS,
    _RESIDENT,
    _LORA_INFO,
    _STEP.name,
    _STEP_RUNNING,
    _STEP_TOKENS,
    *_PEER_PULL.values(),
    *_PEER_ROWS,
)
# Seconds over which an engine's longest step is remembered.
STEP_WINDOW_S = 300.0


@dataclass
class EngineLoad:
    """What one scrape of an engine's /metrics says."""

    waiting: float = 0.0
    waiting_for_slot: float | None = None
    """Of those, the requests that queue (not a served request's sequences held
    back beside free slots, nor KV pulls); None for engines that do not say
    (vLLM)."""
    running: float = 0.0
    kv_usage: float = 0.0
    compat_hash: str | None = None
    """None for engines that publish none (vLLM): those pair only with each other."""
    resume_identity: str | None = None
    """What a migrated request may resume across (docs/migration.md); None for
    engines that publish none: their requests move only within a compat hash."""
    block_size: int | None = None
    hash_algo: str | None = None
    """The engine's ``prefix_caching_hash_algo`` (pdfleet engines publish it)."""
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    kv_transfers: float = 0.0
    kv_failures: float = 0.0
    """Completed and failed KV pulls so far (decode engines with a connector)."""
    kv_pulls: float = 0.0
    """KV pulls in flight: requests that wait for bytes, not for room."""
    steps: float = 0.0
    """Engine steps so far (the step histogram's count; 0 for vLLM engines)."""
    step_seconds: float = 0.0
    """Their total wall time (the histogram's sum)."""
    step_buckets: tuple[tuple[float, float], ...] = ()
    """The histogram's cumulative buckets: (upper bound in seconds, steps)."""
    step_running: float | None = None
    """Age (seconds) of the step in progress at the scrape, 0 between steps;
    None for engines that do not report it (vLLM)."""
    step_tokens: float = 0.0
    """Tokens that step scheduled."""
    prefill_busy_seconds: float = 0.0
    """Forward seconds of steps that computed prompt tokens (pdfleet engines)."""
    waiting_prompt_tokens: float = 0.0
    """Prompt tokens not yet computed of the requests not running."""
    kv_block_bytes: float = 0.0
    """Bytes a KV pull moves per block (0: no KV connector, cannot lend or pull)."""
    step_token_budget: float = 0.0
    """Tokens one step may schedule (0: not published, e.g. vLLM)."""
    max_num_seqs: float = 0.0
    """Requests it runs at once (0: not published, e.g. vLLM)."""
    peer_pulls: dict[str, tuple[float, float, float]] = field(default_factory=dict)
    """Per producer engine id: confirmed pulls into this engine, their bytes and seconds."""
    adapters: dict[str, tuple[str, str]] = field(default_factory=dict)
    """LoRA adapters the engine serves: name -> (prefix-cache identity, directory)."""
    resident: dict[str, str] = field(default_factory=dict)
    """Where the weights of served adapters are: name -> "device" (a device
    slot) or "host" (host memory only); absent: registered only (read from
    its directory when a step needs it), or an engine that does not say
    (tensor-parallel and vLLM engines)."""
    max_loras: int | None = None
    """Its device slots for adapters (``--max-loras``, from vLLM's
    ``vllm:lora_requests_info``); None: not said."""


def longest_step(old: EngineLoad, new: EngineLoad) -> float | None:
    """An upper bound (seconds) of the longest step between two scrapes, from
    the step histogram: the smallest bucket bound that holds every new step,
    and at most their summed time. None when no step completed, at the
    first scrape (those steps may be hours old), or when the engine
    restarted (its counts went back)."""
    steps = new.steps - old.steps
    if steps <= 0 or len(old.step_buckets) != len(new.step_buckets):
        return None
    bound = math.inf
    before = dict(old.step_buckets)
    for le, count in new.step_buckets:
        if count - before.get(le, 0.0) >= steps:
            bound = le
            break
    return min(bound, max(0.0, new.step_seconds - old.step_seconds))


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
    load.kv_pulls = scrape.total(*m.names(m.ENGINE_KV_PULLS_IN_FLIGHT)) or 0.0
    load.steps = scrape.total(_STEP.count) or 0.0
    load.step_seconds = scrape.total(_STEP.sum) or 0.0
    buckets: dict[float, float] = {}
    for labels_of, value in scrape.samples.get(_STEP_BUCKET, ()):
        with contextlib.suppress(KeyError, ValueError):
            le = float(labels_of["le"])  # "+Inf" parses too
            buckets[le] = buckets.get(le, 0.0) + value
    load.step_buckets = tuple(sorted(buckets.items()))
    load.step_running = scrape.total(_STEP_RUNNING)
    load.step_tokens = scrape.total(_STEP_TOKENS) or 0.0
    for attr, name in _PEER_PULL.items():
        setattr(load, attr, scrape.total(name) or 0.0)
    rows: dict[str, list[float]] = {}
    for i, name in enumerate(_PEER_ROWS):
        for labels_of, value in scrape.samples.get(name, ()):
            producer = labels_of.get(m.KV_PRODUCER)
            if producer:
                rows.setdefault(producer, [0.0, 0.0, 0.0])[i] += value
    load.peer_pulls = {k: (v[0], v[1], v[2]) for k, v in rows.items()}
    for labels_of, value in scrape.samples.get(_ADAPTERS, ()):
        lora_name = labels_of.get(m.LORA_NAME)
        if lora_name and value:
            load.adapters[lora_name] = (
                labels_of.get(m.LORA_IDENTITY, ""),
                labels_of.get(m.LORA_PATH, ""),
            )
    for labels_of, value in scrape.samples.get(_RESIDENT, ()):
        lora_name, tier = labels_of.get(m.LORA_NAME), labels_of.get(m.LORA_TIER)
        # One tier per adapter (the engine exports one); device wins a tie.
        if (
            lora_name
            and tier in ("device", "host")
            and value
            and load.resident.get(lora_name) != "device"
        ):
            load.resident[lora_name] = tier
    for labels_of, _ in scrape.samples.get(_LORA_INFO, ()):
        with contextlib.suppress(KeyError, ValueError):
            load.max_loras = int(labels_of[m.LORA_MAX]) or None
    labels = scrape.labels(*_INFO)
    if labels is not None:
        load.compat_hash = labels.get(m.COMPAT_HASH) or None
        load.resume_identity = labels.get(m.RESUME_IDENTITY) or None
        with contextlib.suppress(KeyError, ValueError):
            load.block_size = int(labels[m.BLOCK_SIZE])
        load.hash_algo = labels.get(m.PREFIX_CACHING_HASH_ALGO) or None
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
    """monotonic time of the last byte from the engine, of its last completed
    step or computed token seen in a scrape, or of the start of its first
    in-flight request: the stall watchdog's clock."""
    steps: StepWindow = field(default_factory=lambda: StepWindow(STEP_WINDOW_S))
    """Its longest recent steps (the stall watchdog's sense of its pace)."""
    step_started: float | None = None
    """monotonic time (the gateway's clock) at which the step in progress at
    its last good check began, by the age it reported; None between steps,
    and for engines that report no step in progress (vLLM)."""
    checked: float = 0.0
    """monotonic time of its last good check (health and scrape answered)."""
    spared: bool = False
    """Silent past its stall limit but kept (last of its role, or no engine of
    its role progressed): logged once per silence."""
    admitted: int = 0
    """Requests routed to it (as their decode engine) whose answers have not
    ended: their slots (``admission.py``)."""
    capacity: int | None = None
    """Slots it has, learned from its scrapes; None until it first queues."""
    top_admitted: int = 0
    """Of ``admitted``, the slots of the best band's requests
    (``Admission.top_band``): the share that band may take beyond the
    capacity is counted on them alone."""
    pending: dict[int, float] = field(default_factory=dict)
    """Slots on it still waiting for their first answer (a streamed decode
    leg's first event, a prefill leg's end): the request's key to the
    monotonic time it took the slot (``admission.py``)."""
    stalled: bool = False
    """Ejected for a stall (until readmitted): legs waiting on it have given up."""
    unpaced: bool = False
    """A check failed or the watchdog judged it stalled, and no step measured
    since is known to have begun after it: a step that spans the gap may hold
    the time its process was stopped (a SIGSTOP, a frozen host), so the steps
    measured are not its pace until a good check after the gap found no step
    in progress that began before that gap's first good check."""
    back_at: float | None = None
    """monotonic time of its first good check after the gap (None: none yet)."""
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

    def roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.role == "both" else (self.role,)


class StepWindow:
    """The longest step an engine reported in the last ``window`` seconds: a
    monotonic deque (values decreasing from the left), O(1) per scrape."""

    __slots__ = ("_items", "window")

    def __init__(self, window: float) -> None:
        self.window = window
        self._items: deque[tuple[float, float]] = deque()

    def add(self, now: float, seconds: float) -> None:
        items = self._items
        while items and items[-1][1] <= seconds:
            items.pop()
        items.append((now, seconds))

    def longest(self, now: float) -> float:
        """0.0 when no step was seen within the window."""
        items = self._items
        while items and items[0][0] < now - self.window:
            items.popleft()
        return items[0][1] if items else 0.0

    def longest_since(self, since: float) -> float | None:
        """The longest step reported after the monotonic ``since`` (every entry
        the deque dropped had a later one at least as long); None if none was."""
        for at, seconds in self._items:
            if at > since:
                return seconds
        return None


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
        self.adapter_first_seen: dict[str, str] = {}
        """The lora_identity the gateway first saw for each adapter name."""
        self.block_size = DEFAULT_BLOCK_SIZE
        self.hash_algo = "sha256"
        """The engines' (most common) prefix-cache hash algorithm."""
        self.check_timeout = httpx.Timeout(
            max(2.0, 2 * config.scrape_interval), connect=config.connect_timeout
        )
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        # Set (and replaced) whenever an engine becomes routable: held requests wait on it.
        self._routable = asyncio.Event()
        self.on_scrape: Callable[[EngineState, EngineLoad, EngineLoad], None] = lambda e, old, new: (
            None
        )
        self.on_stall: Callable[[EngineState], None] = lambda e: None
        """Called for each engine this process ejects for a stall (``--workers
        N``: the other workers are told, ``stalled_elsewhere``)."""
        self.on_routable: Callable[[], None] = lambda: None
        """Called whenever an engine becomes routable (requests waiting for a
        slot look again)."""
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

    def adapter(self, name: str) -> tuple[str, str] | None:
        """(identity, directory) of a LoRA adapter some known engine serves; None
        when none does (the name is the base model's, or unknown). When engines
        serve the name with different weights (lora_identity), the identity
        most of them serve, a tie going to the one first seen; the engines
        with another count in ``pdfleet_gateway_lora_identity_conflicts`` and
        are never routed the name (:meth:`holds_adapter`). Cost: one dict
        lookup per engine."""
        counts: dict[str, int] = {}
        found: dict[str, tuple[str, str]] = {}
        for e in self.engines.values():
            served = e.load.adapters.get(name)
            if served is not None:
                counts[served[0]] = counts.get(served[0], 0) + 1
                found.setdefault(served[0], served)
        if not counts:
            if self.adapter_first_seen.pop(name, None) is not None:
                # Served nowhere now: a later load starts afresh.
                self.metrics.lora_identity_conflicts.labels(name).set(0)
            return None
        first = self.adapter_first_seen.setdefault(name, next(iter(found)))
        best = max(counts, key=lambda identity: (counts[identity], identity == first))
        conflicts = sum(counts.values()) - counts[best]
        self.metrics.lora_identity_conflicts.labels(name).set(conflicts)
        return found[best]

    def holds_adapter(self, e: EngineState, name: str) -> bool:
        """Whether ``e`` serves adapter ``name`` with the weights requests
        naming it are routed to (:meth:`adapter`)."""
        served = e.load.adapters.get(name)
        if served is None:
            return False
        chosen = self.adapter(name)
        return chosen is not None and served[0] == chosen[0]

    def sole_candidate(self, role: str) -> EngineState | None:
        """The one routable engine of ``role``; None when there are none or several."""
        sole = None
        for e in self.engines.values():
            # (``routable`` and ``serves``, inline: read per request)
            if e.state == "healthy" and (e.role == role or e.role == "both"):
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
            self.on_routable()
        e.state = state
        e.successes = e.failures = 0
        self.metrics.engine_healthy.labels(e.url, e.role).set(1 if state == "healthy" else 0)

    def record_success(self, e: EngineState, load: EngineLoad) -> None:
        old, e.load = e.load, load
        now = time.monotonic()
        back = e.back_at
        if (
            e.unpaced
            and back is not None
            and e.checked >= back
            and (e.step_started is None or e.step_started >= back)
        ):
            # The previous good check, after the gap, found no step in
            # progress that began before the process was surely running
            # again: every step measured now began after the gap.
            e.unpaced, e.back_at = False, None
        e.checked = now
        running = load.step_running
        e.step_started = now - running if running is not None and running > 0 else None
        longest = longest_step(old, load)
        # A step that spans a failed check or a stall is not the engine's pace:
        # kept, a stop of S seconds would raise its stall limit to about
        # --stall-step-multiple × S for STEP_WINDOW_S, so its next stall would
        # outlast --idle-timeout, and its peers would look too slow to show
        # that another engine's silence is not the fleet's.
        if longest is not None and not e.unpaced:
            e.steps.add(now, longest)
        if e.unpaced and e.back_at is None:
            e.back_at = now
        if (load.prompt_tokens, load.generation_tokens, load.steps) != (
            old.prompt_tokens,
            old.generation_tokens,
            old.steps,
        ):
            self.progress(e)  # stepping, even if no answer has come back yet
        self.on_scrape(e, old, load)
        e.failures = 0
        e.successes += 1
        if e.state == "pending" or (
            e.state == "ejected" and e.successes >= self.config.readmit_after
        ):
            self._set_state(e, "healthy")

    def record_failure(self, e: EngineState, reason: str, definitive: bool = False) -> None:
        """A failed check (or request). ``definitive``: the engine said it is
        not ready, or refused the connection: eject without waiting. Otherwise
        (a timeout, an error) only while another engine of its role passes
        its checks, and never the last routable one of a role."""
        e.last_error = reason
        e.successes = 0
        e.failures += 1
        e.unpaced, e.back_at = True, None
        if e.state != "healthy":
            return
        if definitive:
            self._set_state(e, "ejected", reason)
        elif e.failures >= self.config.eject_after:
            if self.others_serve(e) and any(o.failures == 0 for o in self.peers(e)):
                self._set_state(e, "ejected", reason)
            elif e.failures == self.config.eject_after:
                logger.warning(
                    "engine %s (%s): %d failed checks (%s), but no other %s engine passes "
                    "its checks: kept in routing",
                    e.url,
                    e.role,
                    e.failures,
                    reason,
                    e.role,
                )

    def peers(self, e: EngineState) -> list[EngineState]:
        """Routable engines other than ``e`` that serve a role it serves."""
        roles = e.roles()
        return [
            o
            for o in self.engines.values()
            if o is not e and o.routable and any(o.serves(r) for r in roles)
        ]

    def others_serve(self, e: EngineState) -> bool:
        """Whether every role ``e`` serves keeps a routable engine without it."""
        return all(
            any(o is not e and o.routable and o.serves(r) for o in self.engines.values())
            for r in e.roles()
        )

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
        e.spared = False

    def started(self, e: EngineState) -> None:
        """A request went to ``e``: an idle engine's stall clock starts now."""
        if e.inflight == 0:
            e.last_progress = time.monotonic()

    def stall_limit(self, e: EngineState, now: float | None = None) -> float:
        """Seconds ``e`` may send nothing with requests in flight: a multiple of
        its longest recent step (plus the scrape interval, the lag of the
        evidence that a step ended), never under --stall-timeout."""
        now = time.monotonic() if now is None else now
        config = self.config
        paced = config.stall_step_multiple * e.steps.longest(now) + config.scrape_interval
        return max(config.stall_timeout, paced)

    def max_step(self) -> float:
        """Seconds one step may run before its engine counts as wedged even
        though it answers its checks (--stall-max-step, by default
        max(120, --stall-timeout × --stall-step-multiple))."""
        config = self.config
        if config.stall_max_step is not None:
            return config.stall_max_step
        return max(120.0, config.stall_timeout * config.stall_step_multiple)

    def probe_bound(self) -> float:
        """Seconds since its last good check within which an engine's report
        of a step in progress still counts: one interval plus the two
        requests of a check (health, metrics), each bounded by the check's
        timeout. A stopped process (SIGSTOP, a frozen host) answers no check,
        so its report goes stale within this bound."""
        read = self.check_timeout.read or self.config.scrape_interval
        return self.config.scrape_interval + 2 * read

    def in_step(self, e: EngineState, now: float) -> bool:
        """Whether ``e`` is busy in one long step rather than stalled: its
        last good check (at most :meth:`probe_bound` ago, with no failed
        check since) reported a step in progress, younger than
        :meth:`max_step` now. Engines that report no step (vLLM) never are."""
        return (
            e.step_started is not None
            and e.failures == 0
            and now - e.checked <= self.probe_bound()
            and now - e.step_started <= self.max_step()
        )

    def find_stalls(self, now: float | None = None) -> list[EngineState]:
        """Mutates: eject engines whose in-flight requests have made no progress
        for their stall limit while an engine of the same role kept a pace that
        rules out a slow fleet (:meth:`keeps_pace`), unless the engine is the
        last routable one of a role it serves."""
        now = time.monotonic() if now is None else now
        out = []
        for e in list(self.engines.values()):
            # An engine already ejected for failing its checks is watched too:
            # a stopped process's scrapes time out, often before its silence
            # reaches the stall limit, and its legs in flight wait on it until
            # it counts as stalled (then they move on, migratable ones resumed).
            watched = e.routable or (e.state == "ejected" and e.failures > 0 and not e.stalled)
            if not (watched and e.inflight > 0):
                continue
            silent = now - e.last_progress
            limit = self.stall_limit(e, now)
            if silent <= limit or self.in_step(e, now):
                continue
            last = not self.others_serve(e)
            if last or not any(
                self.keeps_pace(o, e.last_progress, silent, now) for o in self.peers(e)
            ):
                if not e.spared:
                    e.spared = True
                    logger.warning(
                        "engine %s (%s): %d requests in flight, nothing for %.1fs (its limit "
                        "%.1fs), but %s: kept in routing, its requests wait",
                        e.url,
                        e.role,
                        e.inflight,
                        silent,
                        limit,
                        "it is the last routable engine of its role"
                        if last
                        else f"no other {e.role} engine kept a faster pace (a slow fleet)",
                    )
                continue
            self._eject_stalled(
                e,
                f"stalled: {e.inflight} requests in flight, nothing received for "
                f"{silent:.1f}s (its limit {limit:.1f}s) while another {e.role} engine "
                "kept its pace",
            )
            self.on_stall(e)
            out.append(e)
        return out

    def keeps_pace(self, o: EngineState, since: float, silent: float, now: float) -> bool:
        """Whether ``o`` shows that a silence of ``silent`` seconds (since the
        monotonic ``since``) is not the whole fleet's slowness: it passes its
        checks; with requests in flight, it is not nearly as silent itself (its
        own silence, times --stall-step-multiple, is shorter than ``silent``);
        and its steps are as short (the longest it reported since, or in its
        window when idle). An engine without a step histogram (vLLM) shows its
        pace by its progress since alone. With --stall-step-multiple 0, any progress
        since counts."""
        k = self.config.stall_step_multiple
        if k <= 0:
            return o.last_progress > since
        if o.failures:
            return False  # (a stopped host: its checks time out too)
        if o.inflight > 0 and (o.last_progress <= since or k * (now - o.last_progress) >= silent):
            return False  # as stuck as the other: everything stopped
        if not o.load.step_buckets:
            return o.last_progress > since  # (idle: it answered after the other went quiet)
        longest = o.steps.longest_since(since) if o.inflight > 0 else o.steps.longest(now)
        return longest is not None and k * longest < silent

    def stalled_elsewhere(self, url: str, since: float, now: float | None = None) -> bool:
        """Mutates: another worker ejected ``url`` for a stall (nothing from it
        since the monotonic ``since``, a clock every process on the host
        shares). Ejected here too, unless this process has received from it
        within its stall limit or it is the last routable engine of a role;
        True when it was ejected."""
        e = self.engines.get(url)
        if e is None or not e.routable or not self.others_serve(e):
            return False
        now = time.monotonic() if now is None else now
        if (
            e.inflight > 0
            and e.last_progress > since
            and now - e.last_progress <= self.stall_limit(e, now)
        ):
            return False  # it answers this worker: not wedged as far as it can tell
        self._eject_stalled(e, "stalled (seen by another gateway worker)")
        return True

    def _eject_stalled(self, e: EngineState, reason: str) -> None:
        self.metrics.stalls.labels(e.url, e.role).inc()
        if e.state == "ejected":  # ejected by failed checks: now known to be stalled
            logger.warning("engine %s (%s), ejected, is %s", e.url, e.role, reason)
        self._set_state(e, "ejected", reason)
        e.stalled = True
        e.unpaced, e.back_at = True, None
        for cm in list(e.waiters):  # those legs go to another engine now
            if not cm.expired():
                cm.reschedule(asyncio.get_running_loop().time())

    def watch_period(self) -> float:
        """Seconds between two looks of the stall watchdog."""
        return min(0.5, self.config.stall_timeout / 4)

    def stall_found_by(self, e: EngineState) -> float:
        """Seconds from now by which the watchdog has judged ``e`` if it is
        stalled now: its stall limit after its last progress, plus two looks
        (negative: past)."""
        now = time.monotonic()
        return e.last_progress + self.stall_limit(e, now) + 2 * self.watch_period() - now

    async def watch_stalls(self) -> None:
        period = self.watch_period()
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
