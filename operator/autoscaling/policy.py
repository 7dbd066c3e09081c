"""The autoscaling policy: pure functions from samples to desired replicas.

No I/O and no clock: the caller passes ``now`` (seconds, the same clock as the
samples' ``time``) and the :class:`PolicyState` the previous call returned.
One call per period decides both roles::

    result = decide(spec, FleetObservation(prefill=..., decode=...), now, state)
    state = result.state          # keep for the next period
    result.prefill.desired, result.decode.desired, result.prefill.reason

Per role, in order:

1. **Signal** (:mod:`.signals`): the replicas the load needs, from fresh
   samples of ready replicas -- prefill from prompt-token arrivals and its
   backlog against the TTFT target, decode from summed KV-cache usage and
   its queue. A rising load is projected one startup time plus one period
   ahead (the startup time is learned from replicas going from ``starting``
   to ``ready``, and until then from the startups serving replicas report):
   replicas added now serve only then. Replicas still starting
   are part of the current count, so load a cold start is already answering
   starts no more replicas.
2. **Tolerance**: within ``tolerance`` of the current count, keep it. Going
   down, the count is chosen with the tolerance as headroom, so that the
   next noise peak does not push it straight back up.
3. **Stabilization** (as Kubernetes' HPA): scale up to the lowest
   recommendation of the up window, down to the highest of the down window;
   no scale-down in the first down window after the policy starts.
4. **Holds**: no scale-down while a ready replica has missing or stale
   metrics, while replicas are starting, or while prefill's measured TTFT is
   above its target.
5. **Steps** per period, then min/max.

Then across roles: the prefill:decode ratio guardrail (raising the short
side first), then the total replica budget (taking back growth first).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from .samples import ReplicaSample
from .signals import (
    RoleSignal,
    Trend,
    calibrate_prefill_rate,
    decode_signal,
    decode_trend_confirmed,
    fall_confirmed,
    noise,
    pairwise_slope,
    prefill_signal,
    rise_confirmed,
    split_samples,
)
from .spec import AutoscalingSpec, RoleScaling

Role = Literal["prefill", "decode"]
Direction = Literal["up", "down", "none"]

# Machine reason codes (the `reason` label of the decisions counter).
REASON_CODES = (
    "prefill_load",  # prompt-token arrivals (or busy time) against target utilization
    "prefill_backlog",  # queued prefill work beyond the TTFT-derived allowance
    "waiting_queue",  # waiting requests against targetWaitingPerReplica
    "kv_cache",  # decode KV-cache usage (plus its queue) against targetKVCacheUsage
    "within_tolerance",  # recommendation within the tolerance of the current count
    "stabilization_window",  # a lower recommendation not yet stable for the down window
    "metrics_missing",  # a ready replica has missing or stale metrics: no scale-down
    "replicas_starting",  # replicas still starting: no scale-down
    "ttft_above_target",  # prefill TTFT above target: no scale-down
    "flap_damping",  # a recent scale-down was undone: not below that count for a while
    "step_limit",  # change cut to maxScaleUpStep / maxScaleDownStep
    "min_replicas",
    "max_replicas",
    "ratio",  # prefillDecodeRatio guardrail
    "budget",  # maxTotalReplicas
    "no_metrics",  # no fresh sample at all: hold
    "activation",  # at zero replicas, the gateway saw requests for the role: start one
    "scaled_to_zero",  # at zero replicas and nothing wants the role: stay there
    "idle",  # minReplicas 0 and idle for scaleToZeroAfterSeconds: go to zero
    "load_rising",  # decode: prefill's demand is rising, its requests reach decode next
)


@dataclass(frozen=True)
class PolicyTuning:
    """Constants of the policy that are not part of the resource."""

    prefill_target_utilization: float = 0.8
    """Fraction of a prefill replica's measured token throughput the policy
    plans to use; the rest absorbs arrival noise until the next period."""
    backlog_drain_seconds: float = 60.0
    """A queue (prefill work beyond the TTFT allowance; decode requests beyond
    ``targetWaitingPerReplica``) is planned to be gone this many seconds
    after the added replicas serve."""
    tolerance: float = 0.1
    """Relative band around the current count inside which the count is kept."""
    scale_down_headroom: float | None = 0.3
    """Headroom kept when scaling down: the count left serves the load times
    (1 + this). None: the tolerance. 0.3 rather than the tolerance's 0.1:
    fewer scale-downs that the next surge undoes; affordable since prefill
    is sized on its request rate (``prefill_mix_seconds``;
    docs/autoscaling.md, "Sizing prefill on its request rate")."""
    falling_down_headroom: float | None = None
    """The headroom going down while the role's demand falls decisively
    (``signal.falling``, the condition of the falling down window): a load
    that is leaving needs less room for its next noise peak. None: the
    headroom of a steady load."""
    flap_floor_share: float | None = None
    """After a scale-down is undone within its window, the next one below
    that count waits for a load this share below the one that failed. None:
    the tolerance."""
    flap_floor_full_window: bool = True
    """Lift decode's floor only when the spec's whole down window stays
    below it, not the shorter falling window: a run of low snapshots of
    decode's noisy KV usage met the 90 s window and let the next flap
    through. On the target matrix it keeps every seed count and halves the
    steady flaps; on the +30% prefill-rate case it lifts burst TTFT by a
    seed (docs/autoscaling.md, "Telling a steady load from the start of a
    ramp"). False: the down window in force, as before."""
    prefill_flap_floor_full_window: bool = False
    """The same for prefill's floor (measured with decode's: it took a +30%
    prefill-rate seed past 1.25x the oracle)."""
    trend_window_seconds: float = 90.0
    """Demand over this window gives the slope used to project it ahead."""
    default_startup_seconds: float = 60.0
    """Projection horizon until a replica start has been observed."""
    calibration_smoothing: float = 0.3
    """Weight of a new measurement in a running estimate (tokens/s, startup)."""
    falling_down_window_seconds: float | None = 90.0
    """Down window while the role's demand falls decisively (most of its
    recent samples agree on a fall of at least 10%): a surge's replicas go as
    the surge ebbs rather than a whole down window later. None: always the
    spec's window."""
    horizon_factor: float = 1.0
    """The projection looks this many times one startup plus two periods
    ahead (more than 1 starts replicas earlier on a ramp)."""
    recent_peak_seconds: float | None = None
    """Plan for at least the highest demand measured in this many seconds
    (a short-horizon forecast of trend plus recent peak). None: the trend
    alone."""
    fit_decode_level: bool = False
    """Size decode on the robust (Theil-Sen) line through its recent KV
    demand rather than on the latest snapshot alone (:func:`.signals.fitted_level`)."""
    noise_band: float | None = None
    """Widen the tolerance band to this many times the demand's own noise
    (its spread about the recent trend, :func:`.signals.noise`), converted to
    replicas. None: the relative tolerance alone."""
    noise_band_up: bool = True
    """Whether ``noise_band`` also delays scale-ups (False: it only keeps
    scale-downs that the demand's noise would undo)."""
    trend_noise_z: float | None = None
    """Project a rise only when it exceeds this many times the demand's
    noise over the trend window. None: every rise is projected."""
    min_trend_span_seconds: float = 20.0
    """Project a rise only from samples spanning at least this many seconds
    (and :data:`.signals.MIN_TREND_POINTS` of them). At a 2 s period four
    samples span 6 s: a fleet's first seconds, or decode's series just after
    a count change, then showed the first requests filling idle engines as a
    rise, carried a whole startup ahead (docs/autoscaling.md, "The simulator
    against the real fleet"). 0: the point count alone."""
    settle_decode_trend: bool = False
    """Project decode's own trend only once its series at the current count
    spans the trend window (before that, only prefill's growth)."""
    full_down_window_after_up: bool = False
    """Within one spec down window after a scale-up, scale down only on the
    spec's window, never on the shorter falling window: a scale-up is not
    undone by the next dip of a noisy signal. Both roles; decode's own
    default is ``decode_full_down_window_after_up``."""
    decode_full_down_window_after_up: bool = True
    """``full_down_window_after_up`` for decode alone. Its summed KV usage
    falls whenever a few long documents finish: on heavytail seed 6 that
    fall took decode 3 -> 2 on the falling window 120 s after its scale-up,
    the next rise undid it, and the flap floor then held the third replica
    for 1,350 s (1.252x the oracle; 1.194x with this). Prefill keeps the
    falling window after a scale-up: it is what ends a surge's cost."""
    decode_trend_with_arrivals: bool = False
    """Project decode's own KV trend only while prefill's prompt arrivals
    rise too (their lower-quartile pairwise slope is positive,
    :func:`.signals.decode_trend_confirmed`). On a steady request rate the
    summed KV usage is a noisy snapshot whose fitted slope often points up,
    while the arrivals stay flat. Decode still follows prefill's growth, and
    its measured level still scales it up."""
    decode_falls_with_arrivals: bool = False
    """Give decode the shorter falling down window only while prefill's
    prompt arrivals fall decisively, not on a run of low samples of decode's
    own (noisy) KV series."""
    rise_noise_z: float | None = None
    """Decode projects a rise (its own trend or prefill's growth) only while
    prefill's prompt arrivals stand more than this many times the noise of
    one sample (learned over ``rise_noise_window_seconds``) above their
    median of the trend window (:func:`.signals.rise_confirmed`): a steady
    rate keeps decode on its measured level. None: every rise is projected."""
    prefill_rise_noise_z: float | None = None
    """The same test for prefill's own projection. None: every rise."""
    rise_after_down_z: float | None = None
    """Within one down window after a decode scale-down, decode projects a
    rise only while prefill's arrivals stand this many times their noise
    above their level (:func:`.signals.rise_confirmed`); its measured level
    still scales it up. None: no such dwell."""
    fall_noise_z: float | None = None
    """Count prefill's fall as decisive (the shorter falling down window, for
    both roles) only when it is also larger than this many times the
    arrivals' noise over ``rise_noise_window_seconds``
    (:func:`.signals.fall_confirmed`). None: :func:`.signals.falling` alone."""
    rise_noise_window_seconds: float = 600.0
    """The window over which the arrivals' noise is learned for the
    ``*_z`` gates: longer than the trend window, so that the noise is known
    before a ramp starts."""
    rise_recent_seconds: float | None = None
    """Once the trend window shows a rise, project prefill along the steeper
    of the window's slope and that of only the last this many seconds
    (:func:`.signals.project_rise`): a ramp's first minute is then projected
    at its own slope, not at the window's, which still holds the samples
    from before the ramp. None: the window's slope alone."""
    rise_z: float | None = None
    """With ``rise_recent_seconds``: the recent slope counts only where the
    rise it makes over its samples exceeds this many times the window's noise
    (:func:`.signals.noise`). None: any such rise."""
    decode_queue_drain_seconds: float | None = None
    """Decode requests waiting beyond ``targetWaitingPerReplica`` are planned
    to be admitted within this many seconds. None: ``backlog_drain_seconds``."""
    hold_decode_rising_quantile: float | None = None
    """No decode scale-down while this quantile of the pairwise slopes of
    prefill's recent demand is positive (0.25: three quarters of the pairs
    agree on a rise): the requests rising at prefill reach decode a prefill
    later. None: no such hold."""
    decode_down_headroom: float | None = None
    """Decode's own scale-down headroom. None: ``scale_down_headroom``."""
    decode_load_floor: int | None = None
    """Fewest decode replicas the load signals leave (above ``minReplicas``;
    idle scale-to-zero still goes below). One decode replica carries the
    whole base load, so a surge fills it within about a minute, before a
    replica started then serves; two share it with room for a surge's first
    minutes. None: ``minReplicas``."""
    single_decode_headroom: float | None = 1.0
    """Decode's headroom for a scale-down to one replica (1.0: the one left
    must hold twice the load). One replica holds the whole batch, its steps
    lengthen, and on a load it holds at half its target its noise peaks sit
    at the scale-up threshold: going to one there was what made a steady
    load flap. None: the usual headroom."""
    prefill_mix_seconds: float | None = 450.0
    """Size prefill on its request arrival rate times the prompt tokens per
    request of this many seconds, rather than on each period's prompt-token
    arrivals: a surge moves the request rate, while the prompt-length mix
    of a period's ~200 requests only adds noise (a few long documents make
    a period look 30% busier), which the trend then carried a cold start
    ahead. None: each period's token arrivals."""
    prefill_outlier_z: float | None = 2.0
    """Size prefill on at most this many standard deviations above the
    robust line through its request rate over the trend window
    (:func:`.signals.outlier_bound`): one busy period of a steady load (a
    third above its rate on steady seed 6) otherwise set a scale-up that
    the down window undid 270 s later. The deviation counts the Poisson
    noise of the requests measured, so a ramp's steeper period is not
    bounded. None: each period's rate as measured."""
    min_calibration_busy: float = 0.1
    """Least busy prefill time (in replica-periods, summed) that makes a
    tokens/s measurement: an idle fleet measures nothing."""

    def __post_init__(self) -> None:
        if not 0 < self.prefill_target_utilization <= 1:
            raise ValueError("prefill_target_utilization must be in (0, 1]")
        if not 0 <= self.tolerance < 1:
            raise ValueError("tolerance must be in [0, 1)")
        if not 0 < self.calibration_smoothing <= 1:
            raise ValueError("calibration_smoothing must be in (0, 1]")
        if self.min_trend_span_seconds < 0:
            raise ValueError("min_trend_span_seconds must be >= 0")
        for name in ("rise_recent_seconds", "decode_queue_drain_seconds", "prefill_outlier_z"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        q = self.hold_decode_rising_quantile
        if q is not None and not 0 <= q <= 1:
            raise ValueError(f"hold_decode_rising_quantile must be in [0, 1] or None, got {q}")
        if self.decode_load_floor is not None and self.decode_load_floor < 1:
            raise ValueError(
                f"decode_load_floor must be >= 1 or None, got {self.decode_load_floor}"
            )
        for name in (
            "backlog_drain_seconds",
            "trend_window_seconds",
            "default_startup_seconds",
            "rise_noise_window_seconds",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


@dataclass(frozen=True)
class RoleObservation:
    """One role as the actuator sees it now."""

    replicas: Sequence[ReplicaSample] = ()
    """Every replica of the role: starting, ready and draining."""
    requested: int | None = None
    """Replicas the actuator has been asked to run (a Deployment's
    ``spec.replicas``). Requested replicas that are not ready count as
    starting. Default: the listed replicas that are not draining."""
    activations: float = 0.0
    """Requests the gateway found no routable replica of this role for since
    the previous decision (``pdfleet_gateway_activation_requests_total``):
    held (decode) or served decode-only (prefill). At zero replicas, any
    starts one."""


@dataclass(frozen=True)
class FleetObservation:
    prefill: RoleObservation = field(default_factory=RoleObservation)
    decode: RoleObservation = field(default_factory=RoleObservation)


@dataclass(frozen=True)
class RoleState:
    """What one role remembers between periods."""

    since: float | None = None
    """Time of this role's first decision."""
    recommendations: tuple[tuple[float, int, int, float], ...] = ()
    """(time, count to scale up to, count to scale down to, replicas needed)
    within the longest stabilization window."""
    demand: tuple[tuple[float, float], ...] = ()
    """(time, measured demand in replicas) within the trend window."""
    count: int | None = None
    """Requested replicas when this state was made."""
    scaled_down: tuple[float, int, float] | None = None
    """(time, count before, replicas needed then) of the latest scale-down."""
    floor: tuple[int, float] | None = None
    """(count, replicas needed): a scale-down below ``count`` was undone within
    its down window; the next needs the load below what it was then."""
    idle_since: float | None = None
    """Since when the role has had no request arriving, queued or running."""
    scaled_up: float | None = None
    """Time of the latest scale-up."""
    long_demand: tuple[tuple[float, float], ...] = ()
    """(time, measured demand) within ``rise_noise_window_seconds``, kept
    only while one of the arrivals' noise gates (``PolicyTuning.*_z``) is on."""


@dataclass(frozen=True)
class PolicyState:
    prefill: RoleState = field(default_factory=RoleState)
    decode: RoleState = field(default_factory=RoleState)
    prefill_tokens_per_second: float | None = None
    """Calibrated prompt tokens per second of one prefill replica."""
    startup_seconds: float | None = None
    """Observed time from ``starting`` to ``ready``, smoothed; until a start
    has been watched, what the serving replicas report (``startup_watched``)."""
    startup_watched: bool = False
    """Whether ``startup_seconds`` comes from a watched start."""
    prefill_mix: tuple[tuple[float, float, float], ...] = ()
    """(time, prompt tokens, requests) that arrived at prefill per period,
    within ``PolicyTuning.prefill_mix_seconds``."""
    starting_since: tuple[tuple[str, float], ...] = ()
    """(replica, first time seen starting) for replicas not yet ready."""


@dataclass(frozen=True)
class RoleDecision:
    role: Role
    current: int
    """Replicas requested before this decision (ready + starting)."""
    desired: int
    code: str
    """One of :data:`REASON_CODES`: the signal or rule that set ``desired``."""
    reason: str
    """One line for people: what was measured and why this count."""
    time: float

    @property
    def direction(self) -> Direction:
        if self.desired > self.current:
            return "up"
        if self.desired < self.current:
            return "down"
        return "none"


@dataclass(frozen=True)
class PolicyResult:
    prefill: RoleDecision
    decode: RoleDecision
    state: PolicyState

    @property
    def decisions(self) -> tuple[RoleDecision, RoleDecision]:
        return (self.prefill, self.decode)


def _startups(
    observation: FleetObservation,
    state: PolicyState,
    now: float,
    tuning: PolicyTuning,
    period: float,
) -> tuple[float | None, bool, tuple[tuple[str, float], ...]]:
    """Learn how long replicas take from ``starting`` to ``ready``: (the
    estimate, whether it comes from a watched start, replicas starting).

    Watched, a start is first seen a period after it was requested, so the
    time learned is short by about a period (``decide`` adds it back). Until
    one has been watched, the startups that serving replicas report
    (``ReplicaSample.startup_seconds``: those of a fleet started before the
    autoscaler saw it) give the estimate, their low median less that period,
    so that both sources project the same horizon. A Pod whose readiness
    went away and came back reports the time to its latest Ready transition,
    longer than its cold start: the low median of several keeps one such
    report out, and the first watched start replaces the reports."""
    since = dict(state.starting_since)
    replicas = (*observation.prefill.replicas, *observation.decode.replicas)
    estimate, watched = state.startup_seconds, state.startup_watched
    if not watched:
        reported = [
            r.startup_seconds
            for r in replicas
            if r.state != "starting" and r.startup_seconds is not None
        ]
        estimate = max(statistics.median_low(reported) - period, 0.0) if reported else None
    seen: dict[str, float] = {}
    for replica in replicas:
        if replica.state == "starting":
            seen[replica.name] = since.get(replica.name, now)
        elif replica.state == "ready" and replica.name in since:
            took = now - since[replica.name]
            estimate = (
                took
                if estimate is None or not watched
                else (estimate + tuning.calibration_smoothing * (took - estimate))
            )
            watched = True
    return estimate, watched, tuple(sorted(seen.items()))


# ---------------------------------------------------------------------------
# per-role decision


def _role_decision(
    name: Role,
    role: RoleScaling,
    signal: RoleSignal,
    current: int,
    state: RoleState,
    now: float,
    tuning: PolicyTuning,
    trend_window: float,
    ttft_high: str | None = None,
    load_rising: str | None = None,
) -> tuple[RoleDecision, RoleState]:
    since = state.since if state.since is not None else now
    floor = state.floor
    horizon = max(role.scale_up_stabilization_seconds, role.scale_down_stabilization_seconds)
    history = [entry for entry in state.recommendations if now - entry[0] < horizon]
    demand = [(t, v) for t, v in state.demand if now - t < trend_window]
    if name == "decode" and current != state.count:
        # Decode's KV usage depends on its replica count (a batch spread over
        # more replicas runs faster steps, so requests hold KV for less time):
        # a trend across a count change is partly the policy's own doing.
        demand = []
    if signal.demand is not None and signal.complete:
        demand.append((now, signal.demand))
    code, why = signal.code, ""
    if signal.raw is None:
        desired, code, why = current, "no_metrics", "no fresh metrics from any ready replica"
    else:
        raw, tol = signal.raw, tuning.tolerance
        why = f"{raw:.2f} replicas needed"
        band = tol * current
        if tuning.noise_band is not None and signal.demand and signal.demand > 1e-9:
            # The demand's own spread, in replicas: noise that large crosses
            # a relative band at a few replicas every few periods.
            band = max(band, tuning.noise_band * noise(tuple(demand)) * raw / signal.demand)
        if (
            current > 0
            and (raw - current <= band if tuning.noise_band_up else raw <= current * (1 + tol))
            and current - raw <= band
        ):
            up_rec = down_rec = current
            within = f"{tol:.0%}" if band <= tol * current + 1e-9 else f"{band:.2f} (noise)"
            code, why = "within_tolerance", f"{why}, within {within} of {current}"
        else:
            up_rec = math.ceil(raw - 1e-9)
            # Going down, keep headroom: the count left must not be one that
            # the next noise peak pushes straight back up.
            down_rec = _down_count(name, raw, tuning, signal.falling)
        up_rec = min(max(up_rec, role.min_replicas), role.max_replicas)
        down_rec = min(max(down_rec, role.min_replicas), role.max_replicas)
        wanted_down = down_rec
        if not signal.complete:
            # With a replica's sample missing the sums are lower bounds: the
            # window then remembers "at least the current count", so the gap
            # never shortens the down window.
            down_rec = max(down_rec, current)
        history.append((now, up_rec, down_rec, raw))
        up_window = [e[1] for e in history if now - e[0] < role.scale_up_stabilization_seconds]
        down_seconds = role.scale_down_stabilization_seconds
        just_up = (
            (
                tuning.full_down_window_after_up
                or (name == "decode" and tuning.decode_full_down_window_after_up)
            )
            and state.scaled_up is not None
            and now - state.scaled_up < role.scale_down_stabilization_seconds
        )
        if signal.falling and tuning.falling_down_window_seconds is not None and not just_up:
            down_seconds = min(down_seconds, tuning.falling_down_window_seconds)
        down_window = [e for e in history if now - e[0] < down_seconds]
        up = min([*up_window, up_rec])
        down = max(e[2] for e in down_window)
        peak_raw = max(e[3] for e in down_window)
        desired = current
        if current < up:
            desired = up
            if up < up_rec:
                code, why = "stabilization_window", f"{why}; {up} is the up window's lowest"
        elif current > down:
            desired = down
            if now - since < role.scale_down_stabilization_seconds:
                desired = current
                code = "stabilization_window"
                why = f"{why}; no scale-down in the first {role.scale_down_stabilization_seconds:.0f} s"
            elif down > down_rec:
                code, why = "stabilization_window", f"{why}; {down} is the down window's highest"
        elif down_rec < current:
            code, why = "stabilization_window", f"{why}; the down window still holds {down}"
        if desired < current or (wanted_down < current and not signal.complete):
            hold = None
            if signal.missing:
                hold = ("metrics_missing", f"no fresh metrics from {', '.join(signal.missing)}")
            elif signal.starting:
                hold = ("replicas_starting", f"{signal.starting} replicas still starting")
            elif ttft_high:
                hold = ("ttft_above_target", ttft_high)
            elif load_rising:
                hold = ("load_rising", load_rising)
            elif floor is not None and desired < floor[0]:
                if _floor_peak(name, history, peak_raw, now, role, tuning) <= floor[1]:
                    floor = None  # the load has fallen clearly below the failed attempt
                elif floor[0] < current:
                    desired = floor[0]
                else:
                    hold = (
                        "flap_damping",
                        f"going below {floor[0]} was undone at {floor[1] / (1 - tol):.2f} "
                        f"replicas needed; waiting for {floor[1]:.2f}",
                    )
            if hold:
                desired = current
                code, why = hold[0], f"{why}; holding: {hold[1]}"
        if desired > current + role.max_scale_up_step:
            desired = current + role.max_scale_up_step
            code, why = "step_limit", f"{why}; at most +{role.max_scale_up_step} per period"
        elif desired < current - role.max_scale_down_step:
            desired = current - role.max_scale_down_step
            code, why = "step_limit", f"{why}; at most -{role.max_scale_down_step} per period"
    if desired < role.min_replicas or desired > role.max_replicas:
        bound = role.min_replicas if desired < role.min_replicas else role.max_replicas
        code = "min_replicas" if desired < role.min_replicas else "max_replicas"
        desired, why = bound, f"{why}; clamped to {code.replace('_', ' ')} {bound}"
    elif signal.raw is not None and desired == role.max_replicas and signal.raw > desired + 1e-9:
        code = "max_replicas"
        why = f"{why}; at maxReplicas {role.max_replicas}"
    reason = f"{name} {current} -> {desired}: {why} ({signal.detail})"
    scaled_down = state.scaled_down
    if desired < current and signal.raw is not None:
        scaled_down = (now, current, peak_raw)
    elif (
        desired > current
        and scaled_down is not None
        and now - scaled_down[0] < role.scale_down_stabilization_seconds
    ):
        # Up again soon after going down: the lower count did not hold a load
        # that looked as if it would (at a few replicas, consolidating a batch
        # lengthens its steps, so each request holds its KV longer). The next
        # scale-down below this count waits for a clearly lower load.
        share = tuning.tolerance if tuning.flap_floor_share is None else tuning.flap_floor_share
        floor = (min(desired, scaled_down[1]), scaled_down[2] * (1 - share))
        scaled_down = None
    new_state = RoleState(
        since=since,
        recommendations=tuple(history),
        demand=tuple(demand),
        count=current,
        scaled_down=scaled_down,
        floor=floor,
        scaled_up=now if desired > current else state.scaled_up,
    )
    return RoleDecision(name, current, desired, code, reason, now), new_state


def _floor_peak(
    name: Role,
    history: Sequence[tuple[float, int, int, float]],
    peak: float,
    now: float,
    role: RoleScaling,
    tuning: PolicyTuning,
) -> float:
    """The load a flap-damping floor is compared with: the down window's
    peak, or with ``flap_floor_full_window`` (decode) /
    ``prefill_flap_floor_full_window`` the spec's whole down window's (a few
    low samples of a noisy signal meet the shorter falling window)."""
    full = (
        tuning.flap_floor_full_window if name == "decode" else tuning.prefill_flap_floor_full_window
    )
    if not full:
        return peak
    seconds = role.scale_down_stabilization_seconds
    return max((e[3] for e in history if now - e[0] < seconds), default=peak)


def _down_count(name: Role, raw: float, tuning: PolicyTuning, falling: bool = False) -> int:
    """The count a scale-down leaves for ``raw`` replicas needed, with the
    headroom it keeps: decode's own, where set; ``falling_down_headroom``
    while the demand falls decisively; ``single_decode_headroom`` for decode
    going down to one replica."""
    if falling and tuning.falling_down_headroom is not None:
        headroom = tuning.falling_down_headroom
    elif name == "decode" and tuning.decode_down_headroom is not None:
        headroom = tuning.decode_down_headroom
    elif tuning.scale_down_headroom is None:
        headroom = tuning.tolerance
    else:
        headroom = tuning.scale_down_headroom
    count = math.ceil(raw * (1 + headroom) - 1e-9)
    single = tuning.single_decode_headroom
    if name == "decode" and single is not None and count <= 1:
        count = math.ceil(raw * (1 + single) - 1e-9)
    return count


def _recent_peak(state: RoleState, now: float, tuning: PolicyTuning) -> float:
    """The highest demand (replicas) measured within ``recent_peak_seconds``."""
    if tuning.recent_peak_seconds is None:
        return 0.0
    recent = [v for t, v in state.demand if now - t < tuning.recent_peak_seconds]
    return max(recent, default=0.0)


def _rise_after_down(
    role: RoleScaling,
    state: RoleState,
    prefill: RoleSignal,
    recent: tuple[tuple[float, float], ...],
    long: tuple[tuple[float, float], ...],
    now: float,
    tuning: PolicyTuning,
) -> bool:
    """Whether decode may project a rise within one down window of its
    latest scale-down: only while prefill's arrivals rise out of their noise
    (``rise_after_down_z``). Consolidating a batch onto fewer replicas
    lengthens their steps, so the summed KV usage climbs for a while after a
    scale-down on an unchanged request rate; projected a startup ahead, that
    climb undid the scale-down (docs/autoscaling.md, "Steady oscillation")."""
    if tuning.rise_after_down_z is None or state.scaled_down is None:
        return True
    if now - state.scaled_down[0] >= role.scale_down_stabilization_seconds:
        return True
    return rise_confirmed(prefill.demand, recent, long, tuning.rise_after_down_z)


def _long_history(
    state: RoleState, now: float, tuning: PolicyTuning
) -> tuple[tuple[float, float], ...]:
    """The role's demand samples within ``rise_noise_window_seconds``."""
    return tuple((t, v) for t, v in state.long_demand if now - t < tuning.rise_noise_window_seconds)


def _remember(
    history: tuple[tuple[float, float], ...], signal: RoleSignal, now: float
) -> tuple[tuple[float, float], ...]:
    """``history`` with the signal's demand of ``now`` (a complete one only:
    a partial sum would read as a fall)."""
    if signal.demand is None or not signal.complete:
        return history
    return (*history, (now, signal.demand))


def _decode_floor(role: RoleScaling, tuning: PolicyTuning) -> int:
    """Fewest decode replicas the load signals may leave
    (``decode_load_floor``, within ``maxReplicas``); scale to zero still
    goes below it once the role is idle."""
    floor = int(tuning.decode_load_floor or 1)
    return max(1, min(floor, role.max_replicas))


def _prefill_rising(
    history: Trend, demand: float | None, now: float, tuning: PolicyTuning
) -> str | None:
    """Why decode holds its count (``hold_decode_rising_quantile``): prefill's
    demand is rising, and its requests reach decode next."""
    q = tuning.hold_decode_rising_quantile
    if q is None or demand is None:
        return None
    points = (*history, (now, demand))
    if now - points[0][0] < tuning.min_trend_span_seconds - 1e-9:
        return None
    slope = pairwise_slope(points, q)
    if slope is None or slope <= 0:
        return None
    return f"prefill's demand rising ({slope * 60:+.2f} replicas a minute)"


def _prefill_mix(
    mix: tuple[tuple[float, float, float], ...],
    fresh: Sequence[ReplicaSample],
    now: float,
    seconds: float,
) -> tuple[tuple[float, float, float], ...]:
    """The prompt mix's window with this period's arrivals added."""
    tokens = requests = 0.0
    for r in fresh:
        dt = r.interval_seconds
        t_rate, r_rate = r.prompt_token_arrivals_per_second, r.request_arrivals_per_second
        if dt and t_rate is not None and r_rate is not None:
            tokens += t_rate * dt
            requests += r_rate * dt
    kept = tuple(m for m in mix if now - m[0] < seconds)
    return (*kept, (now, tokens, requests)) if requests > 0 else kept


def _current(obs: RoleObservation) -> tuple[int, int]:
    """(requested replicas, of which not ready)."""
    live = [r for r in obs.replicas if r.state != "draining"]
    requested = obs.requested if obs.requested is not None else len(live)
    ready = sum(1 for r in live if r.state == "ready")
    return requested, max(requested - ready, 0)


# ---------------------------------------------------------------------------
# scale to zero


def _idle(obs: RoleObservation, signal: RoleSignal, now: float, stale: float) -> bool:
    """No request arriving, queued or running on any replica of the role, and
    every replica ready with a fresh sample saying so."""
    if not signal.complete or signal.starting or obs.activations > 0:
        return False
    live = [r for r in obs.replicas if r.state != "draining"]
    if any(r.state != "ready" or r.time is None or now - r.time > stale for r in live):
        return False
    if any(r.state == "draining" for r in obs.replicas):
        return False
    for r in live:
        if (r.num_running or 0) > 0 or (r.num_waiting or 0) > 0:
            return False
        if (r.prompt_token_arrivals_per_second or 0) > 0 or (r.first_tokens_per_second or 0) > 0:
            return False
    return True


def _at_zero(name: Role, role: RoleScaling, obs: RoleObservation, now: float) -> RoleDecision:
    """The decision for a role at zero replicas (``minReplicas: 0``)."""
    if obs.activations > 0:
        desired = max(1, role.min_replicas)
        why = (
            f"{obs.activations:.0f} requests found no {name} replica: activating "
            "(gateway activation signal)"
        )
        return RoleDecision(name, 0, desired, "activation", f"{name} 0 -> {desired}: {why}", now)
    why = "no request wants the role (scaled to zero)"
    return RoleDecision(name, 0, 0, "scaled_to_zero", f"{name} 0 -> 0: {why}", now)


def _decide_role(
    name: Role,
    role: RoleScaling,
    obs: RoleObservation,
    signal: RoleSignal,
    state: RoleState,
    now: float,
    tuning: PolicyTuning,
    stale: float,
    ttft_high: str | None = None,
    load_rising: str | None = None,
    load_floor: int = 1,
) -> tuple[RoleDecision, RoleState]:
    """One role's decision, with ``minReplicas: 0`` handled here and only here:
    at zero, only the gateway's activation signal starts a replica; above
    zero, the load signals never go below one replica, and the role goes to
    zero once idle for ``scaleToZeroAfterSeconds``."""
    current, _ = _current(obs)
    window = tuning.trend_window_seconds
    if role.min_replicas > 0:
        if load_floor > role.min_replicas:
            role = replace(role, min_replicas=load_floor)
        return _role_decision(
            name, role, signal, current, state, now, tuning, window, ttft_high, load_rising
        )
    if current == 0:
        # Nothing to measure: forget the windows, so that the first replica
        # back starts from its own samples.
        return _at_zero(name, role, obs, now), RoleState(since=state.since, count=0)
    decision, new_state = _role_decision(
        name,
        replace(role, min_replicas=load_floor),
        signal,
        current,
        state,
        now,
        tuning,
        window,
        ttft_high,
        load_rising,
    )
    idle_since = None
    if _idle(obs, signal, now, stale):
        idle_since = state.idle_since if state.idle_since is not None else now
    new_state = replace(new_state, idle_since=idle_since)
    if idle_since is not None and now - idle_since >= role.scale_to_zero_after_seconds:
        why = f"idle for {now - idle_since:.0f} s (scaleToZeroAfterSeconds {role.scale_to_zero_after_seconds:g})"
        decision = replace(decision, desired=0, code="idle", reason=f"{name} {current} -> 0: {why}")
        new_state = RoleState(since=new_state.since, count=current)
    return decision, new_state


# ---------------------------------------------------------------------------
# across roles


def _retarget(decision: RoleDecision, desired: int, code: str, why: str) -> RoleDecision:
    head = decision.reason.split(": ", 1)
    rest = head[1] if len(head) > 1 else ""
    reason = f"{decision.role} {decision.current} -> {desired}: {why}; was {rest}"
    return replace(decision, desired=desired, code=code, reason=reason)


def _apply_ratio(
    spec: AutoscalingSpec, p: RoleDecision, d: RoleDecision
) -> tuple[RoleDecision, RoleDecision]:
    lo, hi = spec.prefill_decode_ratio.min, spec.prefill_decode_ratio.max
    eps = 1e-9
    if p.desired == 0 or d.desired == 0:
        return p, d  # a role at zero (scaled to zero, or being activated) has no ratio
    if hi is not None and p.desired > hi * d.desired + eps:
        need = min(math.ceil(p.desired / hi - eps), spec.decode.max_replicas)
        if need > d.desired:
            d = _retarget(
                d, need, "ratio", f"prefill:decode at most {hi:g} with {p.desired} prefill"
            )
        if p.desired > hi * d.desired + eps:
            cap = max(math.floor(hi * d.desired + eps), spec.prefill.min_replicas)
            p = _retarget(p, cap, "ratio", f"prefill:decode at most {hi:g} with {d.desired} decode")
    if lo is not None and p.desired < lo * d.desired - eps:
        need = min(math.ceil(lo * d.desired - eps), spec.prefill.max_replicas)
        if need > p.desired:
            p = _retarget(
                p, need, "ratio", f"prefill:decode at least {lo:g} with {d.desired} decode"
            )
        if p.desired < lo * d.desired - eps:
            cap = max(math.floor(p.desired / lo + eps), spec.decode.min_replicas)
            d = _retarget(
                d, cap, "ratio", f"prefill:decode at least {lo:g} with {p.desired} prefill"
            )
    return p, d


def _apply_budget(
    spec: AutoscalingSpec, p: RoleDecision, d: RoleDecision
) -> tuple[RoleDecision, RoleDecision]:
    budget = spec.max_total_replicas
    if budget is None or p.desired + d.desired <= budget:
        return p, d
    want = {"prefill": p.desired, "decode": d.desired}
    floor = {"prefill": spec.prefill.min_replicas, "decode": spec.decode.min_replicas}
    current = {"prefill": p.current, "decode": d.current}
    while want["prefill"] + want["decode"] > budget:
        growth = {r: want[r] - current[r] for r in want if want[r] > max(current[r], floor[r])}
        if growth:
            # Take back the larger growth first, so both roles keep some.
            role = max(growth, key=lambda r: (growth[r], r == "prefill"))
        else:
            role = max(
                (r for r in want if want[r] > floor[r]), key=lambda r: (want[r], r == "prefill")
            )
        want[role] -= 1
    why = f"prefill + decode at most maxTotalReplicas {budget}"
    if want["prefill"] != p.desired:
        p = _retarget(p, want["prefill"], "budget", why)
    if want["decode"] != d.desired:
        d = _retarget(d, want["decode"], "budget", why)
    return p, d


# ---------------------------------------------------------------------------


def decide(
    spec: AutoscalingSpec,
    observation: FleetObservation,
    now: float,
    state: PolicyState | None = None,
    tuning: PolicyTuning | None = None,
) -> PolicyResult:
    """Desired replicas of both roles, with reasons, and the state for next time.

    Pure: the same arguments give the same result. Call once per
    ``spec.period_seconds``; the step limits are per call.
    """
    state = state or PolicyState()
    tuning = tuning or PolicyTuning()
    stale = spec.metrics_stale_seconds
    startup, watched, starting_since = _startups(
        observation, state, now, tuning, spec.period_seconds
    )
    # A start is first seen one period after it was requested, so the time
    # measured is short by a period; capacity requested now must also last
    # until the next decision's capacity serves, a period later.
    period = spec.period_seconds
    ahead = (startup + period if startup is not None else tuning.default_startup_seconds) + period
    ahead *= tuning.horizon_factor
    window = tuning.trend_window_seconds

    _, p_starting = _current(observation.prefill)
    p_history = tuple((t, v) for t, v in state.prefill.demand if now - t < window)
    p_fresh, p_missing, p_draining = split_samples(observation.prefill.replicas, now, stale)
    tokens_per_second = calibrate_prefill_rate(
        p_fresh + p_draining,
        state.prefill_tokens_per_second,
        tuning.calibration_smoothing,
        tuning.min_calibration_busy,
    )

    mix = state.prefill_mix
    tokens_per_request = None
    if tuning.prefill_mix_seconds is not None:
        mix = _prefill_mix(mix, p_fresh, now, tuning.prefill_mix_seconds)
        requests = sum(m[2] for m in mix)
        if requests > 0:
            tokens_per_request = sum(m[1] for m in mix) / requests

    def prefill_now(rise: bool = True) -> RoleSignal:
        return prefill_signal(
            spec.prefill,
            p_fresh,
            p_missing,
            p_starting,
            tokens_per_second,
            p_history,
            now,
            ahead,
            tuning.prefill_target_utilization,
            tuning.backlog_drain_seconds,
            _recent_peak(state.prefill, now, tuning),
            tuning.trend_noise_z,
            tuning.min_trend_span_seconds,
            tuning.rise_recent_seconds,
            tuning.rise_z,
            rise=rise,
            tokens_per_request=tokens_per_request,
            outlier_z=tuning.prefill_outlier_z,
        )

    p_signal = prefill_now()
    # The arrivals' noise gates (PolicyTuning, off by default): a rise or a
    # fall counts only where it stands out of the arrivals' long-run noise.
    p_long = _long_history(state.prefill, now, tuning)
    if not rise_confirmed(p_signal.demand, p_history, p_long, tuning.prefill_rise_noise_z):
        p_signal = prefill_now(rise=False)
    if p_signal.falling and not fall_confirmed(
        p_signal.demand, p_history, now, p_long, tuning.fall_noise_z
    ):
        p_signal = replace(p_signal, falling=False)
    d_rise = rise_confirmed(
        p_signal.demand, p_history, p_long, tuning.rise_noise_z
    ) and _rise_after_down(spec.decode, state.decode, p_signal, p_history, p_long, now, tuning)
    ttfts = [r.ttft_seconds for r in p_fresh if r.ttft_seconds is not None]
    ttft_high = None
    if ttfts and max(ttfts) > spec.prefill.ttft_target_seconds:
        ttft_high = f"prefill TTFT {max(ttfts):.2f} s above the {spec.prefill.ttft_target_seconds:g} s target"
    p, p_state = _decide_role(
        "prefill",
        spec.prefill,
        observation.prefill,
        p_signal,
        state.prefill,
        now,
        tuning,
        stale,
        ttft_high,
    )

    d_current, d_starting = _current(observation.decode)
    d_fresh, d_missing, d_draining = split_samples(observation.decode.replicas, now, stale)
    d_history = tuple((t, v) for t, v in state.decode.demand if now - t < window)
    if d_current != state.decode.count:
        # The series restarts at a count change (see _role_decision): the
        # first sample at the new count is not a trend against the old one
        # (at one replica fewer, the same load shows more summed KV usage).
        d_history = ()
    if (
        tuning.settle_decode_trend
        and d_history
        and now - d_history[0][0] < window - spec.period_seconds - 1e-6
    ):
        # After a count change decode's KV usage moves to its new level for
        # a while (consolidating onto fewer replicas lengthens their steps):
        # that transient is the policy's own doing, not a trend of the load.
        # Until the series spans the trend window, decode follows prefill's
        # growth only.
        d_history = ()
    own_trend = d_rise and decode_trend_confirmed(p_signal, tuning.decode_trend_with_arrivals)
    d_signal = decode_signal(
        spec.decode,
        d_fresh,
        d_draining,
        d_missing,
        d_starting,
        d_history,
        now,
        ahead,
        tuning.backlog_drain_seconds
        if tuning.decode_queue_drain_seconds is None
        else tuning.decode_queue_drain_seconds,
        p_signal.growth if d_rise else 1.0,
        p_signal.falling,
        _recent_peak(state.decode, now, tuning),
        tuning.fit_decode_level,
        tuning.trend_noise_z,
        tuning.min_trend_span_seconds,
        own_trend=own_trend,
        own_fall=not tuning.decode_falls_with_arrivals,
    )
    d, d_state = _decide_role(
        "decode",
        spec.decode,
        observation.decode,
        d_signal,
        state.decode,
        now,
        tuning,
        stale,
        load_rising=_prefill_rising(p_history, p_signal.demand, now, tuning),
        load_floor=_decode_floor(spec.decode, tuning),
    )

    if (
        tuning.rise_noise_z is not None
        or tuning.prefill_rise_noise_z is not None
        or tuning.fall_noise_z is not None
        or tuning.rise_after_down_z is not None
    ):
        p_state = replace(p_state, long_demand=_remember(p_long, p_signal, now))
    p, d = _apply_ratio(spec, p, d)
    p, d = _apply_budget(spec, p, d)
    new_state = PolicyState(
        prefill=p_state,
        decode=d_state,
        prefill_tokens_per_second=tokens_per_second,
        startup_seconds=startup,
        startup_watched=watched,
        starting_since=starting_since,
        prefill_mix=mix,
    )
    return PolicyResult(prefill=p, decode=d, state=new_state)
