"""The strategies ``pdfleet sim`` compares.

``pdfleet`` runs the policy unchanged; ``fixed`` holds a constant count (peak
provisioning); ``hpa`` applies Kubernetes HPA rules to one metric per role;
``oracle`` knows the trace and provisions each period, one cold start ahead,
what the coming load needs.
"""

from __future__ import annotations

import math
from collections import Counter

from pdfleet.operator.autoscaling.policy import (
    FleetObservation,
    PolicyState,
    PolicyTuning,
    RoleObservation,
    decide,
)
from pdfleet.operator.autoscaling.samples import ReplicaSample
from pdfleet.operator.autoscaling.spec import AutoscalingSpec, RoleScaling

from .sim_fleet import FleetModel
from .traces import Trace

# The baselines' sizing targets: the oracle and fixed peak size prefill at
# this utilization and decode at this KV usage; HPA's prefill utilization
# target. Deliberately not the policy's tuning: tuning the policy must not
# move the references.
BASELINE_PREFILL_UTILIZATION = 0.8
ORACLE_KV_CACHE_USAGE = 0.7


class PolicyStrategy:
    """The pdfleet policy, unchanged."""

    name = "pdfleet"

    def __init__(self, spec: AutoscalingSpec, tuning: PolicyTuning | None = None) -> None:
        self.spec = spec
        self.tuning = tuning or PolicyTuning()
        self.state: PolicyState | None = None
        self.codes: Counter[str] = Counter()
        self.reasons: list[str] = []

    def decide(self, now: float, observation: FleetObservation) -> tuple[int, int]:
        result = decide(self.spec, observation, now, self.state, self.tuning)
        self.state = result.state
        for d in result.decisions:
            self.codes[f"{d.role}:{d.direction}:{d.code}"] += 1
            if d.direction != "none" and len(self.reasons) < 1000:
                self.reasons.append(f"t={now:.0f} {d.reason}")
        return result.prefill.desired, result.decode.desired


class FixedStrategy:
    """Fixed replicas (peak provisioning)."""

    name = "fixed"

    def __init__(self, prefill: int, decode: int) -> None:
        self.replicas = (prefill, decode)

    def decide(self, now: float, observation: FleetObservation) -> tuple[int, int]:
        return self.replicas


class HPAStrategy:
    """Kubernetes HPA rules on one metric per role.

    ``desired = ceil(current * metric / target)`` over ready replicas with
    metrics (that is ``ceil(sum(metric) / target)``), kept when within 10% of
    the target; scale-up at most max(+4, x2) per period; scale-down to the
    highest recommendation of a 300 s window, at once. A ready replica with
    missing metrics counts as at the target when scaling down and as idle
    when scaling up (HPA's treatment). Prefill's metric is its busy fraction
    (``utilization``, target :data:`BASELINE_PREFILL_UTILIZATION`) or its
    waiting requests (``waiting``, target ``targetWaitingPerReplica``);
    decode's is its KV-cache usage (target ``targetKVCacheUsage``).
    """

    name = "hpa"
    TOLERANCE = 0.1
    DOWN_WINDOW_SECONDS = 300.0

    def __init__(self, spec: AutoscalingSpec, prefill_metric: str = "utilization") -> None:
        if prefill_metric not in ("utilization", "waiting"):
            raise ValueError(
                f"HPA prefill metric must be utilization or waiting, got {prefill_metric!r}"
            )
        self.spec = spec
        self.prefill_metric = prefill_metric
        self.history: dict[str, list[tuple[float, int]]] = {"prefill": [], "decode": []}

    def _metric(self, role: str, sample: ReplicaSample) -> float | None:
        if role == "decode":
            return sample.kv_cache_usage
        if self.prefill_metric == "waiting":
            return sample.num_waiting
        return sample.prefill_busy_fraction

    def _role(self, role: str, obs: RoleObservation, now: float) -> int:
        bounds: RoleScaling = self.spec.prefill if role == "prefill" else self.spec.decode
        if role == "decode":
            target = self.spec.decode.target_kv_cache_usage
        elif self.prefill_metric == "waiting":
            target = bounds.target_waiting_per_replica
        else:
            target = BASELINE_PREFILL_UTILIZATION
        live = [r for r in obs.replicas if r.state != "draining"]
        current = obs.requested if obs.requested is not None else len(live)
        ready = [r for r in live if r.state == "ready"]
        values, missing = [], 0
        for r in ready:
            value = None
            if r.time is not None and now - r.time <= self.spec.metrics_stale_seconds:
                value = self._metric(role, r)
            if value is None:
                missing += 1
            else:
                values.append(value)
        if not values:
            rec = current
        else:
            total = sum(values)
            up = math.ceil(total / target - 1e-9)
            if up <= current:  # a scale-down: missing replicas count as at the target
                total += missing * target
            ratio = total / (target * max(len(values) + missing, 1))
            if abs(ratio - 1) <= self.TOLERANCE:
                rec = current
            else:
                rec = math.ceil(total / target - 1e-9)
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
        return self._role("prefill", observation.prefill, now), self._role(
            "decode", observation.decode, now
        )


