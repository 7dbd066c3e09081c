"""Peer pulls: a fleet-wide prefix cache (docs/peer-pull.md).

When an engine other than the routed one holds more of a prompt's leading
blocks (the exact prefix index says so, device or host tier), the gateway
predicts three costs and takes the cheapest:

* **holder**: serve it where the blocks are::

      wait(h) + step(h) + (1 + pulls(h)) · (N − cached(h)) / rate(h)

* **pull**: the routed engine ``c`` pulls the holder's blocks, then computes the tail::

      lend(h) + step(h) + shared(h) / rate(h)
      + (cached(h) − cached(c)) · block_bytes / bw(h, c)
      + wait(c) + step(c) + (N − cached(h)) / rate(c)

* **recompute**: ``c`` computes everything it lacks::

      wait(c) + step(c) + (1 + pulls(c)) · (N − cached(c)) / rate(c)

with N the prompt's tokens (block-rounded), ``cached(e)`` the tokens of the
leading blocks ``e`` holds, and every figure measured, none configured:

* ``rate(e)``: prompt tokens per second of prefill forward time, from the
  growth of ``pdfleet_engine_prompt_tokens_total`` and
  ``pdfleet_engine_prefill_busy_seconds_total`` between scrapes;
* ``step(e)``: the engine's mean step time between scrapes (a new request
  waits for the step in progress; 0 for an engine idle at its last scrape and
  sent nothing since);
* ``wait(e)``: the prompt tokens queued there (``pdfleet_engine_waiting_prompt_tokens``
  at the last scrape, plus what this gateway routed there since) over ``rate(e)``;
* ``pulls(e)``: the pulls this gateway planned into ``e`` and has not seen
  computed: each is still waiting for its KV, so a prompt computed there now
  delays each of them by its own computation, which the option is charged
  with (a pull's own tail lands behind them and delays none);
* ``bw(h, c)``: bytes per second of the confirmed pulls from ``h`` into
  ``c``, from ``c``'s per-producer counters (``pdfleet_engine_kv_peer_pull_*``);
* ``lend(h)``: how long ``h`` took to answer its lend requests, timed here,
  less the waits predicted for each (``step(h) + shared(h) / rate(h)``);
* ``shared(h)``: 0 when the lent blocks are all on the holder's device tier
  (the index says so): the holder leases them between steps, with no forward
  pass, so the lend waits for the step in progress only (``step(h)``). Some on
  its host tier: the lend runs in the holder's next step, which copies them
  back and shares its token budget with the queue there, so ``shared(h)`` is
  the prompt tokens queued there capped at that budget (0 while the holder is
  at capacity: its queue waits for a slot, the lend does not).

Each is an exponentially weighted average (``ALPHA``) over its samples. A
pair that has never pulled borrows the mean of the measured pairs; before any
pair is measured the gateway *explores*: it pulls when the prefix is at least
``EXPLORE_MIN_BLOCKS`` blocks and the other two options are not predicted
cheaper than the pull without its transfer, so the first pulls measure the pairs.

The crossover of a pair, the prefix length from which pulling beats
recomputing at an idle holder, is ``lend(h) / (1 / rate(c) − bytes_per_token / bw(h, c))``
(+Inf when the denominator is not positive); the gateway exports it per pair
and for the median pair (``pdfleet status`` shows that one).

A pull is one lend request to the holder (the client's body with one output
token and ``kv_transfer_params: {do_remote_decode, pdfleet_lend_blocks}``): the
holder leases the blocks from its cache (refusing when it no longer holds them)
and answers with signed params, which go to ``c`` with the client's body; ``c``
pulls, verifies the content chain, confirms, and computes the tail. A refused or
failed lend recomputes on ``c``; a pull that fails on ``c`` recomputes there.

In a P/D fleet the same decision picks the engine of the prefill leg among the
prefill engines: ``c`` then gets the prefill leg with the holder's params and
``pdfleet_produce``, pulls, computes the tail, and leases the whole prompt to
the decode engine. The holder may also be a decode engine (a *lender*: it
holds what it decoded, such as a conversation's last turn, which the next
turn's prompt extends): a prefill engine pulls from it as from a peer, and its
``holder`` option is serving the whole request there, decode-only.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from ..contracts import metrics as m
from ..contracts.gateway_view import PeerPullCosts
from ..contracts.kv_params import FIELD as KV_PARAMS
from ..contracts.kv_params import LEND_FIELD, KVTransferParams
from ..http.upstream import UpstreamClient, UpstreamError, UpstreamResponse
from .engines import EngineLoad, EngineState
from .kv_index import KVIndex
from .metrics import GatewayMetrics
from .prompt import PromptInfo

logger = logging.getLogger("pdfleet.gateway")

ALPHA = 0.3
"""Weight of the newest sample in every moving average."""
EXPLORE_MIN_BLOCKS = 4
"""Before any pair is measured, pull only prefixes of at least this many blocks."""
MIN_RATE_TOKENS = 16
"""Scrape intervals that computed fewer prompt tokens do not measure a rate."""
ROUTED_MEMORY_S = 30.0
"""Routed-since-the-scrape entries older than this are dropped (a stopped scrape)."""


class Ewma:
    """An exponentially weighted moving average (None before the first sample)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float | None = None

    def add(self, sample: float) -> None:
        """Mutates."""
        self.value = sample if self.value is None else ALPHA * sample + (1 - ALPHA) * self.value


