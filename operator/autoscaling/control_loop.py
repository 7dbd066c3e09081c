"""One autoscaling period of one fleet: observe -> decide -> choose victims.

Both actuators are thin adapters around :class:`ScalingLoop`: the operator's
(:mod:`pdfleet.operator.cluster_autoscaler`, engine pods of Deployments) and
``pdfleet up``'s (:mod:`pdfleet.operator.local.process_autoscaler`, local
engine processes). An adapter scrapes its replicas into
:class:`ReplicaScrape` records, calls :meth:`ScalingLoop.step`, and carries out
the :class:`ScaleAction` records it returns (start replicas, or drain the named
victims). The loop keeps what one period needs from the last: the policy's
state and each replica's latest snapshot, so rates are counter differences
between two successful scrapes. In-flight work, which decides the victims, is
counted one way for both: running + waiting requests + KV leases held.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ...engine.contracts import metrics as m
from .policy import (
    FleetObservation,
    PolicyResult,
    PolicyState,
    Role,
    RoleObservation,
    choose_victims,
    decide,
)
from .samples import EngineSnapshot, ReplicaSample, ReplicaState, sample_from_snapshots
from .spec import AutoscalingSpec
from .victims import ReplicaLoad

ROLES: tuple[Role, Role] = ("prefill", "decode")


@dataclass(frozen=True)
class ReplicaScrape:
    """One replica as an actuator saw it this period."""

    name: str
    role: Role
    state: ReplicaState = "ready"
    snapshot: EngineSnapshot | None = None
    """Its metrics now; None when not scraped (starting) or the scrape failed."""
    startup_seconds: float | None = None
    """Creation to ready, as the platform recorded it (``ReplicaSample.startup_seconds``)."""


@dataclass(frozen=True)
class ScaleAction:
    """Bring ``role`` from ``current`` to ``desired`` replicas, because ``reason``."""

    role: Role
    current: int
    desired: int
    reason: str
    victims: tuple[str, ...] = ()
    """Replicas to remove when scaling down, least loaded first."""


@dataclass(frozen=True)
class LoopStep:
    """What one period decided: the policy's full result (for decision records)
    and the changes to carry out."""

    result: PolicyResult
    actions: tuple[ScaleAction, ...]


def in_flight(snapshot: EngineSnapshot | None) -> int:
    """Requests a replica still owes work to: running, waiting, and (on prefill)
    those whose KV a decode engine has not pulled yet (held leases)."""
    if snapshot is None:
        return 0
    total = (
        (snapshot.num_running or 0.0)
        + (snapshot.num_waiting or 0.0)
        + (snapshot.kv_transfer_held_requests or 0.0)
    )
    return int(total)


def replica_load(scrape: ReplicaScrape) -> ReplicaLoad:
    snap = scrape.snapshot
    return ReplicaLoad(
        name=scrape.name,
        ready=scrape.state != "starting",
        in_flight=in_flight(snap),
        kv_cache_usage=(snap.kv_cache_usage or 0.0) if snap else 0.0,
        waiting_prompt_tokens=(snap.waiting_prompt_tokens or 0.0) if snap else 0.0,
    )


@dataclass
class ScalingLoop:
    """The autoscaling loop of one fleet (one InferenceService)."""

    state: PolicyState = field(default_factory=PolicyState)
    snapshots: dict[str, EngineSnapshot] = field(default_factory=dict)
    """Each replica's latest successful snapshot (the ``previous`` of its next)."""
    starting: dict[str, float] = field(default_factory=dict)
    """Replicas seen starting at the previous step, and when."""

    def observe(
        self, replicas: Sequence[ReplicaScrape], now: float | None = None
    ) -> dict[Role, list[ReplicaSample]]:
        """The policy's samples per role; remembers this period's snapshots.

        A replica first scraped ready after it was seen starting counts from
        zero: its engine's counters started then, and it became ready
        between the two steps (taken as midway), so its first sample already
        has rates (a fleet scaling up every period would otherwise always
        miss its newest replicas' arrivals)."""
        samples: dict[Role, list[ReplicaSample]] = {role: [] for role in ROLES}
        latest: dict[str, EngineSnapshot] = {}
        for r in replicas:
            previous = self.snapshots.get(r.name)
            seen = self.starting.get(r.name)
            if previous is None and r.snapshot is not None and seen is not None:
                previous = EngineSnapshot(
                    time=(seen + r.snapshot.time) / 2,
                    num_running=0.0,
                    num_waiting=0.0,
                    waiting_prompt_tokens=0.0,
                    prompt_tokens_total=0.0,
                    prefill_busy_seconds_total=0.0,
                    ttft_sum=0.0,
                    ttft_count=0.0,
                    itl_sum=0.0,
                    itl_count=0.0,
                )
            samples[r.role].append(
                sample_from_snapshots(r.name, r.snapshot, previous, r.state, r.startup_seconds)
            )
            kept = r.snapshot or previous
            if kept is not None:
                latest[r.name] = kept
        self.snapshots = latest  # replicas gone since drop out
        if now is not None:
            self.starting = {r.name: now for r in replicas if r.state == "starting"}
        return samples

    def step(
        self,
        spec: AutoscalingSpec,
        replicas: Sequence[ReplicaScrape],
        now: float,
        requested: Mapping[str, int] | None = None,
        activations: Mapping[str, float] | None = None,
        batch_running: float = 0.0,
    ) -> LoopStep:
        """Decide one period. ``now`` is on the snapshots' clock; ``requested``
        the replicas each role is set to (a Deployment's ``spec.replicas``),
        when that is not simply the replicas seen; ``activations`` the
        requests the gateways found no replica of a role for since the last
        step (:class:`ActivationCounter`); ``batch_running`` the Batch API
        requests running now (:func:`gateway_batch_running`), deferrable
        demand the decode load leaves out."""
        samples = self.observe(replicas, now)
        requested = requested or {}
        activations = activations or {}
        observation = FleetObservation(
            prefill=RoleObservation(
                tuple(samples["prefill"]),
                requested.get("prefill"),
                activations.get("prefill", 0.0),
            ),
            decode=RoleObservation(
                tuple(samples["decode"]),
                requested.get("decode"),
                activations.get("decode", 0.0),
                deferrable_running=batch_running,
            ),
        )
        result = decide(spec, observation, now, self.state)
        self.state = result.state
        actions = []
        for d in result.decisions:
            if d.desired == d.current:
                continue
            victims: tuple[str, ...] = ()
            if d.desired < d.current:
                candidates = [
                    replica_load(r) for r in replicas if r.role == d.role and r.state != "draining"
                ]
                count = min(d.current - d.desired, len(candidates))
                victims = tuple(choose_victims(candidates, count))
            actions.append(ScaleAction(d.role, d.current, d.desired, d.reason, victims))
        return LoopStep(result, tuple(actions))


