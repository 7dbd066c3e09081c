"""Continuous-batching scheduler with chunked prefill and preemption by recompute.

There are no prefill and decode phases: every request has
``num_computed_tokens`` and ``num_tokens`` (prompt + output), and each step
gives running requests, then waiting ones, a share of the token budget
(``max_num_batched_tokens``) until they catch up. When the KV cache runs out,
the lowest-priority running request is preempted: its blocks are freed and it
goes back to the front of the queue to be recomputed (its prefix usually hits
the prefix cache).

One client request may be many scheduler requests (the ``n`` completions of
an ``n > 1`` request, the prompts of a batch: a *group*). While requests of
other groups wait, one group holds at most ``max_request_share`` of
``max_num_seqs`` and of the step's token budget: its further requests wait.
When every slot is taken and a request of group g waits, slots are shared
max-min fairly: the group h with the most sequences gives one back (its newest
is preempted, and the slot is promised to g's request) whenever it has more
than one more than g, so two groups at their share still make room for a
third, and groups one apart never trade slots back and forth. Alone, a group
may use everything.

Under the ``priority`` policy, requests also have a *band*
(``contracts/priority.py``: the gateway's trusted priority holds a tenant's
band above a fair-share tag; a client's small priorities are all one band).
Bands are strict where a better one would otherwise wait on a worse one: a
step in which a request of band b prefills (a prompt chunk, or the waiting
request at the head of the queue) schedules no running request of a worse
band (its first token does not share the step with their decodes), and a waiting
request that finds every slot or the KV taken preempts running requests of
the bands below its own, the worst band first and the newest first within it,
as few as make room for it, and none when even all of them would not (they
would lose their KV for nothing; a head that cannot get room holds no band out
of the step either). Within a band nothing is preempted for priority (the tag
orders the queue only), so fair share never churns.
"""

from __future__ import annotations