@dataclass
class Option:
    """One way to serve the request and its predicted seconds to the first token."""

    decision: str
    """``m.HOLDER``, ``m.PULL`` or ``m.RECOMPUTE`` (the decisions metric's values)."""
    engine: EngineState
    """The engine that serves the request."""
    seconds: float
    tokens: int = 0
    """Prompt tokens that engine computes."""
    pull_bytes: float = 0.0
    """KV bytes it pulls first (a pull)."""


@dataclass
class Plan:
    """What the gateway does with a request whose prefix another engine holds."""

    decision: str
    """``m.HOLDER``, ``m.PULL`` or ``m.RECOMPUTE`` (the decisions metric's values)."""
    reason: str
    """cost or explore."""
    engine: EngineState
    """The engine that serves the request."""
    holder: EngineState
    lend_blocks: int = 0
    """pull: the leading blocks the holder leases."""
    options: list[Option] = field(default_factory=list)
    lend_wait: float | None = None
    """pull: the seconds its lend was predicted to wait at the holder (``lend_wait``)."""
    alone: bool = False
    """holder, with a lender as the holder: ``engine`` serves the whole request
    in place of the route (in P/D: decode-only on the decode engine that holds
    the prefix)."""


@dataclass
class EngineCosts:
    """What has been measured of one engine."""

    rate: Ewma = field(default_factory=Ewma)
    step: Ewma = field(default_factory=Ewma)
    lend: Ewma = field(default_factory=Ewma)
    waiting_tokens: float = 0.0
    block_bytes: float = 0.0
    engine_id: str | None = None
    """Its KV engine id, learned from its lend answers (the pull counters name it)."""
    routed: list[tuple[float, int]] = field(default_factory=list)
    """(monotonic time, tokens to compute) routed here since its last scrape."""
    busy: bool = False
    """It had requests at its last scrape (an idle engine starts a new one at once)."""
    step_budget: float = 0.0
    """Tokens one of its steps may schedule (0: unknown)."""
    full: bool = False
    """Every slot was taken at its last scrape (``max_num_seqs`` running): its
    queue is not computed in its next step."""
    pulling: list[tuple[float, float]] = field(default_factory=list)
    """(monotonic time, bytes) of the pulls planned into it and not yet computed:
    its own transfers queue behind them."""
    scraped_at: float = 0.0
    lends: bool = True
    """False once it refused a lend's params (not a KV producer: a ``kv_consumer``
    decode engine of a fleet run by hand): it is no longer asked to lend."""