def parse_gateway_activations(text: str) -> dict[str, float]:
    """``pdfleet_gateway_activation_requests_total`` per role from one
    gateway's ``/metrics`` text (0 for a role without the series); raises
    ``ValueError`` on text that is not Prometheus exposition format."""
    name = m.GATEWAY_ACTIVATIONS.name
    scrape = m.parse_metrics(text, only=(name,))
    out: dict[str, float] = dict.fromkeys(ROLES, 0.0)
    for labels, value in scrape.samples.get(name, ()):
        role = labels.get(m.ROLE)
        if role in out:
            out[role] += value
    return out


def parse_gateway_batch_running(text: str) -> float:
    """``pdfleet_gateway_batch_requests{state="running"}`` from one gateway's
    ``/metrics`` text (0 without the series); raises ``ValueError`` on text
    that is not Prometheus exposition format."""
    name = m.GATEWAY_BATCH_REQUESTS.name
    scrape = m.parse_metrics(text, only=(name,))
    return sum(
        v
        for labels, v in scrape.samples.get(name, ())
        if labels.get(m.BATCH_STATE) == m.BATCH_RUNNING
    )


def gateway_batch_running(per_gateway: Iterable[float]) -> float:
    """The Batch API requests running in the fleet, from each gateway's gauge:
    the maximum, not the sum (gateway replicas sharing one batch database each
    report the whole database's count; a single store has one gateway)."""
    return max(per_gateway, default=0.0)


@dataclass
class ActivationCounter:
    """Turns the gateways' cumulative activation counters into requests per
    step: the rise since the previous reading, per gateway (a gateway that
    restarted starts again from 0 and counts in full)."""

    last: dict[str, dict[str, float]] = field(default_factory=dict)

    def pending(self, totals: Mapping[str, Mapping[str, float]]) -> set[str]:
        """Roles whose counter rose since the last :meth:`update` (read only)."""
        return {
            role
            for gateway, roles in totals.items()
            for role, value in roles.items()
            if gateway in self.last and value != self.last[gateway].get(role, value)
        }

    def update(self, totals: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
        """``totals``: gateway name -> role -> counter value, for the gateways
        that answered this time; returns role -> requests since last time."""
        rise: dict[str, float] = dict.fromkeys(ROLES, 0.0)
        for gateway, roles in totals.items():
            before = self.last.get(gateway, {})
            for role, value in roles.items():
                if role not in rise:
                    continue
                previous = before.get(role)
                if previous is None:
                    # First reading of this gateway: no baseline, count nothing
                    # (a restarted actuator must not activate on old requests).
                    continue
                rise[role] += value - previous if value >= previous else value
            self.last[gateway] = dict(roles)
        return rise