import heapq
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..config import EngineConfig
from ..contracts.block_hash import extend_block_hashes, root_hash
from ..contracts.kv_params import LEND_FIELD, KVTransferParams
from ..contracts.priority import band_of
from ..request import Request, RequestStatus
from .block_pool import KVBlock, KVCacheEvent
from .connector_side import QUARANTINE, SchedulerConnector
from .host_tier import HostBlock
from .kv_cache_manager import KVCacheManager
from .queues import make_queue
from .sched_output import (
    CachedRequestData,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreOutput:
    """Per-request result of one step."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    kv_transfer_params: KVTransferParams | None = None
    scheduled_time: float | None = None


# Waiting prompts that the token budgets of this many steps start, slots being
# free, are the engine's pipeline rather than its queue
# (``SchedulerStats.num_waiting_for_slot_reqs``).
PIPELINE_STEPS = 2


@dataclass
class SchedulerStats:
    """Snapshot after a step (gauges) plus cumulative counters."""

    num_running_reqs: int = 0
    # Requests the last step could not admit for lack of room (slots, token
    # budget, KV blocks, a group's share), as vLLM's num_requests_waiting: not
    # the siblings of an admitted request waiting for its prefill, nor requests
    # that arrived after the step was scheduled (the next step looks at them).
    # Requests pulling their KV count (they wait in the queue, as in vLLM).
    num_waiting_reqs: int = 0
    # Of those (not pulling their KV), the ones that queue (``_waiting_for_slot``):
    # all of them when the step was short of room; else the new requests beyond
    # what the free slots and the next PIPELINE_STEPS steps' budgets start, and
    # a group's further sequences beyond the free slots left.
    num_waiting_for_slot_reqs: int = 0
    # Every request accepted and not running (the server's queue bound).
    num_queued_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    waiting_prompt_tokens: int = 0
    step_prompt_tokens: int = 0
    step_generation_tokens: int = 0
    num_held_blocks_reqs: int = 0
    # Host tier (--kv-offload-bytes): occupancy and cumulative counters.
    host_kv_num_blocks: int = 0
    host_kv_used_blocks: int = 0
    host_kv_hit_tokens: int = 0
    host_kv_stored_blocks: int = 0
    host_kv_loaded_blocks: int = 0
    host_kv_evicted_blocks: int = 0
    # LoRA: the adapters of running and of waiting requests (sorted names).
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    extra: dict[str, float] = field(default_factory=dict)


# Lend requests a step may run past ``max_num_seqs`` (each computes one token).
LEND_SLOTS = 8


def _lend_blocks(request: Request) -> int:
    """The blocks a lend request (peer pull, docs/peer-pull.md) must find cached; 0
    for every other request."""
    p = request.kv_transfer_params
    return int(p.lend_blocks or 0) if p is not None and p.do_remote_decode else 0


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        num_blocks: int,
        connector: SchedulerConnector | None = None,
        record_kv_events: bool = False,
        num_host_blocks: int = 0,
    ) -> None:
        sched, cache = config.scheduler_config, config.cache_config
        self.max_num_batched_tokens = sched.max_num_batched_tokens
        self.max_num_seqs = sched.max_num_seqs
        self.max_model_len = config.scheduler_config.max_model_len
        self.chunked_prefill = sched.chunked_prefill_enabled
        self.long_prefill_threshold = sched.long_prefill_token_threshold
        self.policy = sched.policy
        self.max_request_share = sched.max_request_share
        # What one group may hold while other groups wait (see the module docstring).
        self.group_seq_cap = max(1, int(sched.max_request_share * self.max_num_seqs))
        self.group_token_cap = max(1, int(sched.max_request_share * self.max_num_batched_tokens))
        self.block_size = cache.block_size
        # Most distinct LoRA adapters among running requests (0: LoRA is off), so
        # every step finds a device slot for each of its adapters.
        self.max_loras = config.lora_config.max_loras if config.lora_config is not None else 0
        self.kv = KVCacheManager(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            cache.prefix_caching_hash_algo,
            record_events=record_kv_events,
            num_host_blocks=num_host_blocks,
        )
        self.connector = connector
        self.requests: dict[str, Request] = {}
        self.waiting = make_queue(self.policy)
        self.running: list[Request] = []
        # Blocks of finished requests held for a remote consumer (KV transfer).
        self.held_blocks: dict[str, list[Any]] = {}
        self.finished_req_ids: set[str] = set()
        # Waiting requests promised a slot that another group gave back (_yield_slots):
        # until they are admitted, no other waiting request takes a free slot.
        self.slot_promised: set[str] = set()
        # Ids of the requests the last ``schedule`` left waiting for room
        # (``SchedulerStats.num_waiting_reqs``).
        self.waiting_for_room: set[str] = set()
        # Whether the last ``schedule`` ran short of room for a request (slots,
        # KV blocks, adapter slots, unpromised slots) or preempted one
        # (``SchedulerStats.num_waiting_for_slot_reqs``).
        self.short_of_room = False
        self.num_preemptions = 0
        self.last_step_prompt_tokens = 0
        # Outputs of requests finished outside a step (lends leased between steps,
        # or refused): ``take_ready`` hands them out, else they go out with the
        # next step's.
        self.ready: list[EngineCoreOutput] = []
        # Lend requests added since the last ``serve_lends``.
        self.new_lends: list[Request] = []

    # -- requests ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        extend_block_hashes(
            request.block_hashes,
            request.all_token_ids,
            self.block_size,
            self.kv.hash_fn,
            root_hash(request.sampling_params.cache_salt, request.lora_identity),
        )
        self.requests[request.request_id] = request
        if _lend_blocks(request):
            # A lend request unblocks a peer: it goes first (``serve_lends`` leases
            # a device-tier prefix at once; a host-tier one runs in the next step).
            self.waiting.push_front(request)
            self.new_lends.append(request)
        else:
            self.waiting.push(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Abort/stop requests by id (unknown ids are ignored). Frees their blocks."""
        done = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            if (
                self.connector is not None
                and request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                and self.connector.request_aborted(request)
            ):
                self._quarantine(request)
            request.status = status
            self._free_request(request)
            done.append(request)
        return done

    def _free_request(self, request: Request) -> KVTransferParams | None:
        """Release a finished request; a connector may take its blocks instead."""
        self.requests.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)
        params = None
        if self.connector is not None and request.status != RequestStatus.FINISHED_ABORTED:
            hold, params = self.connector.request_finished(
                request, self.kv.block_ids(request.request_id)
            )
            if hold:
                self.held_blocks[request.request_id] = self.kv.take_blocks(request)
                return params
        self.kv.free(request)
        return params

    def _refuse_lend(self, request: Request, held: int, wanted: int) -> None:
        """End a lend whose blocks left the cache (a waiting request: the queue
        drops it once finished)."""
        message = (
            f"kv_transfer_params: {LEND_FIELD}: this engine holds {held} of the "
            f"{wanted} blocks named (evicted since); nothing leased"
        )
        request.status = RequestStatus.FINISHED_ERROR
        request.stop_reason = message
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)
        self.ready.append(
            EngineCoreOutput(request.request_id, [], finish_reason="error", stop_reason=message)
        )

    def serve_lends(self) -> None:
        """Mutates: answer the lends added since the last call without a forward
        pass where their blocks allow (between steps, so every cached block's KV
        is written). A lend whose blocks are all in the device prefix cache takes
        references on exactly those blocks and finishes at once, with no token:
        the connector leases them as it does a finished prefill leg's. One with
        blocks gone from both tiers is refused. The rest (some blocks on the
        host tier only) wait for the next step, which copies them back to the
        device and computes the token after them. Their outputs go to ``ready``.
        Without a connector nothing can lease: lends wait for a step."""
        lends, self.new_lends = self.new_lends, []
        if self.connector is None:
            return
        for request in lends:
            if (
                request.request_id not in self.requests
                or request.status != RequestStatus.WAITING
                or request.num_computed_tokens
            ):
                continue  # aborted meanwhile
            wanted = _lend_blocks(request)
            computed, _ = self.kv.get_computed_blocks(request)
            if len(computed) < wanted:
                host = self.kv.get_host_hits(request, len(computed))
                if len(computed) + len(host) < wanted:
                    self._refuse_lend(request, len(computed) + len(host), wanted)
                continue  # on the host tier: a step loads it
            computed = computed[:wanted]
            if self.kv.allocate_slots(request, 0, computed) is None:
                continue  # cannot happen (no new block); the step path decides
            self.kv.record_lookup(request, wanted * self.block_size)
            request.num_computed_tokens = wanted * self.block_size
            request.num_cached_tokens = request.num_computed_tokens
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            self.slot_promised.discard(request.request_id)
            self.ready.append(
                EngineCoreOutput(
                    request.request_id,
                    [],
                    finish_reason=request.status.finish_reason,
                    num_cached_tokens=request.num_cached_tokens,
                    kv_transfer_params=self._free_request(request),
                )
            )

    def take_ready(self) -> list[EngineCoreOutput]:
        """Mutates: the outputs of requests finished outside a step."""
        ready, self.ready = self.ready, []
        return ready

    def _fail_running(self, request: Request, message: str) -> EngineCoreOutput:
        """End a running request with an error (the runner could not run it):
        its blocks are unpublished (they may hold KV computed without what the
        request needed) and freed; nothing of it is offered to a connector."""
        self.running.remove(request)
        request.status = RequestStatus.FINISHED_ERROR
        request.stop_reason = message
        self.kv.uncache(request.request_id)
        self.kv.free(request)
        self.requests.pop(request.request_id, None)
        self.finished_req_ids.add(request.request_id)
        return EngineCoreOutput(request.request_id, [], finish_reason="error", stop_reason=message)

    def _quarantine(self, request: Request) -> None:
        """A pull may still write the request's blocks: keep them out of the free pool
        until the connector reports the transfer finished (``QUARANTINE`` + id). The
        blocks after the loaded ones (taken for the rest of the prompt) go back now."""
        blocks = self.kv.take_blocks(request)
        loaded = -(
            -(request.num_computed_tokens + request.num_external_computed_tokens) // self.block_size
        )
        self.kv.free_blocks(blocks[loaded:])
        self.held_blocks[QUARANTINE + request.request_id] = blocks[:loaded]

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- scheduling -------------------------------------------------------------

    def _preempt_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.finished_req_ids.add(request.request_id)  # the runner drops its state
        self.waiting.push_front(request)

    def _prefill_band(self) -> int | None:
        """The best band among the requests that prefill this step (running ones
        with prompt left, and the waiting request at the head of the queue),
        when some running request is of a worse band: the step leaves those
        running requests out. Waiting requests of worse bands still start on
        free slots (held back, they would look like a queue to the gateway,
        which learns an engine's capacity from its queue). None: no band is
        held back (not the ``priority`` policy, or one band)."""
        if self.policy != "priority" or not self.running:
            return None
        best: int | None = None
        for r in self.running:
            if r.num_computed_tokens < r.num_prompt_tokens:
                band = band_of(r.priority)
                if best is None or band < best:
                    best = band
        if self.waiting and self._head_may_start(self.waiting.peek()):
            band = band_of(self.waiting.peek().priority)
            if best is None or band < best:
                best = band
        if best is None or all(band_of(r.priority) <= best for r in self.running):
            return None
        return best

    def _head_may_start(self, head: Request) -> bool:
        """Whether the waiting request at the head of the queue can start this
        step, a worse band giving its slot and KV up to it: not waiting for
        anything else, no slot promised to others, an adapter slot, and room
        for its next chunk (:meth:`_head_fits`)."""
        if not self._schedulable(head) or _lend_blocks(head):
            return False
        if (
            self.slot_promised
            and head.request_id not in self.slot_promised
            and len(self.running) + len(self.slot_promised) >= self.max_num_seqs
        ):
            return False
        if head.lora_id and all(r.lora_id != head.lora_id for r in self.running):
            loras = {r.lora_id for r in self.running if r.lora_id}
            if len(loras) >= self.max_loras:
                return False
        return self._head_fits(head)

    def _head_fits(self, head: Request) -> bool:
        """Whether the head would find the blocks for its next chunk (a pull: for
        its whole prompt) among the free ones and those of the worse bands'
        running requests (all of them could be its victims), once the better
        bands' running requests took their tokens and blocks (they step first).
        A head that cannot get them does not start, so it holds no band out of
        the step. The estimate errs on the side of yes (the head's host-tier
        hits and the groups' shares are not counted): then the worse bands sit
        the step out, and band preemption (:meth:`_band_victims`) still preempts
        none of them for nothing."""
        band = band_of(head.priority)
        worse = [r for r in self.running if band_of(r.priority) > band]
        if not worse:
            return True
        budget = self.max_num_batched_tokens
        grow = 0  # blocks the better bands' running requests take in this step
        for r in self.running:
            if band_of(r.priority) <= band and budget > 0:
                n = self._cap(r.num_tokens - r.num_computed_tokens, budget)
                budget -= n
                grow += self.kv.num_new_blocks(r, n, [])
        if budget <= 0:
            return False
        computed: list[KVBlock] = []
        num_hit = 0
        if head.num_computed_tokens == 0:
            computed, num_hit = self.kv.get_computed_blocks(head)
        remaining = head.num_tokens - head.num_computed_tokens - num_hit
        p = head.kv_transfer_params
        pulls = self.connector is not None and p is not None and p.do_remote_prefill
        if pulls and head.num_computed_tokens == 0:
            num_new = remaining  # a pull takes blocks for all it loads and computes
        elif not self.chunked_prefill and remaining > budget:
            return False
        else:
            num_new = self._cap(remaining, budget)
        short = self.kv.shortfall(head, num_new, computed) + grow
        return short <= 0 or max(self.kv.blocks_freed_by(worse, computed)) >= short

    def _band_candidates(self, request: Request, scheduled: dict[str, int]) -> list[Request]:
        """The running requests that may be preempted for ``request`` (waiting):
        those of a band below its own with no tokens in this step; none but under
        the ``priority`` policy."""
        if self.policy != "priority":
            return []
        band = band_of(request.priority)
        return [
            r for r in self.running if r.request_id not in scheduled and band_of(r.priority) > band
        ]

    def _band_victims(
        self, request: Request, scheduled: dict[str, int], shortfall: int, computed: list[KVBlock]
    ) -> list[Request]:
        """The fewest of the :meth:`_band_candidates`, taken in their order (the
        worst band first, the newest first within a band), whose preemption gives
        ``request`` a slot and ``shortfall`` more free blocks (its prefix hits are
        ``computed``: a victim's block that it hits is no room for it). Empty when
        even all of them would not make room: preempted, they would lose their KV
        (a landed pull its pulled blocks) and ``request`` would wait all the same."""
        candidates = sorted(
            self._band_candidates(request, scheduled),
            key=lambda r: (r.priority, r.arrival_time),
            reverse=True,
        )
        for n, freed in enumerate(self.kv.blocks_freed_by(candidates, computed), 1):
            if freed >= shortfall:
                return candidates[:n]
        return []

    def _cap(self, num_new: int, budget: int) -> int:
        if 0 < self.long_prefill_threshold < num_new:
            num_new = self.long_prefill_threshold
        return min(num_new, budget)

    def _blocked(self, request: Request) -> bool:
        """Not schedulable yet for a reason other than capacity."""
        if request.wait_for is not None:
            leader = self.requests.get(request.wait_for)
            if leader is not None and leader.num_computed_tokens < leader.num_prompt_tokens:
                return True
            request.wait_for = None
        return request.status == RequestStatus.WAITING_FOR_REMOTE_KVS

    def _waits_on_admitted(self, request: Request) -> bool:
        """A sibling waiting for the prefill of its leader, which was admitted
        (it runs, or pulls its KV): it waits for that prefill, not for room.
        A sibling of a leader that waits for room waits for room too."""
        if request.wait_for is None:
            return False
        leader = self.requests.get(request.wait_for)
        return (
            leader is not None
            and leader.num_computed_tokens < leader.num_prompt_tokens
            and leader.status in (RequestStatus.RUNNING, RequestStatus.WAITING_FOR_REMOTE_KVS)
        )

    # -- sharing between groups ----------------------------------------------------

    @staticmethod
    def _schedulable(request: Request) -> bool:
        """Waiting for a slot (not for remote KV, not for its leader's prefill)."""
        return request.status != RequestStatus.WAITING_FOR_REMOTE_KVS and request.wait_for is None

    def _contending_groups(self) -> set[str]:
        """Groups of schedulable waiting requests; the scan stops at the second
        (two are enough to tell, for any group, whether another one waits)."""
        groups: set[str] = set()
        if self.max_request_share >= 1.0:
            return groups
        for r in self.waiting.unordered():
            if self._schedulable(r):
                groups.add(r.group)
                if len(groups) > 1:
                    break
        return groups

    def _prune_promises(self) -> None:
        """Forget promised slots of requests admitted, finished or waiting for
        something else than a slot."""
        for rid in list(self.slot_promised):
            r = self.requests.get(rid)
            waiting = r is not None and r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            if r is None or not waiting or not self._schedulable(r):
                self.slot_promised.discard(rid)

    def _yield_slots(self, group_running: dict[str, int]) -> None:
        """Every slot is taken (or promised) while requests wait: max-min fair
        sharing. While the poorest group g with a schedulable waiting request has
        at least two sequences fewer than the richest running group h, h's newest
        sequence is preempted and its slot promised to one of g's requests
        (sequences counted running or promised). Groups one apart keep their
        slots: no request is preempted only to take a slot back. A group that has
        its ``max_request_share`` is promised nothing (admission would hold it
        back). Mutates ``group_running``."""
        counts = dict(group_running)
        for rid in self.slot_promised:
            g = self.requests[rid].group
            counts[g] = counts.get(g, 0) + 1
        # Requests that may be promised a slot, by group (at most a slot each).
        wanting: dict[str, list[Request]] = {}
        for r in self.waiting.unordered():
            if not self._schedulable(r) or r.request_id in self.slot_promised:
                continue
            queued = wanting.setdefault(r.group, [])
            if len(queued) < self.max_num_seqs:
                queued.append(r)
        while wanting:
            g = min(wanting, key=lambda x: counts.get(x, 0))
            request = wanting[g][0]
            if request.group_id is not None and counts.get(g, 0) >= self.group_seq_cap:
                del wanting[g]
                continue
            top = max((counts[x] for x, n in group_running.items() if n > 0), default=0)
            if top <= counts.get(g, 0) + 1:
                break  # the poorest waiting group is within one of every group
            # Never for a request of lower priority (a larger value) than the victim's.
            victim = next(
                (
                    r
                    for r in reversed(self.running)
                    if counts[r.group] == top and r.priority >= request.priority
                ),
                None,
            )
            if victim is None:
                del wanting[g]
                continue
            self._preempt(victim)
            counts[victim.group] -= 1
            group_running[victim.group] -= 1
            wanting[g].pop(0)
            if not wanting[g]:
                del wanting[g]
            self.slot_promised.add(request.request_id)
            counts[g] = counts.get(g, 0) + 1

    # -- the step ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:  # noqa: C901 (the one step loop: running, then waiting, then KV loads)
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_blocks_of: dict[str, list[int]] = {}
        new_reqs: list[NewRequestData] = []
        preempted = False
        # A waiting request found no slot or no blocks (``short_of_room``).
        short = False
        now = time.monotonic()
        if self.new_lends:
            self.serve_lends()
        self.kv.begin_step()
        # Groups of waiting requests: a group that is not the only one among them
        # is held to its share of the step.
        contenders = self._contending_groups()
        group_running: dict[str, int] = {}
        group_tokens: dict[str, int] = {}
        if self.slot_promised:
            self._prune_promises()
        if contenders:
            for r in self.running:
                group_running[r.group] = group_running.get(r.group, 0) + 1
            if len(self.running) + len(self.slot_promised) >= self.max_num_seqs:
                self._yield_slots(group_running)

        # A request of a better band prefills: worse bands sit this step out.
        top_band = self._prefill_band()

        def held(request: Request) -> bool:
            """A request of a group (not one on its own) while another group waits."""
            if request.group_id is None or not contenders:
                return False
            return len(contenders) > 1 or request.group_id not in contenders

        # Lends waiting (peer pulls: each computes the token after its blocks and
        # finishes in the step it runs in) keep their tokens from the running
        # requests' chunks: a lend runs in the next step, not after a long prompt's
        # last chunk (the gateway's cost model counts on it).
        lends, holders = self._waiting_pulls()
        # No more than can join this step (up to LEND_SLOTS past max_num_seqs).
        lends = lends[: max(0, self.max_num_seqs + LEND_SLOTS - len(self.running))]
        lend_reserve = min(budget - 1, sum(lends))
        budget -= max(0, lend_reserve)

        # 1. Running requests keep going (decode, or the next chunk of a prompt).
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._cap(request.num_tokens - request.num_computed_tokens, budget)
            group = request.group
            if top_band is not None and band_of(request.priority) > top_band:
                num_new = 0  # it keeps its slot and KV; it steps once the better band has
            elif num_new > 0 and held(request):
                num_new = min(num_new, self.group_token_cap - group_tokens.get(group, 0))
            if num_new <= 0:
                i += 1
                continue
            while (blocks := self.kv.allocate_slots(request, num_new)) is None:
                victim = self._preempt_victim()
                if self.running.index(victim) < i:
                    i -= 1
                # A victim scheduled earlier in this step gives its tokens back.
                budget += num_scheduled.pop(victim.request_id, 0)
                new_blocks_of.pop(victim.request_id, None)
                # Its blocks published for this step's tokens are never written.
                self.kv.uncache_uncomputed(victim)
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
            if request.status == RequestStatus.PREEMPTED:
                continue  # it was the victim; try the others with the blocks freed
            if blocks is None:  # the loop ends with blocks or with the request preempted
                raise RuntimeError("broken invariant: blocks is not None")
            num_scheduled[request.request_id] = num_new
            new_blocks_of[request.request_id] = [b.block_id for b in blocks]
            budget -= num_new
            group_tokens[group] = group_tokens.get(group, 0) + num_new
            i += 1
        cached_reqs = [
            CachedRequestData(rid, new_blocks_of[rid], self.requests[rid].num_computed_tokens)
            for rid in num_scheduled
        ]
        budget += max(0, lend_reserve)

        # 2. Waiting requests join while there is room (not in a step that preempted).
        skipped: list[Request] = []
        # When a request cannot get blocks and nothing can be preempted for it, only
        # the ``holders`` go past it for the rest of the step (``holders_only``).
        holders_only = False
        running_loras = {r.lora_id for r in self.running if r.lora_id}
        while not preempted and budget > 0:
            if not self.waiting:
                break
            request = self.waiting.peek()
            if holders_only and request.request_id not in holders:
                skipped.append(self.waiting.pop())  # behind a blocked head: holders only
                continue
            # Every slot is taken. A lend request (at the head of the queue) still
            # goes, up to LEND_SLOTS past the bound: it computes one token and
            # finishes in this step. Another one may take a worse band's slot; it
            # is preempted with the blocks it needs, once they are known (below).
            need_slot = len(self.running) >= self.max_num_seqs and not (
                _lend_blocks(request) and len(self.running) < self.max_num_seqs + LEND_SLOTS
            )
            if need_slot and not self._band_candidates(request, num_scheduled):
                short = True
                break
            if self._blocked(request):
                skipped.append(self.waiting.pop())
                continue
            if (
                self.slot_promised
                and request.request_id not in self.slot_promised
                and len(self.running) + len(self.slot_promised) >= self.max_num_seqs
            ):
                short = True
                skipped.append(self.waiting.pop())  # the free slots are promised to others
                continue
            if (
                request.lora_id
                and request.lora_id not in running_loras
                and len(running_loras) >= self.max_loras
            ):
                short = True
                skipped.append(self.waiting.pop())  # every adapter slot is taken
                continue
            group = request.group
            limit = budget
            if held(request):
                limit = min(budget, self.group_token_cap - group_tokens.get(group, 0))
                if group_running.get(group, 0) >= self.group_seq_cap or limit <= 0:
                    skipped.append(self.waiting.pop())  # its share is taken: others first
                    continue
            computed_blocks: list[KVBlock] = []
            host_hits: list[HostBlock] = []
            num_hit = 0
            if request.num_computed_tokens == 0:
                computed_blocks, num_hit = self.kv.get_computed_blocks(request)
                host_hits = self.kv.get_host_hits(request, len(computed_blocks))
                num_hit += len(host_hits) * self.block_size
                lend = _lend_blocks(request)
                if lend and len(computed_blocks) + len(host_hits) < lend:
                    # The blocks the lend names left this engine's cache (evicted, or
                    # never held): refuse it rather than compute them.
                    self.waiting.pop()
                    self._refuse_lend(request, len(computed_blocks) + len(host_hits), lend)
                    continue
            if (
                self.connector is not None
                and request.kv_transfer_params
                and request.num_computed_tokens == 0
            ):
                num_external, _ = self.connector.get_num_new_matched_tokens(request, num_hit)
                if num_external > 0:
                    # Allocate blocks for the remote tokens and for the rest of the
                    # prompt, then wait for the load off the batch. With room for the
                    # loaded tokens only, requests that loaded could fill the pool
                    # and none could compute its tail: nothing would run to free it.
                    rest = max(0, request.num_tokens - num_hit - num_external)
                    allocated = None
                    if not need_slot:
                        allocated = self.kv.allocate_slots(
                            request,
                            num_external + rest,
                            computed_blocks,
                            publish=False,
                            host_hits=host_hits,
                        )
                    if allocated is None:
                        # As for a request computed here (below).
                        shortfall = self.kv.shortfall(
                            request, num_external + rest, computed_blocks, len(host_hits)
                        )
                        short = True
                        room = self._make_room(
                            request, num_scheduled, holders, need_slot, shortfall, computed_blocks
                        )
                        if room == "stop":
                            break
                        if room == "skip":
                            holders_only = True
                            skipped.append(self.waiting.pop())
                        continue
                    self.waiting.pop()
                    self.kv.record_lookup(request, num_hit)
                    request.num_computed_tokens = num_hit
                    request.num_external_computed_tokens = num_external  # once loaded
                    request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                    self.slot_promised.discard(request.request_id)
                    self.connector.update_state_after_alloc(
                        request, self.kv.block_ids(request.request_id), num_external
                    )
                    skipped.append(request)
                    continue
            remaining = request.num_tokens - request.num_computed_tokens - num_hit
            if not self.chunked_prefill and remaining > limit:
                if limit < budget:  # over its group's share only: the others may fit
                    skipped.append(self.waiting.pop())
                    continue
                break  # without chunking the whole prompt must fit one step
            num_new = self._cap(remaining, limit)
            allocated = None
            if not need_slot:
                allocated = self.kv.allocate_slots(
                    request, num_new, computed_blocks, host_hits=host_hits
                )
            if allocated is None:
                shortfall = self.kv.shortfall(request, num_new, computed_blocks, len(host_hits))
                short = True
                room = self._make_room(
                    request, num_scheduled, holders, need_slot, shortfall, computed_blocks
                )
                if room == "stop":
                    break
                if room == "skip":
                    holders_only = True
                    skipped.append(self.waiting.pop())
                # Preempted: look at the head again (its cache hits are read anew:
                # the victims' blocks are free now).
                continue
            self.waiting.pop()
            if computed_blocks or host_hits or request.num_computed_tokens == 0:
                self.kv.record_lookup(request, num_hit)
            request.num_computed_tokens += num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit + request.num_external_computed_tokens
            request.status = RequestStatus.RUNNING
            if request.scheduled_time is None:
                request.scheduled_time = now
            self.running.append(request)
            if request.lora_id:
                running_loras.add(request.lora_id)
            self.slot_promised.discard(request.request_id)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
            group_running[group] = group_running.get(group, 0) + 1
            group_tokens[group] = group_tokens.get(group, 0) + num_new
            new_reqs.append(
                NewRequestData(
                    request.request_id,
                    list(request.prompt_token_ids),
                    list(request.output_token_ids),
                    request.sampling_params,
                    self.kv.block_ids(request.request_id),
                    request.num_computed_tokens,
                    request.lora_name,
                    request.lora_path,
                    request.lora_id,
                )
            )
        self.waiting.prepend_all(skipped)
        # Read before this step's tokens are credited: a leader whose whole
        # prompt is scheduled now still holds its siblings back in this step.
        self.waiting_for_room = {
            r.request_id for r in self.waiting.unordered() if not self._waits_on_admitted(r)
        }
        self.short_of_room = short or preempted

        # The scheduled tokens will be computed by this step's forward pass.
        self.last_step_prompt_tokens = 0
        for rid, n in num_scheduled.items():
            request = self.requests[rid]
            start = request.num_computed_tokens
            self.last_step_prompt_tokens += max(
                0, min(start + n, request.num_prompt_tokens) - start
            )
            request.num_computed_tokens += n
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=self.finished_req_ids,
        )
        self.finished_req_ids = set()
        out.kv_offload = self.kv.take_offload_ops()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    # -- results ------------------------------------------------------------------

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        now = time.monotonic()
        if runner_out.offload_stores_done:
            self.kv.stores_done(runner_out.offload_stores_done)
        for rid in sched_out.num_scheduled_tokens:
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            failure = runner_out.failed_requests.get(rid)
            if failure is not None:
                outputs.append(self._fail_running(request, failure))
                continue
            token = runner_out.sampled_token_ids.get(rid)
            if token is None:
                continue  # a partial prefill chunk: nothing sampled yet
            request.append_output_token(token)
            extend_block_hashes(
                request.block_hashes,
                request.all_token_ids,
                self.block_size,
                self.kv.hash_fn,
                root_hash(request.sampling_params.cache_salt, request.lora_identity),
            )
            if request.first_token_time is None:
                request.first_token_time = now
            stopped = request.check_stop(self.max_model_len)
            out = EngineCoreOutput(
                rid,
                [token],
                runner_out.logprobs.get(rid),
                prompt_logprobs=runner_out.prompt_logprobs.get(rid),
                num_cached_tokens=max(request.num_cached_tokens, 0),
                scheduled_time=request.scheduled_time,
            )
            if stopped:
                self.running.remove(request)
                out.finish_reason = request.status.finish_reason
                out.stop_reason = request.stop_reason
                out.kv_transfer_params = self._free_request(request)
            outputs.append(out)
        outputs.extend(self._update_kv_transfers(runner_out))
        outputs.extend(self.take_ready())
        return outputs

    def _update_kv_transfers(self, runner_out: ModelRunnerOutput) -> list[EngineCoreOutput]:
        errors: list[EngineCoreOutput] = []
        for rid in runner_out.finished_sending:
            blocks = self.held_blocks.pop(rid, None)
            if blocks is not None:
                self.kv.free_blocks(blocks)
        for rid in runner_out.finished_recving | runner_out.failed_recving:
            request = self.requests.get(rid)
            if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            # The params are consumed: a later preemption recomputes locally. A
            # prefill leg that pulled first (done or failed) is a prefill leg now.
            p = request.kv_transfer_params
            request.kv_transfer_params = None if p is None else p.after_load()
            if rid in runner_out.failed_recving:
                if self.connector is not None and self.connector.pull_in_flight(request):
                    self._quarantine(request)
                message = self.connector.load_failed(request) if self.connector else None
                if message is not None:
                    request.status = RequestStatus.FINISHED_ERROR
                    request.stop_reason = message
                    self._free_request(request)
                    errors.append(
                        EngineCoreOutput(rid, [], finish_reason="error", stop_reason=message)
                    )
                    continue
                # Recompute locally: drop the blocks that were meant for remote KV.
                self.kv.free(request)
                request.num_computed_tokens = 0
                request.num_external_computed_tokens = 0
                request.num_cached_tokens = -1
            else:
                loaded = self._loaded_tokens(request)
                request.num_external_computed_tokens = loaded - request.num_computed_tokens
                request.num_computed_tokens = loaded
                # Its cached tokens, as reported in usage: its own prefix hits and
                # what it loaded (as vLLM counts a connector's tokens).
                request.num_cached_tokens = loaded
                self.kv.cache_full_blocks(request, loaded)
            request.status = RequestStatus.WAITING
        return errors

    def _waiting_pulls(self) -> tuple[list[int], set[str]]:
        """One pass over the waiting queue (none without a connector: no request
        lends or pulls): the tokens each waiting lend computes, smallest first,
        and the waiting requests that hold blocks (pulls whose KV landed; a
        preempted request holds none)."""
        if self.connector is None:
            return [], set()
        lends: list[int] = []
        holders: set[str] = set()
        for r in self.waiting.unordered():
            if _lend_blocks(r) and r.num_computed_tokens == 0:
                lends.append(max(1, r.num_tokens - _lend_blocks(r) * self.block_size))
            elif r.status == RequestStatus.WAITING and self.kv.num_request_blocks(r.request_id):
                holders.add(r.request_id)
        return sorted(lends), holders

    def _make_room(
        self,
        request: Request,
        scheduled: dict[str, int],
        holders: set[str],
        need_slot: bool,
        shortfall: int,
        computed: list[KVBlock],
    ) -> str:
        """A waiting request found no free slot (``need_slot``) or ``shortfall``
        blocks too few (its prefix hits are ``computed``). ``"preempted"``: running
        requests of worse bands gave their slots and KV up, enough for it (those
        bands sit this step out for this one); ``"skip"``: nothing can be
        preempted for it, but landed pulls wait behind it (``holders``): they need
        few or no new blocks and free theirs when they finish, so they go past it,
        where waiting behind it would stall the engine (nothing running frees a
        block); ``"stop"``: nothing joins past it this step (nor past a request
        that waits for a slot)."""
        victims = self._band_victims(request, scheduled, shortfall, computed)
        for victim in victims:
            self._preempt(victim)
        if victims:
            return "preempted"
        if need_slot:
            return "stop"
        return "skip" if holders - {request.request_id} else "stop"

    def _loaded_tokens(self, request: Request) -> int:
        """The tokens a request has once its remote load landed: its own hits and
        the whole blocks loaded (its blocks for the rest of the prompt are not
        loaded); the last prompt token is always computed here."""
        loaded = request.num_computed_tokens + request.num_external_computed_tokens
        return min(loaded, request.num_tokens - 1)

    def take_kv_events(self) -> list[KVCacheEvent]:
        return self.kv.take_events()

    def _waiting_for_slot(self, waiting: list[Request]) -> int:
        """Of the requests the last step left ``waiting`` for room, those beyond
        what the engine holds (``SchedulerStats.num_waiting_for_slot_reqs``):
        every one when the step was short of room. Else, of the groups (client
        requests) with nothing running, one request each beyond those the next
        :data:`PIPELINE_STEPS` steps' token budgets start (fewest tokens first:
        a queue of long prompts behind the budget is a queue, short ones the
        next steps start are not); and every group's further sequences, held
        back by its share or the budget, beyond the free slots left (one
        request's sequences started over a few steps are not a queue)."""
        pending = [r for r in waiting if r.status != RequestStatus.WAITING_FOR_REMOTE_KVS]
        if self.short_of_room:
            return len(pending)
        running = {r.group for r in self.running}
        heads: dict[str, int] = {}
        for r in pending:
            if r.group not in running:
                left = r.num_tokens - r.num_computed_tokens
                heads[r.group] = min(left, heads.get(r.group, left))
        free = max(0, self.max_num_seqs - len(self.running))
        # A new request starts only in a free slot, whatever its prompt: of the
        # shortest ``free`` ones, those the budgets start, less what the
        # running requests take of them (a long prompt's chunks, or a token).
        budget = PIPELINE_STEPS * self.max_num_batched_tokens
        for r in self.running:
            budget -= max(PIPELINE_STEPS, r.num_prompt_tokens - r.num_computed_tokens)
        started = 0
        for left in heapq.nsmallest(free, heads.values()):
            budget -= left
            if budget < 0:
                break
            started += 1
        siblings = len(pending) - len(heads)
        return len(heads) - started + max(0, siblings - max(0, free - len(heads)))

    def stats(self) -> SchedulerStats:
        waiting = [r for r in self.waiting.unordered() if r.request_id in self.waiting_for_room]
        waiting_prompt = sum(
            r.num_tokens - r.num_computed_tokens
            for r in self.requests.values()
            if r.status != RequestStatus.RUNNING
        )
        host = self.kv.host_stats()
        return SchedulerStats(
            host_kv_num_blocks=host.num_blocks,
            host_kv_used_blocks=host.used_blocks,
            host_kv_hit_tokens=self.kv.stats.host_hits,
            host_kv_stored_blocks=host.stored_blocks,
            host_kv_loaded_blocks=host.loaded_blocks,
            host_kv_evicted_blocks=host.evicted_blocks,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(waiting),
            num_waiting_for_slot_reqs=self._waiting_for_slot(waiting),
            num_queued_reqs=len(self.requests) - len(self.running),
            kv_cache_usage=self.kv.usage,
            num_free_blocks=self.kv.num_free_blocks,
            num_total_blocks=self.kv.num_usable_blocks,
            prefix_cache_queries=self.kv.stats.queries,
            prefix_cache_hits=self.kv.stats.hits,
            num_preemptions=self.num_preemptions,
            waiting_prompt_tokens=waiting_prompt,
            num_held_blocks_reqs=sum(1 for k in self.held_blocks if not k.startswith(QUARANTINE)),
            running_lora_adapters=tuple(
                sorted({r.lora_name for r in self.running if r.lora_name is not None})
            ),
            waiting_lora_adapters=tuple(
                sorted(
                    {
                        r.lora_name
                        for r in self.requests.values()
                        if r.lora_name is not None and r.status != RequestStatus.RUNNING
                    }
                )
            ),
        )