class OracleStrategy:
    """Knows the trace: at each period it provisions, per role, the most
    replicas the load needs between now and one cold start plus one period
    ahead (so replicas are ready when the load arrives), at the same targets
    as the policy (prefill utilization, decode KV usage)."""

    name = "oracle"

    def __init__(self, needs: tuple[list[int], list[int]], period: float, lookahead: float) -> None:
        self.needs = needs
        self.period = period
        self.lookahead = lookahead

    def at(self, now: float) -> tuple[int, int]:
        first = int(now // self.period)
        last = int((now + self.lookahead) // self.period)
        out = []
        for need in self.needs:
            window = need[first : last + 1] or need[-1:]
            out.append(max(window))
        return out[0], out[1]

    def decide(self, now: float, observation: FleetObservation) -> tuple[int, int]:
        return self.at(now)


def replica_needs(
    trace: Trace, model: FleetModel, spec: AutoscalingSpec
) -> tuple[list[int], list[int]]:
    """Replicas each role needs per period bin, from the trace itself.

    Prefill: the bin's prefill work (overhead + prompt / tokens per second)
    over the bin's length and :data:`BASELINE_PREFILL_UTILIZATION`. Decode: the
    bin's mean KV occupancy (each request holding prompt + output/2 tokens for
    output x the step time at that usage) over capacity x
    :data:`ORACLE_KV_CACHE_USAGE`, or its mean batch over ``max_num_seqs`` if
    larger. Clamped to the spec's min/max.
    """
    period = spec.period_seconds
    bins = int(trace.config.duration_seconds // period) + 2
    work = [0.0] * bins
    kv = [0.0] * bins
    seqs = [0.0] * bins
    n = len(trace)
    mean_kv = (
        sum(p + o / 2 for p, o in zip(trace.prompt_tokens, trace.output_tokens, strict=True)) / n
        if n
        else 1.0
    )
    context = ORACLE_KV_CACHE_USAGE * model.kv_capacity_tokens
    batch = min(context / mean_kv, model.max_num_seqs)
    step = model.step_seconds(batch, context)
    for arrival, prompt, output in zip(
        trace.arrivals, trace.prompt_tokens, trace.output_tokens, strict=True
    ):
        prefill = model.prefill_overhead_seconds + prompt / model.prefill_tokens_per_second
        work[min(int(arrival // period), bins - 1)] += prefill
        start = arrival + prefill + prompt * model.transfer_seconds_per_token
        end = start + output * step
        tokens = prompt + output / 2
        b = int(start // period)
        while b < bins and b * period < end:
            overlap = min(end, (b + 1) * period) - max(start, b * period)
            kv[b] += tokens * overlap
            seqs[b] += overlap
            b += 1
    p_need, d_need = [], []
    for b in range(bins):
        p = math.ceil(work[b] / period / BASELINE_PREFILL_UTILIZATION - 1e-9)
        d = max(
            math.ceil(kv[b] / period / context - 1e-9),
            math.ceil(seqs[b] / period / model.max_num_seqs - 1e-9),
        )
        p_need.append(min(max(p, spec.prefill.min_replicas), spec.prefill.max_replicas))
        d_need.append(min(max(d, spec.decode.min_replicas), spec.decode.max_replicas))
    return p_need, d_need