class PeerPull:
    """The measured costs and the per-request decision; one per gateway process."""

    def __init__(
        self, metrics: GatewayMetrics, kv_index: KVIndex, block_size: int, lend_timeout: float
    ) -> None:
        self.metrics = metrics
        self.kv_index = kv_index
        self.block_size = block_size
        self.lend_timeout = lend_timeout
        self.engines: dict[str, EngineCosts] = {}
        self.bandwidth: dict[tuple[str, str], Ewma] = {}
        """(holder url, puller url) -> bytes/s."""
        self._decided: dict[tuple[str, str], Any] = {}
        metrics.peer_pull_fleet_crossover.set(-1)  # on, nothing measured yet (0: off)

    def _costs(self, url: str) -> EngineCosts:
        costs = self.engines.get(url)
        if costs is None:
            costs = self.engines[url] = EngineCosts()
        return costs

    def forget(self, url: str) -> None:
        """Mutates: an engine left the pool."""
        self.engines.pop(url, None)
        for pair in [p for p in self.bandwidth if url in p]:
            del self.bandwidth[pair]

    # -- measuring ------------------------------------------------------------------

    def scraped(self, e: EngineState, old: EngineLoad, new: EngineLoad) -> None:
        """Mutates: one scrape of ``e`` (the pool's hook) updates its figures."""
        c = self._costs(e.url)
        now = time.monotonic()
        c.scraped_at = now
        c.routed = []  # the scrape's waiting tokens hold what was routed before it
        c.waiting_tokens = new.waiting_prompt_tokens
        c.busy = new.running + new.waiting > 0
        c.block_bytes = new.kv_block_bytes
        c.step_budget = new.step_token_budget
        c.full = 0 < new.max_num_seqs <= new.running
        tokens = new.prompt_tokens - old.prompt_tokens
        busy = new.prefill_busy_seconds - old.prefill_busy_seconds
        if tokens >= MIN_RATE_TOKENS and busy > 0:
            c.rate.add(tokens / busy)
        steps = new.steps - old.steps
        if steps > 0 and new.step_seconds >= old.step_seconds:
            c.step.add((new.step_seconds - old.step_seconds) / steps)
        if c.rate.value is not None:
            self.metrics.peer_pull_prefill_rate.labels(e.url).set(c.rate.value)
        by_id = {x.engine_id: url for url, x in self.engines.items() if x.engine_id}
        for producer, (pulls, nbytes, seconds) in new.peer_pulls.items():
            before = old.peer_pulls.get(producer, (0.0, 0.0, 0.0))
            holder = by_id.get(producer)
            d_bytes, d_seconds = nbytes - before[1], seconds - before[2]
            if holder is None or pulls <= before[0] or d_bytes <= 0 or d_seconds <= 0:
                continue
            bw = self.bandwidth.setdefault((holder, e.url), Ewma())
            bw.add(d_bytes / d_seconds)
            if bw.value is None:
                raise RuntimeError("broken invariant: an Ewma has a value once a sample is added")
            self.metrics.peer_pull_bandwidth.labels(holder, e.url).set(bw.value)
        self._export_crossovers()

    def lent(self, holder: EngineState, seconds: float, engine_id: str | None) -> None:
        """Mutates: a lend request answered in ``seconds``."""
        c = self._costs(holder.url)
        c.lend.add(seconds)
        if engine_id:
            c.engine_id = engine_id
        if c.lend.value is None:
            raise RuntimeError("broken invariant: an Ewma has a value once a sample is added")
        self.metrics.peer_pull_lend_seconds.labels(holder.url).set(c.lend.value)
        self._export_crossovers()

    def routed(self, e: EngineState, tokens: int, pull_bytes: float = 0.0) -> Callable[[], None]:
        """Mutates: ``tokens`` to compute (after pulling ``pull_bytes``) were sent
        to ``e``. The tokens count as its queue until its next scrape (which
        counts them itself while they wait), the bytes as its pulls in flight;
        each until the returned function is called (the gateway saw the request
        computed: its first event)."""
        c = self._costs(e.url)
        now = time.monotonic()
        c.routed = [x for x in c.routed if now - x[0] < ROUTED_MEMORY_S]  # the same tuples
        c.pulling = [x for x in c.pulling if now - x[0] < ROUTED_MEMORY_S]
        entry = (now, tokens)
        c.routed.append(entry)
        pull = (now, pull_bytes)
        if pull_bytes > 0:
            c.pulling.append(pull)

        def computed() -> None:
            for queue, item in ((c.routed, entry), (c.pulling, pull)):
                for i, x in enumerate(queue):
                    if x is item:
                        del queue[i]
                        break

        return computed

    def view(self, url: str) -> PeerPullCosts:
        """What is measured of one engine (the gateway's ``/engines``)."""
        c = self._costs(url)
        return PeerPullCosts(
            prefill_tokens_per_s=_rounded(c.rate.value),
            step_s=_rounded(c.step.value, 4),
            lend_s=_rounded(c.lend.value, 4),
            queued_prompt_tokens=c.waiting_tokens + sum(n for _, n in c.routed),
            kv_block_bytes=c.block_bytes,
            step_wait_s=round(self.in_progress(url), 4),
        )

    def routed_request(self, e: EngineState, info: PromptInfo) -> Callable[[], None] | None:
        """Mutates: a request routed to ``e`` without a plan; its tokens less the
        leading blocks ``e`` holds count as ``e``'s queue (see ``routed``)."""
        if info.num_tokens <= 0 or not info.analyzed:
            return None
        held = 0
        if info.exact_hashes:
            held = self.kv_index.matched(info.exact_hashes, [e.url]).get(e.url, (0, 0.0))[0]
        return self.routed(e, max(0, info.num_tokens - held * self.block_size))

    # -- predicting -----------------------------------------------------------------

    def _rate(self, url: str) -> float | None:
        own = self._costs(url).rate.value
        if own is not None:
            return own
        known = [x.rate.value for x in self.engines.values() if x.rate.value is not None]
        return statistics.fmean(known) if known else None

    def _bandwidth(self, holder: str, puller: str) -> float | None:
        own = self.bandwidth.get((holder, puller))
        if own is not None and own.value is not None:
            return own.value
        known = [b.value for b in self.bandwidth.values() if b.value is not None]
        return statistics.fmean(known) if known else None

    def _lend(self, holder: str) -> float:
        own = self._costs(holder).lend.value
        if own is not None:
            return own
        known = [x.lend.value for x in self.engines.values() if x.lend.value is not None]
        return statistics.fmean(known) if known else 0.0

    def compute_seconds(self, e: EngineState, tokens: int, rate: float) -> float:
        """Predicted seconds until ``e`` has computed ``tokens`` more prompt tokens of
        a new request: its queue, the step in progress (when it is busy), then the
        tokens."""
        c = self._costs(e.url)
        queued = c.waiting_tokens + sum(n for _, n in c.routed)
        return queued / rate + self.in_progress(e.url) + tokens / rate

    def in_progress(self, url: str) -> float:
        """Predicted seconds a request arriving at ``url`` now waits for the step in
        progress there: its mean step time while it is busy (requests at its last
        scrape, or sent some since), else 0. A lend waits for it too: the engine
        answers it between steps (device tier) or runs it in its next step (host
        tier), ahead of its queue either way but not of the step running."""
        c = self._costs(url)
        return (c.step.value or 0.0) if c.busy or c.routed else 0.0

    def lend_wait(self, url: str, rate: float, shared: bool = True) -> float:
        """Predicted seconds a lend sent to ``url`` now waits beyond its own cost:
        the step in progress, then (``shared``) the rest of the step it runs in.
        A lend of device-tier blocks runs in no step (``shared`` False: the engine
        leases them between steps). One of host-tier blocks goes ahead of the
        queue but not out of the step it shares: unless the engine is at capacity
        (``shared`` False: its queue waits for room, the lend does not: it passes
        ``max_num_seqs``), that step also computes the prompt tokens queued there,
        up to the engine's token budget per step (all of them when the budget is
        not known)."""
        c = self._costs(url)
        queued = c.waiting_tokens + sum(n for _, n in c.routed) if shared else 0.0
        if c.step_budget > 0:
            queued = min(queued, c.step_budget)
        return self.in_progress(url) + queued / rate

    def delay(self, url: str, tokens: int, rate: float) -> float:
        """Predicted seconds that computing ``tokens`` more prompt tokens on ``url``
        now adds to the requests already waiting for it there: the pulls planned
        into it and not yet computed. Each is still reading its KV (or waiting for
        its lend); a request sent now goes ahead of it in the engine's steps, so
        each waits ``tokens / rate`` longer. Requests queued there to compute are
        not delayed (they go first); nor is a pull planned now (its transfer
        queues behind theirs), so a pull's own option is charged nothing."""
        return len(self._costs(url).pulling) * tokens / rate

    def crossover(self, holder: str, puller: str) -> float | None:
        """Prefix tokens from which pulling from ``holder`` into ``puller`` beats
        recomputing there; inf when it never does; None while unmeasured."""
        rate = self._costs(puller).rate.value
        bw = self.bandwidth.get((holder, puller))
        block_bytes = self._costs(puller).block_bytes or self._costs(holder).block_bytes
        if rate is None or bw is None or bw.value is None or not block_bytes:
            return None
        margin = 1.0 / rate - block_bytes / self.block_size / bw.value
        if margin <= 0:
            return math.inf
        return self._lend(holder) / margin

    def _export_crossovers(self) -> None:
        values = []
        for holder, puller in self.bandwidth:
            x = self.crossover(holder, puller)
            if x is None:
                continue
            values.append(x)
            self.metrics.peer_pull_crossover.labels(holder, puller).set(x)
        if values:
            self.metrics.peer_pull_fleet_crossover.set(statistics.median(values))

    def plan(
        self,
        info: PromptInfo,
        routed: EngineState,
        candidates: Iterable[EngineState],
        full: set[str],
        block_size: int,
        lenders: Iterable[EngineState] = (),
        alone_below: int = 0,
    ) -> Plan | None:
        """The cheapest way to serve a request routed to ``routed``, when another
        engine holds more of its leading blocks; None to keep the route (no
        such holder, the costs unmeasured, or engines that cannot pull).

        ``candidates``: the engines that may take ``routed``'s part (serve the
        request, or in P/D run its prefill leg), pulling first or not.
        ``lenders``: engines that may hold the prefix and lend it but never take
        that part (in P/D, the decode engines for a prefill leg); a lender's
        ``holder`` option is serving the whole request there (``Plan.alone``),
        offered only when it would compute fewer than ``alone_below`` prompt
        tokens (0: never)."""
        self.block_size = block_size
        exact = info.exact_hashes
        if not exact or info.batch or info.prompt_logprobs:
            return None
        targets = [e for e in candidates if e.routable]
        if all(e is not routed for e in targets):
            targets.append(routed)
        in_targets = {e.url for e in targets}
        pool = targets + [e for e in lenders if e.routable and e.url not in in_targets]
        held = self.kv_index.matched(exact, [e.url for e in pool])
        holders = [e for e in pool if self._costs(e.url).lends]
        if not held or not holders:
            return None
        # Ties go to the routed engine, then to a candidate over a lender.
        holder = max(
            holders,
            key=lambda e: (held.get(e.url, (0, 0.0))[0], e is routed, e.url in in_targets),
        )
        lender = holder.url not in in_targets
        bs = self.block_size
        held_blocks = held.get(holder.url, (0, 0.0))[0]
        # The lend leases whole blocks before the prompt's last token.
        held_blocks = min(held_blocks, (info.num_tokens - 1) // bs)
        target = routed
        if target is holder:
            # The router chose the holder: the alternative is the candidate that
            # would compute soonest.
            others = [e for e in targets if e is not holder and e.url not in full]
            if not others:
                return None
            target = min(others, key=lambda e: self._costs(e.url).waiting_tokens)
        own = min(held.get(target.url, (0, 0.0))[0], held_blocks)
        if held_blocks <= own:
            return None
        if not (self._costs(holder.url).block_bytes and self._costs(target.url).block_bytes):
            return None  # one of them has no KV connector: no pull between them
        rate_t, rate_h = self._rate(target.url), self._rate(holder.url)
        if rate_t is None or rate_h is None:
            return None  # nothing measured yet: the router's choice stands
        n = info.num_tokens
        # Computing here delays the pulls in flight into the engine (``delay``).
        options = [
            Option(
                m.RECOMPUTE,
                target,
                self.compute_seconds(target, n - own * bs, rate_t)
                + self.delay(target.url, n - own * bs, rate_t),
                n - own * bs,
            ),
        ]
        tail_tokens = n - held_blocks * bs
        if holder.url not in full and (not lender or tail_tokens < alone_below):
            options.append(
                Option(
                    m.HOLDER,
                    holder,
                    self.compute_seconds(holder, tail_tokens, rate_h)
                    + self.delay(holder.url, tail_tokens, rate_h),
                    tail_tokens,
                )
            )
        bw = self._bandwidth(holder.url, target.url)
        moved = (held_blocks - own) * self._costs(holder.url).block_bytes
        # The target's transfers already under way go first.
        in_flight = sum(b for _, b in self._costs(target.url).pulling)
        # A lend of device-tier blocks is answered between steps: it shares no
        # step with the holder's queue.
        device = self.kv_index.on_device(exact[:held_blocks], holder.url)
        shared = not device and holder.url not in full and not self._costs(holder.url).full
        lend_wait = self.lend_wait(holder.url, rate_h, shared=shared)
        lend = self._lend(holder.url) + lend_wait
        tail = self.compute_seconds(target, tail_tokens, rate_t)
        reason = "cost"
        if bw is None:
            # No pair measured yet: explore when the prefix is worth measuring on.
            if held_blocks - own < EXPLORE_MIN_BLOCKS:
                return self._chosen(
                    min(options, key=lambda o: o.seconds), holder, "cost", 0, options, lender
                )
            pull = Option(m.PULL, target, lend + tail, tail_tokens, moved)
            reason = "explore"
        else:
            transfer = (in_flight + moved) / bw
            pull = Option(m.PULL, target, lend + transfer + tail, tail_tokens, moved)
        options.append(pull)
        best = min(options, key=lambda o: o.seconds)
        plan = self._chosen(
            best, holder, reason if best is pull else "cost", held_blocks, options, lender
        )
        plan.lend_wait = lend_wait
        return plan

    @staticmethod
    def _chosen(
        best: Option,
        holder: EngineState,
        reason: str,
        blocks: int,
        options: list[Option],
        lender: bool,
    ) -> Plan:
        """``lender``: the holder is a lender, not a candidate (see ``plan``)."""
        return Plan(
            best.decision,
            reason,
            best.engine,
            holder,
            blocks if best.decision == m.PULL else 0,
            options,
            alone=lender and best.decision == m.HOLDER,
        )

    def count(self, decision: str, reason: str) -> None:
        key = (decision, reason)
        counter = self._decided.get(key)
        if counter is None:
            counter = self._decided[key] = self.metrics.fast_counter(
                self.metrics.peer_pull_decisions.labels(decision, reason)
            )
        counter.inc()

    # -- lending --------------------------------------------------------------------

    async def lend(
        self,
        client: UpstreamClient,
        plan: Plan,
        endpoint: str,
        body: dict[str, Any],
        chat: bool,
        headers: dict[str, str],
    ) -> dict[str, Any] | None:
        """Ask the holder to lease ``plan.lend_blocks`` cached blocks; its signed
        params, or None (refused: the blocks left its cache; failed; timed out)."""
        payload = json.dumps(lend_body(body, chat, plan.lend_blocks)).encode()
        # What the lend waits for at the holder (the step in progress, and for
        # host-tier blocks the queue it shares its step with) was predicted with
        # the plan (lend_wait);
        # lend(h) learns the rest (the round trip and the lend's own work), so a
        # lend at a busy holder and one at an idle holder teach the same figure.
        waited = plan.lend_wait if plan.lend_wait is not None else self.in_progress(plan.holder.url)
        start = time.monotonic()
        try:
            resp = await client.post(
                plan.holder.url + endpoint, payload, headers, self.lend_timeout
            )
        except (UpstreamError, TimeoutError, OSError) as e:
            logger.info("peer pull: lend from %s failed: %s", plan.holder.url, e)
            self.count(m.RECOMPUTE, "lend_failed")
            return None
        seconds = max(0.0, time.monotonic() - start - waited)
        params: Any = None
        lent: KVTransferParams | None = None
        if resp.status_code == 200:
            try:
                params = resp.json().get(KV_PARAMS)
                lent = KVTransferParams.from_wire(params)
            except (ValueError, AttributeError):  # not JSON, no object, or malformed params
                lent = None
        if resp.status_code == 400 and _cannot_lend(resp):
            # It cannot lend at all (a kv_consumer engine): ask it no more.
            self._costs(plan.holder.url).lends = False
            logger.warning(
                "peer pull: %s refuses to lend (%s); it is no longer asked to",
                plan.holder.url,
                resp.content[:300],
            )
        if lent is None or not lent.remote_block_ids or not isinstance(params, dict):
            logger.info(
                "peer pull: %s did not lend %d blocks (%d): %s",
                plan.holder.url,
                plan.lend_blocks,
                resp.status_code,
                resp.content[:300],
            )
            self.count(m.RECOMPUTE, "lend_refused")
            return None
        self.lent(plan.holder, seconds, lent.remote_engine_id)
        self.count(m.PULL, plan.reason)
        return params  # as the holder signed it: forwarded unchanged


def lend_body(body: dict[str, Any], chat: bool, blocks: int) -> dict[str, Any]:
    """A lend request: the client's prompt (rendered and tokenized by the holder
    exactly as the puller will), one output token, no stream, the lend params."""
    out = dict(body)
    out["max_tokens"] = 1
    if chat:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out["n"] = 1
    for key in (
        "stream_options",
        "min_tokens",
        "min_completion_tokens",
        "prompt_logprobs",
        "response_format",
        "structured_outputs",
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ):
        out.pop(key, None)
    out[KV_PARAMS] = KVTransferParams(do_remote_decode=True, lend_blocks=blocks).to_wire()
    return out


def _cannot_lend(resp: UpstreamResponse) -> bool:
    """Whether a lend's 400 says the engine lends nothing, whatever the prompt: it
    refuses the ``kv_transfer_params`` (its error's ``param``) for another reason
    than the lend's blocks (which it names: too few prompt tokens for them, say).
    An engine that is no KV producer (``kv_consumer``) answers so."""
    try:
        error = resp.json().get("error")
    except (ValueError, AttributeError):
        return False
    if not isinstance(error, dict) or error.get("param") != KV_PARAMS:
        return False
    return LEND_FIELD not in str(error.get("message", ""))


def _rounded(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)
