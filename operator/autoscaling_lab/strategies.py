"""The strategies ``pdfleet sim`` compares, and the sizing they share.

* ``pdfleet``: the runtime policy, unchanged (:class:`.sim.PolicyStrategy`).
* ``hpa``: Kubernetes' HPA algorithm on one metric per role
  (:class:`HPAStrategy`), at the targets a user would start from, or at
  targets tuned per trace (the matrix's ``hpa_tuned``).
* ``oracle``: knows the trace and provisions each period, one cold start
  ahead, what the coming load needs at a :class:`Sizing` (:class:`OracleStrategy`).
* ``fixed``: a constant count (:class:`FixedStrategy`).
* a schedule: counts per period, played as given (:class:`ScheduleStrategy`;
  the perfect-foresight reference of :mod:`.bstar`).

:func:`replica_needs` turns a trace into the replicas each role needs per
period at a sizing; it is exact arithmetic over the trace (numpy), not a
simulation.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..autoscaling.policy import FleetObservation, RoleObservation
from ..autoscaling.samples import ReplicaSample
from ..autoscaling.spec import AutoscalingSpec, RoleScaling
from .sim_fleet import FleetModel
from .traces import Trace


@dataclass(frozen=True)
class Sizing:
    """How hot a schedule runs each role: prefill at this share of its
    compute (prefill seconds of the period's arrivals over the period), decode
    at this share of its KV capacity (the period's mean KV occupancy)."""

    prefill_utilization: float = 0.8
    decode_kv_usage: float = 0.7

    def __post_init__(self) -> None:
        for name in ("prefill_utilization", "decode_kv_usage"):
            value = getattr(self, name)
            if not 0 < value <= 1.5:
                raise ValueError(f"{name} must be in (0, 1.5], got {value}")


# The sizing the oracle, fixed peak and untuned HPA use: the usual starting
# points (prefill at 80% of its compute, decode at 70% of its KV).
DEFAULT_SIZING = Sizing()


class FixedStrategy:
    """Fixed replicas (peak provisioning)."""

    name = "fixed"

    def __init__(self, prefill: int, decode: int) -> None:
        self.replicas = (prefill, decode)

    def decide(self, now: float, observation: FleetObservation) -> tuple[int, int]:
        return self.replicas


@dataclass(frozen=True)
class HPATargets:
    """The HPA's target per role: prefill's busy fraction (the compute
    utilization of its engines) and decode's KV-cache usage."""

    prefill_utilization: float = 0.8
    decode_kv_usage: float = 0.7

    def to_dict(self) -> dict[str, float]:
        return {
            "prefill_utilization": self.prefill_utilization,
            "decode_kv_usage": self.decode_kv_usage,
        }


class HPAStrategy:
    """Kubernetes' HPA algorithm on one metric per role.

    ``desired = ceil(current x metric / target)``, where ``current x
    metric`` is the metric summed over the ready replicas with metrics
    (HPA's average times their count; replicas still starting count as 0,
    as HPA counts unready pods on a scale-up); kept while within 10% of the
    target (``|metric / target - 1| <= 0.1``); up at most max(+4, x2) per
    period (HPA's default scale-up policies), down to the highest
    recommendation of a 300 s window, at once (its default scale-down). A
    ready replica with missing metrics counts as at the target when scaling
    down and as idle when scaling up. Prefill's metric is its busy fraction,
    decode's its KV-cache usage (:class:`HPATargets`). The spec's bounds
    apply; its steps and windows are the policy's, not HPA's.
    """

    name = "hpa"
    TOLERANCE = 0.1
    DOWN_WINDOW_SECONDS = 300.0

    def __init__(self, spec: AutoscalingSpec, targets: HPATargets | None = None) -> None:
        self.spec = spec
        self.targets = targets or HPATargets()
        self.history: dict[str, list[tuple[float, int]]] = {"prefill": [], "decode": []}

    def _role(self, role: str, obs: RoleObservation, now: float) -> int:
        bounds: RoleScaling = self.spec.role(role)
        target = (
            self.targets.decode_kv_usage if role == "decode" else self.targets.prefill_utilization
        )
        live = [r for r in obs.replicas if r.state != "draining"]
        current = obs.requested if obs.requested is not None else len(live)
        values, missing = [], 0
        for r in live:
            if r.state != "ready":
                continue
            value = None
            if r.time is not None and now - r.time <= self.spec.metrics_stale_seconds:
                value = _metric(role, r)
            if value is None:
                missing += 1
            else:
                values.append(value)
        if not values:
            rec = current
        else:
            total = sum(values)
            if math.ceil(total / target - 1e-9) <= current:
                total += missing * target  # a scale-down: missing ones at the target
            ratio = total / (target * max(len(values) + missing, 1))
            rec = current if abs(ratio - 1) <= self.TOLERANCE else math.ceil(total / target - 1e-9)
        rec = min(max(rec, bounds.min_replicas), bounds.max_replicas)
        history = [(t, n) for t, n in self.history[role] if now - t < self.DOWN_WINDOW_SECONDS]
        history.append((now, rec))
        self.history[role] = history
        desired = rec
        if rec < current:
            desired = min(current, max(n for _, n in history))
        elif rec > current:
            desired = min(rec, max(2 * current, current + 4))
        return min(max(desired, bounds.min_replicas), bounds.max_replicas)

    def decide(self, now: float, observation: FleetObservation) -> tuple[int, int]:
        return (
            self._role("prefill", observation.prefill, now),
            self._role("decode", observation.decode, now),
        )


def _metric(role: str, sample: ReplicaSample) -> float | None:
    return sample.kv_cache_usage if role == "decode" else sample.prefill_busy_fraction


class OracleStrategy:
    """Knows the trace: at each period it provisions, per role, the most
    replicas the load needs between now and one cold start plus one period
    ahead (so replicas are ready when the load arrives), at a sizing."""

    name = "oracle"

    def __init__(self, needs: tuple[Sequence[int], Sequence[int]], period: float, lookahead: float):
        self.needs = needs
        self.period = period
        self.lookahead = lookahead

    def at(self, now: float) -> tuple[int, int]:
        first = int(now // self.period)
        last = int((now + self.lookahead) // self.period)
        out = []
        for need in self.needs:
            window = need[first : last + 1] or need[-1:]
            out.append(int(max(window)))
        return out[0], out[1]

    def decide(self, now: float, observation: FleetObservation) -> tuple[int, int]:
        return self.at(now)


class ScheduleStrategy:
    """Counts per period, played as given: at the decision of time ``t``
    the counts of period ``t // period``."""

    def __init__(
        self, prefill: Sequence[int], decode: Sequence[int], period: float, name: str = "bstar"
    ) -> None:
        if len(prefill) != len(decode) or not prefill:
            raise ValueError("a schedule needs as many prefill as decode counts, at least one")
        self.name = name
        self.counts = (list(prefill), list(decode))
        self.period = period

    def at(self, now: float) -> tuple[int, int]:
        i = min(round(now / self.period), len(self.counts[0]) - 1)
        return self.counts[0][i], self.counts[1][i]

    def decide(self, now: float, observation: FleetObservation) -> tuple[int, int]:
        return self.at(now)


@dataclass(frozen=True)
class TraceLoad:
    """What a trace asks of each role per period, independent of the sizing:
    prefill compute seconds and the decode requests' spans, for
    :func:`replica_needs` (computed once per trace)."""

    period: float
    bins: int
    prefill_seconds: np.ndarray
    """Prefill compute seconds of the requests arriving in each period."""
    decode_start: np.ndarray
    """Per request: when it reaches decode (arrival + prefill + transfer)."""
    output: np.ndarray
    kv_tokens: np.ndarray
    """Per request: the KV it holds on average over its decode (prompt plus
    half its output)."""
    mean_kv: float


def trace_load(trace: Trace, model: FleetModel, period: float) -> TraceLoad:
    arrivals = np.asarray(trace.arrivals, dtype=float)
    prompts = np.asarray(trace.prompt_tokens, dtype=float)
    outputs = np.asarray(trace.output_tokens, dtype=float)
    bins = int(trace.config.duration_seconds // period) + 2
    prefill = (
        model.prefill_overhead_seconds
        + prompts / model.prefill_tokens_per_second
        + model.prefill_seconds_per_token_squared * prompts * prompts
    )
    index = np.minimum((arrivals // period).astype(int), bins - 1)
    work = np.bincount(index, weights=prefill, minlength=bins) if len(arrivals) else np.zeros(bins)
    start = arrivals + prefill + prompts * model.transfer_seconds_per_token
    kv = prompts + outputs / 2
    return TraceLoad(
        period,
        bins,
        work,
        start,
        outputs,
        kv,
        float(kv.mean()) if len(kv) else 1.0,
    )


def _occupancy(start: np.ndarray, end: np.ndarray, weight: np.ndarray, edges: np.ndarray):  # type: ignore[no-untyped-def]
    """Per bin between consecutive ``edges``: the integral over time of the
    summed weight of the intervals [start, end) alive then. Exact: the
    integral up to t is sum over started intervals of w (t - s) less the
    same over ended ones, from sorted cumulative sums."""

    def upto(points: np.ndarray) -> np.ndarray:
        order = np.argsort(points)
        p, w = points[order], weight[order]
        cw = np.concatenate(([0.0], np.cumsum(w)))
        cwp = np.concatenate(([0.0], np.cumsum(w * p)))
        k = np.searchsorted(p, edges, side="left")
        return edges * cw[k] - cwp[k]

    total = upto(start) - upto(end)
    return np.diff(total)


def replica_needs(
    load: TraceLoad, model: FleetModel, spec: AutoscalingSpec, sizing: Sizing
) -> tuple[list[int], list[int]]:
    """Replicas each role needs per period at ``sizing``, clamped to the
    spec's min/max.

    Prefill: the period's prefill seconds over its length times the
    utilization. Decode: the period's mean KV occupancy (each request
    holding prompt + output/2 tokens for output x the step time at that KV
    usage) over capacity x the usage, or its mean batch over
    ``max_num_seqs`` if larger.
    """
    period, bins = load.period, load.bins
    p = np.ceil(load.prefill_seconds / period / sizing.prefill_utilization - 1e-9)
    context = sizing.decode_kv_usage * model.kv_capacity_tokens
    batch = min(context / load.mean_kv, model.max_num_seqs)
    step = model.step_seconds(batch, context)
    end = load.decode_start + load.output * step
    edges = np.arange(bins + 1, dtype=float) * period
    kv = _occupancy(load.decode_start, end, load.kv_tokens, edges)
    seqs = _occupancy(load.decode_start, end, np.ones_like(load.kv_tokens), edges)
    d = np.maximum(
        np.ceil(kv / period / context - 1e-9), np.ceil(seqs / period / model.max_num_seqs - 1e-9)
    )
    p_need = np.clip(p, spec.prefill.min_replicas, spec.prefill.max_replicas).astype(int)
    d_need = np.clip(d, spec.decode.min_replicas, spec.decode.max_replicas).astype(int)
    return p_need.tolist(), d_need.tolist()
