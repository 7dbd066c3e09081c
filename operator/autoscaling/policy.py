"""The autoscaling policy: pure functions from samples to desired replicas.

No I/O and no clock: the caller passes ``now`` (seconds, the same clock as the
samples' ``time``) and the :class:`PolicyState` the previous call returned.
One call per period decides both roles::

    result = decide(spec, FleetObservation(prefill=..., decode=...), now, state)
    state = result.state          # keep for the next period
    result.prefill.desired, result.decode.desired, result.prefill.reason

The phases, in order (each a function below):

1. **observe** (:func:`observe`): from the fresh samples of ready replicas,
   the request arrival rate at prefill, prefill's service time per request
   (its mean and spread, over a window of several minutes), its backlog, and
   decode's KV usage, running and waiting requests and mean step time.
2. **forecast** (:func:`forecast`): the arrival rate one startup plus one
   period ahead (the lead, 15-120 s): a robust line through the last two
   minutes of rates, its rise projected only where it stands out of the
   rate's Poisson noise, plus a margin for that noise over the next minute.
3. **size** (:func:`size_prefill`, :func:`size_decode`): replicas from the
   SLOs. Prefill: the fewest replicas whose queueing model (M/G/c, Erlang C)
   keeps the share of requests that miss the TTFT target because they
   waited below :attr:`PolicyTuning.ttft_miss_share`. Decode: the KV usage
   per replica at which its step-time model (fitted to the replicas' own
   inter-token latencies) meets the ITL target, capped by
   ``targetKVCacheUsage``; the KV the forecast rate will hold at that step
   time, over that usage.
4. **step-limit** (:func:`step_limit`): up at once to what is needed; down
   only once everything sized over the down window (``scaleDownStabilizationSeconds``),
   with a few percent of headroom, is below the current count, to the most of it; no
   scale-down while a replica's metrics are missing or replicas are
   starting; the spec's steps per period and bounds.
5. **choose victims** (:func:`choose_victims`): which replicas a scale-down
   drains (the actuators call it through the control loop).

Then across roles: the prefill:decode ratio guardrail (raising the short side
first) and the total replica budget (taking back growth first); and scale to
zero (``minReplicas: 0``), decided in :func:`_decide_role`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from .models import fit_step_model, replicas_for_ttft, theil_sen
from .samples import ReplicaSample
from .spec import AutoscalingSpec, RoleScaling
from .victims import ReplicaLoad
from .victims import choose_victims as _choose_victims

Role = Literal["prefill", "decode"]
Direction = Literal["up", "down", "none"]

# Machine reason codes (the `reason` label of the decisions counter).
REASON_CODES = (
    "ttft_model",  # prefill: the queueing model's replicas for the TTFT target
    "prefill_backlog",  # prefill: queued work beyond what the model expects, drained
    "waiting_queue",  # waiting requests against targetWaitingPerReplica (engines without a backlog series)
    "itl_model",  # decode: the step-time model's replicas for the ITL target
    "kv_cache",  # decode: KV usage against targetKVCacheUsage (the ceiling)
    "within_tolerance",  # fewer replicas needed, but not with the scale-down headroom
    "stabilization_window",  # a lower count not yet needed for the whole down window
    "metrics_missing",  # a ready replica has missing or stale metrics: no scale-down
    "replicas_starting",  # replicas still starting: no scale-down
    "step_limit",  # change cut to maxScaleUpStep / maxScaleDownStep
    "min_replicas",
    "max_replicas",
    "ratio",  # prefillDecodeRatio guardrail
    "budget",  # maxTotalReplicas
    "no_metrics",  # no fresh sample at all: hold
    "activation",  # at zero replicas, the gateway saw requests for the role: start one
    "scaled_to_zero",  # at zero replicas and nothing wants the role: stay there
    "idle",  # minReplicas 0 and idle for scaleToZeroAfterSeconds: go to zero
)


@dataclass(frozen=True)
class PolicyTuning:
    """Constants of the policy that are not part of the resource."""

    ttft_miss_share: float = 0.02
    """Share of requests the prefill model may let miss the TTFT target
    because they waited (below the SLO's 1%: the rest is the forecast's
    error and the model's)."""
    itl_margin: float = 0.93
    """Decode plans its replicas' step time at this share of the ITL target
    (a request's ITL is the mean over its steps; replicas differ a little)."""
    ttft_reserve: float = 0.05
    """Share of the TTFT target kept for what the models do not see: the KV
    transfer and the gateway."""
    level_window_seconds: float = 300.0
    """The arrival rates the forecast's level is fitted to."""
    forecast_window_seconds: float = 120.0
    """The arrival rates a rise (or a surge's start or end) is read from."""
    min_trend_span_seconds: float = 20.0
    """A rise is projected only from rates spanning at least this long (a
    fleet's first seconds fill idle engines)."""
    min_lead_seconds: float = 15.0
    max_lead_seconds: float = 120.0
    """Bounds on how far ahead the forecast looks (one startup plus one
    period, learned from the replicas' starts)."""
    default_startup_seconds: float = 60.0
    """The startup the lead assumes before one has been observed."""
    rise_z: float = 3.0
    """A rise is projected when it amounts, over the forecast window, to
    this many times its own noise (the Poisson noise of one period's rate,
    through a line of the window's periods)."""
    fall_z: float = 3.5
    """A fall counts as decisive (the spec's short down window) when it
    stands this many times its noise out of a window's line."""
    rate_z: float = 0.5
    """Size for the forecast plus this many times the Poisson noise of the
    arrivals over :attr:`noise_horizon_seconds`."""
    noise_horizon_seconds: float = 60.0
    service_window_seconds: float = 450.0
    """Prefill's service time per request (mean and spread) is measured over
    this window: a period's couple of hundred requests only add noise."""
    itl_near: float = 0.5
    """Decode's step model sizes it only once the step time is this share of
    the goal, or the model is fitted (a light load's steps say little)."""
    unfitted_fixed_share: float = 0.5
    """Before decode's step model is fitted, the share of the measured step
    time taken as its fixed part (streaming the weights)."""
    step_window_seconds: float = 1800.0
    """Decode's step-time model is fitted to the samples of this window."""
    warmup_seconds: float = 60.0
    """Decode's first samples, as a fleet fills from idle, do not enter the
    step-time model."""
    step_min_spread: float = 0.1
    """Least spread of KV usage (10th to 90th percentile) that tells the
    step model's fixed part from its per-KV part."""
    decode_window_seconds: float = 300.0
    """Decode's KV per unit of load (KV usage / (arrival rate x step time))
    is the median over this window."""
    scale_up_extra: float = 0.06
    scale_down_least: float = 0.11
    """Scale events come in chunks: a scale-up adds this share more than
    needed (a rising load soon needs it), a scale-down removes at least this
    share of the count, rounded to the nearest replica (and one replica: 2
    from 14 replicas on). A load that moves by a replica at
    a time would otherwise make an event for every replica it crosses."""
    scale_down_headroom: float = 0.03
    """A scale-down leaves replicas for this much more load than measured:
    the count left is not one the load's noise takes straight back up."""
    steady_down_factor: float = 10 / 3
    """The down window while the load does not fall decisively, as a
    multiple of the spec's (which applies while it does): 300 s for the
    default 90 s."""
    dwell_seconds: float = 600.0
    decisive_fall: float = 0.15
    reversal_band: float = 0.05
    """Within ``dwell_seconds`` of a scale-up, scale down only once the need
    has fallen by ``decisive_fall`` of the count; within it after a
    scale-down, scale up only once the need is ``reversal_band`` above the
    count (the models' margins cover less): no reversal on noise."""
    backlog_drain_seconds: float = 60.0
    """Queued prefill work beyond what the model expects is planned to be
    gone this long after the added replicas serve."""
    calibration_smoothing: float = 0.3
    """Weight of a new measurement in a running estimate (tokens/s, startup)."""
    min_calibration_busy: float = 0.1
    """Least busy prefill time (replica-periods, summed) that measures
    anything: an idle fleet measures nothing."""
    min_scv: float = 0.1
    max_scv: float = 4.0
    """Bounds on the measured squared coefficient of variation of prefill's
    service times."""

    def __post_init__(self) -> None:
        for name in ("ttft_miss_share", "ttft_reserve"):
            value = getattr(self, name)
            if not 0 < value < 1:
                raise ValueError(f"{name} must be in (0, 1), got {value}")
        if not 0 < self.itl_margin <= 1:
            raise ValueError(f"itl_margin must be in (0, 1], got {self.itl_margin}")
        if not 0 <= self.scale_down_headroom < 1:
            raise ValueError("scale_down_headroom must be in [0, 1)")
        if self.steady_down_factor < 1:
            raise ValueError("steady_down_factor must be >= 1")
        if not 0 < self.calibration_smoothing <= 1:
            raise ValueError("calibration_smoothing must be in (0, 1]")
        if not 0 < self.min_lead_seconds <= self.max_lead_seconds:
            raise ValueError("need 0 < min_lead_seconds <= max_lead_seconds")
        for name in (
            "forecast_window_seconds",
            "level_window_seconds",
            "default_startup_seconds",
            "noise_horizon_seconds",
            "service_window_seconds",
            "step_window_seconds",
            "decode_window_seconds",
            "backlog_drain_seconds",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


# ---------------------------------------------------------------------------
# what the actuator observes, what the policy remembers, what it returns


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
    deferrable_running: float = 0.0
    """Requests of OpenAI Batch API jobs running on the role's replicas now
    (the gateways' ``pdfleet_gateway_batch_requests{state="running"}``):
    deferrable demand. They are counted in the replicas' running requests and
    KV usage; the policy takes them out of both (their share of the KV), so
    a batch on idle capacity never scales the role up."""


@dataclass(frozen=True)
class FleetObservation:
    prefill: RoleObservation = field(default_factory=RoleObservation)
    decode: RoleObservation = field(default_factory=RoleObservation)


Series = tuple[tuple[float, float], ...]
# The shortest windows a rise is read from, besides the forecast window: a
# surge's first periods stand out of a large fleet's noise within them.
RISE_WINDOWS = (50.0,)
# A fall is read only from windows of at least this many periods.
MIN_FALL_POINTS = 8


@dataclass(frozen=True)
class RoleState:
    """What one role remembers between periods."""

    since: float | None = None
    """Time of this role's first decision."""
    needs: Series = ()
    """(time, replicas needed) within the longest stabilization window."""
    count: int | None = None
    """Requested replicas when this state was made."""
    scaled_up: float | None = None
    """When the role last scaled up."""
    up_need: float | None = None
    """The replicas needed at the latest scale-up."""
    scaled_down: float | None = None
    """When the role last scaled down."""
    idle_since: float | None = None
    """Since when the role has had no request arriving, queued or running."""


@dataclass(frozen=True)
class PolicyState:
    prefill: RoleState = field(default_factory=RoleState)
    decode: RoleState = field(default_factory=RoleState)
    rates: Series = ()
    """(time, requests arriving per second at prefill) within the level window."""
    service: tuple[tuple[float, float, float, float], ...] = ()
    """(time, requests served, busy seconds, sum of n x (busy / n)^2) of
    each prefill replica-period within the service window: the mean service
    time and its spread."""
    prefill_tokens_per_second: float | None = None
    """Calibrated prompt tokens per second of one prefill replica."""
    kv_usage: tuple[tuple[str, float], ...] = ()
    """(replica, KV usage) of each decode replica at the previous period."""
    steps: Series = ()
    """(mean KV usage, mean step seconds) of the decode fleet per period
    within the step window, with their times in :attr:`step_times`."""
    step_times: tuple[float, ...] = ()
    step_model: tuple[float, float] | None = None
    """The latest (a, b) of decode's step-time model."""
    decode_load: Series = ()

    """(time, KV usage / (arrival rate x step seconds)) within the decode
    window: decode's KV per unit of load."""
    startup_seconds: float | None = None
    """Observed time from ``starting`` to ``ready``, smoothed; until a start
    has been watched, what the serving replicas report (``startup_watched``)."""
    startup_watched: bool = False
    """Whether ``startup_seconds`` comes from a watched start."""
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
    needed: float | None = None
    """Replicas the sizing asked for this period (before the windows and
    steps; None with nothing measured)."""

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


# ---------------------------------------------------------------------------
# phase 1: observe


@dataclass(frozen=True)
class RoleView:
    """The samples of one role this period."""

    fresh: tuple[ReplicaSample, ...]
    """Ready replicas with a fresh sample."""
    missing: tuple[str, ...]
    """Ready replicas without a usable sample."""
    draining: tuple[ReplicaSample, ...]
    """Draining replicas with a fresh sample (decode's KV is still theirs)."""
    current: int
    """Replicas requested (ready + starting)."""
    starting: int

    @property
    def complete(self) -> bool:
        return not self.missing


@dataclass(frozen=True)
class PrefillLoad:
    """What prefill's samples say."""

    rate: float | None
    """Requests arriving per second (None: not measurable)."""
    service_seconds: float | None
    """Mean prefill time of one request, over the service window."""
    scv: float
    """Squared coefficient of variation of the service times."""
    backlog_seconds: float | None
    """Queued prefill work, in seconds of one replica."""
    waiting: float
    ttft_seconds: float | None
    """Mean time to the first token at prefill over the period."""


@dataclass(frozen=True)
class DecodeLoad:
    """What decode's samples say."""

    usage: float
    """KV usage summed over the replicas (draining ones included)."""
    running: float
    waiting: float
    step_seconds: float | None
    """Mean step time (inter-token latency) over the period."""
    first_token_seconds: float | None
    """Mean time from arriving at decode to the first token."""
    step_model: tuple[float, float] | None
    """(a, b) of step seconds = a + b x KV usage, per replica."""
    step_fitted: bool
    """Whether the model was fitted to enough spread in the usage this
    period (not carried over from an earlier fit or drawn through 0)."""
    usage_per_replica: float | None
    """The KV usage the running requests see, on average over the period
    (the replicas' usage weighted by their running requests)."""
    load_ratio: float | None
    """KV usage per (request per second x step second): the KV one unit of
    load holds, median over the decode window."""


def _view(obs: RoleObservation, now: float, stale: float) -> RoleView:
    def fresh(r: ReplicaSample) -> bool:
        return r.time is not None and now - r.time <= stale

    live = [r for r in obs.replicas if r.state != "draining"]
    requested = obs.requested if obs.requested is not None else len(live)
    ready = [r for r in live if r.state == "ready"]
    # A replica seen once has no rate yet: it is missing for the sums.
    usable = [r for r in ready if fresh(r) and r.interval_seconds is not None]
    missing = tuple(
        f"{r.name} (first scrape)" if fresh(r) else r.name for r in ready if r not in usable
    )
    draining = tuple(r for r in obs.replicas if r.state == "draining" and fresh(r))
    return RoleView(tuple(usable), missing, draining, requested, max(requested - len(ready), 0))


def observe(
    spec: AutoscalingSpec,
    prefill: RoleView,
    decode: RoleView,
    state: PolicyState,
    now: float,
    tuning: PolicyTuning,
    deferrable: float = 0.0,
) -> tuple[PrefillLoad, DecodeLoad, PolicyState]:
    """Phase 1: the load of each role, and the windows updated with this
    period's samples. ``deferrable``: batch requests running on decode
    (:attr:`RoleObservation.deferrable_running`), taken out of its load."""
    # Prefill: arrivals, service time (mean and spread), backlog.
    rate = None
    rates = [r.request_arrivals_per_second for r in prefill.fresh]
    if rates and all(x is not None for x in rates):
        rate = sum(x or 0.0 for x in rates)
    service = tuple(e for e in state.service if now - e[0] < tuning.service_window_seconds)
    for r in (*prefill.fresh, *prefill.draining):
        dt, busy, first = r.interval_seconds, r.prefill_busy_fraction, r.first_tokens_per_second
        if dt and busy is not None and first is not None and first * dt >= 1:
            n, b = first * dt, busy * dt
            service = (*service, (now, n, b, b * b / n))
    tokens_per_second = _calibrate_tokens(prefill, state, tuning)
    served = sum(e[1] for e in service)
    mean = scv = None
    if served >= 1 and sum(e[2] for e in service) > 0:
        mean = sum(e[2] for e in service) / served
        # Each replica-period's mean service time varies by sigma^2 / n about
        # the mean: n (m - mean)^2 estimates sigma^2 (summed: n m^2 - ...).
        count = len(service)
        if count >= 2:
            variance = (sum(e[3] for e in service) - served * mean * mean) / (count - 1)
            scv = variance / (mean * mean)
    if mean is None and tokens_per_second:
        # Before anything was served: the prompts that arrived at the
        # configured (or measured) tokens/s.
        tokens = [r.prompt_token_arrivals_per_second for r in prefill.fresh]
        if rate and all(t is not None for t in tokens):
            mean = sum(t or 0.0 for t in tokens) / rate / tokens_per_second
    scv = min(max(scv if scv is not None else 1.0, tuning.min_scv), tuning.max_scv)
    backlog = None
    queued = [r.waiting_prompt_tokens for r in prefill.fresh]
    if tokens_per_second and queued and all(q is not None for q in queued):
        backlog = sum(q or 0.0 for q in queued) / tokens_per_second
    ttfts = [r.ttft_seconds for r in prefill.fresh if r.ttft_seconds is not None]
    p_load = PrefillLoad(
        rate=rate,
        service_seconds=mean,
        scv=scv,
        backlog_seconds=backlog,
        waiting=sum(r.num_waiting for r in prefill.fresh),
        ttft_seconds=statistics.fmean(ttfts) if ttfts else None,
    )
    rates_kept = tuple(p for p in state.rates if now - p[0] < tuning.level_window_seconds)
    if rate is not None and prefill.complete:
        rates_kept = (*rates_kept, (now, rate))

    # Decode: KV usage, steps, the step-time model.
    holders = (*decode.fresh, *decode.draining)
    usage = sum(r.kv_cache_usage for r in holders)
    running = sum(r.num_running for r in holders)
    if deferrable > 0 and running > 0:
        # Batch requests run beside online ones: out of the demand, with their
        # share of the KV (the mean request's; they are not told apart).
        online = max(running - deferrable, 0.0)
        usage *= online / running
        running = online
    previous = dict(state.kv_usage)
    keep = [i for i, t in enumerate(state.step_times) if now - t < tuning.step_window_seconds]
    steps = [state.steps[i] for i in keep]
    times = [state.step_times[i] for i in keep]
    weighted = weight = usage_sum = 0.0
    for r in decode.fresh:
        if r.itl_seconds is None or r.num_running <= 0:
            continue
        # Weighted by running requests, as the steps are (each request
        # takes its replica's step): a replica just started, nearly empty,
        # dilutes neither. The period's usage: the mean at its two ends.
        weighted += r.itl_seconds * r.num_running
        usage_sum += (previous.get(r.name, r.kv_cache_usage) + r.kv_cache_usage) / 2 * r.num_running
        weight += r.num_running
    step_now = weighted / weight if weight else None
    usage_now = usage_sum / weight if weight else None
    warm = state.decode.since is not None and now - state.decode.since >= tuning.warmup_seconds
    if step_now is not None and decode.complete and warm:
        # One point per period for the whole fleet: a replica's snapshot of
        # its KV usage is noisy against its period's steps (its requests come
        # and go), and that noise would flatten the fitted slope; the fleet's
        # mean averages it out, and moves with the load.
        steps.append((usage_sum / weight, step_now))
        times.append(now)
    fitted = fit_step_model(steps, tuning.step_min_spread, state.step_model)
    model = None if fitted is None else (fitted[0], fitted[1])
    firsts = [r.ttft_seconds for r in decode.fresh if r.ttft_seconds is not None]
    load_series = tuple(p for p in state.decode_load if now - p[0] < tuning.decode_window_seconds)
    if rate and step_now and decode.complete and prefill.complete and usage > 0:
        load_series = (*load_series, (now, usage / (rate * step_now)))
    d_load = DecodeLoad(
        usage=usage,
        running=running,
        waiting=sum(r.num_waiting for r in decode.fresh),
        step_seconds=step_now,
        first_token_seconds=statistics.fmean(firsts) if firsts else None,
        step_model=model,
        step_fitted=fitted is not None and fitted[2],
        usage_per_replica=usage_now,
        # Until decode has run for a while its KV is still filling (the
        # longest outputs last minutes): the snapshot, not a median that
        # lags it, sizes decode then.
        load_ratio=(
            statistics.median(v for _, v in load_series)
            if load_series and now - (state.decode.since or now) >= tuning.decode_window_seconds
            else None
        ),
    )
    new_state = replace(
        state,
        rates=rates_kept,
        service=service,
        prefill_tokens_per_second=tokens_per_second,
        kv_usage=tuple((r.name, r.kv_cache_usage) for r in holders),
        steps=tuple(steps),
        step_times=tuple(times),
        step_model=model,
        decode_load=load_series,
    )
    return p_load, d_load, new_state


def _calibrate_tokens(view: RoleView, state: PolicyState, tuning: PolicyTuning) -> float | None:
    """Prompt tokens one prefill replica computes per busy second, smoothed:
    the samples' summed prompt-token rate over their summed busy fraction,
    once the fleet is busy enough to measure; else the previous estimate."""
    pairs = [
        (r.prompt_tokens_per_second, r.prefill_busy_fraction)
        for r in (*view.fresh, *view.draining)
        if r.prompt_tokens_per_second is not None and r.prefill_busy_fraction is not None
    ]
    busy = sum(b for _, b in pairs)
    previous = state.prefill_tokens_per_second
    if busy < tuning.min_calibration_busy:
        return previous
    measured = sum(t for t, _ in pairs) / busy
    if measured <= 0:
        return previous
    if previous is None:
        return measured
    return previous + tuning.calibration_smoothing * (measured - previous)


# ---------------------------------------------------------------------------
# phase 2: forecast


@dataclass(frozen=True)
class Forecast:
    """The arrival rate now and ``lead`` seconds ahead."""

    level: float
    """The rate now: the robust line's value (one noisy period moves it little)."""
    ahead: float
    """What to size for: the rate ``lead`` ahead, plus the noise margin."""
    projected: float
    """The rate ``lead`` ahead, without the margins."""
    lead: float
    rising: bool
    detail: str
    slope: float = 0.0
    """The rise projected, in requests per second per second (0: none)."""
    falling: bool = False
    """The rate falls by more than its noise over one of the windows."""


def forecast(rates: Series, now: float, lead: float, tuning: PolicyTuning) -> Forecast | None:
    """Phase 2: the arrival rate ``lead`` seconds ahead (module docstring).
    None without a measured rate.

    Robust (Theil-Sen) lines through the rates of several windows, from the
    level window (minutes: its noise is small) down to the last 45 s (a
    surge's first periods): the level is the longest window's value now,
    unless a shorter one's disagrees by more than the noise allows (a
    surge's start or end); a rise is the steepest slope of a window whose
    rise stands out of its noise, carried ``lead`` ahead."""
    if not rates:
        return None
    measured = rates[-1][1]
    fits = []
    for window in (tuning.level_window_seconds, tuning.forecast_window_seconds, *RISE_WINDOWS):
        points = tuple(p for p in rates if now - p[0] < window)
        fit = theil_sen(points, now)
        if fit is not None:
            fits.append((fit, points))
    if not fits:
        return Forecast(measured, measured, measured, lead, False, f"{measured:.1f} requests/s")
    (level, _), points = fits[0]
    # One period's Poisson noise, and that of a line through n of them: its
    # value now about sqrt(4 / n) of it, its rise over its span sqrt(12 / n).
    span0 = now - points[0][0]
    period = span0 / max(len(points) - 1, 1)
    sample = math.sqrt(max(level, measured, 1e-9) / max(period, 1e-9))
    slope = 0.0
    falling = False
    for (value, window_slope), pts in fits:
        n, span = len(pts), now - pts[0][0]
        if span < tuning.min_trend_span_seconds - 1e-9:
            continue
        noise = sample * math.sqrt(12.0 / n)
        if window_slope * span > tuning.rise_z * noise:
            # A rise out of the noise: project it, from this window's level
            # if that is higher (a surge's start).
            slope = max(slope, window_slope)
            level = max(level, value)
        elif window_slope * span < -tuning.fall_z * noise and n >= MIN_FALL_POINTS:
            # A fall out of the noise, over enough periods that a few low
            # ones are not one: the short down window (the level stays the
            # long window's line, which follows a steady decline).
            falling = True
        if value > level + tuning.rise_z * sample * math.sqrt(4.0 / n):
            # A shorter window stands above the longer one's line now: a
            # fall that has ended (the long line, drawn through the fall and
            # the flat after it, runs on below the rate), or a rise. Its
            # value is the level; sizing below it would undershoot the load
            # and build a queue a cold start long.
            level = value
    level = max(level, 0.0)
    ahead = level + slope * lead
    margin = tuning.rate_z * math.sqrt(max(ahead, 0.0) / tuning.noise_horizon_seconds)
    detail = f"{measured:.1f} requests/s (level {level:.1f}"
    detail += f", rising to {ahead:.1f} in {lead:.0f} s" if slope > 0 else ""
    detail += ")"
    return Forecast(level, ahead + margin, ahead, lead, slope > 0, detail, slope, falling)


# ---------------------------------------------------------------------------
# phase 3: size


@dataclass(frozen=True)
class Need:
    """Replicas a role needs, as sized this period."""

    replicas: float | None
    """None: nothing measured (hold)."""
    code: str
    detail: str
    down: float | None = None
    """Replicas for the load times (1 + ``scale_down_headroom``): what a
    scale-down must leave, so that the load's noise does not take it
    straight back up. None: ``replicas``."""


def size_prefill(
    spec: AutoscalingSpec,
    load: PrefillLoad,
    decode: DecodeLoad,
    ahead: Forecast | None,
    view: RoleView,
    tuning: PolicyTuning,
    factor: float = 1.0,
) -> Need:
    """Phase 3, prefill: the fewest replicas that keep the share of requests
    that miss the TTFT target because they waited at most
    ``ttft_miss_share`` (:func:`.models.replicas_for_ttft`), at the forecast
    rate and the measured service time; more while a queue beyond what the
    model expects is drained. Engines without the service-time series (vLLM)
    size on their waiting requests."""
    role = spec.prefill
    if not view.fresh:
        return Need(None, "no_metrics", "no fresh metrics from any ready replica")
    if load.service_seconds is None or ahead is None:
        waiting = load.waiting
        need = waiting / role.target_waiting_per_replica
        return Need(max(need, 1.0 if waiting else 0.0), "waiting_queue", f"{waiting:.0f} waiting")
    # The TTFT budget of prefill: the target less decode's first token and
    # a reserve for what no model here sees (the KV transfer, the gateway).
    first = decode.first_token_seconds or 0.0
    budget = role.ttft_target_seconds * (1 - tuning.ttft_reserve) - 2 * first
    replicas = replicas_for_ttft(
        ahead.ahead * factor,
        load.service_seconds,
        load.scv,
        budget,
        tuning.ttft_miss_share,
        role.max_replicas * 4,
    )
    code = "ttft_model"
    detail = (
        f"{ahead.detail} x {load.service_seconds * 1000:.0f} ms a request "
        f"(scv {load.scv:.2f}) = {ahead.level * load.service_seconds:.1f} busy: "
        f"{replicas} for TTFT {role.ttft_target_seconds:g} s"
    )
    if load.backlog_seconds is not None:
        # The model expects about one request's service queued per replica;
        # more is lateness to drain.
        expected = view.current * load.service_seconds * 2
        excess = load.backlog_seconds - expected
        if excess > 0:
            drained = (
                ahead.ahead * factor * load.service_seconds + excess / tuning.backlog_drain_seconds
            )
            if drained > replicas:
                replicas, code = math.ceil(drained), "prefill_backlog"
            detail += f", backlog {load.backlog_seconds:.1f} s"
    return Need(float(replicas), code, detail)


def size_decode(
    spec: AutoscalingSpec,
    load: DecodeLoad,
    ahead: Forecast | None,
    view: RoleView,
    tuning: PolicyTuning,
    factor: float = 1.0,
) -> Need:
    """Phase 3, decode: the replicas at which the step time meets
    ``itl_margin`` x the ITL target, at the forecast rate; at least those
    that keep the KV usage at most ``targetKVCacheUsage``.

    A replica's step time is ``a + b u`` at KV usage ``u`` (the fixed part
    streams the weights, the rest reads the KV), and the KV the fleet holds
    is, by Little's law, the arrival rate times the step time times the KV
    one request holds per step. From where the fleet is now (``c0``
    replicas at step time ``s0``), the replicas that bring the step time to
    the goal ``g`` are ``c0 (g / s0) (s0 - a) / (g - a)``, times the rate's
    growth. Only ``a`` must be known: it comes from the step-time model
    fitted to the fleet's own periods (:func:`.models.fit_step_model`).
    Without a fit, ``unfitted_fixed_share`` of the measured step is taken
    as fixed."""
    role = spec.decode
    if not view.fresh:
        return Need(None, "no_metrics", "no fresh metrics from any ready replica")
    growth = 1.0
    if ahead is not None and ahead.level > 0:
        growth = max(ahead.ahead / ahead.level, 0.0)
    cap = role.target_kv_cache_usage
    kv = load.usage * growth
    detail = f"KV usage {load.usage:.2f} summed"
    if ahead is not None:
        detail = f"{ahead.detail}: {detail}"
    if load.waiting > 0:
        per_request = load.usage / load.running if load.running else cap
        kv += load.waiting * per_request
        detail += f", {load.waiting:.0f} waiting"
    replicas, code = kv / cap, "kv_cache"
    goal = role.itl_target_seconds * tuning.itl_margin
    u0, s0 = load.usage_per_replica, load.step_seconds
    fitted = load.step_model is not None and load.step_fitted
    # Steps far below the goal (a light load) say nothing of where the
    # goal's usage is: the KV ceiling sizes decode until they come nearer or
    # the model is fitted.
    near = s0 is not None and s0 >= tuning.itl_near * goal
    if u0 and s0 and u0 > 0 and load.usage > 0 and (fitted or near):
        if fitted:
            if load.step_model is None:
                raise RuntimeError("broken invariant: load.step_model is not None")
            a, b = load.step_model
            source = f"steps {a * 1000:.1f} + {b * 1000:.1f} ms x usage (fitted)"
        else:
            a = tuning.unfitted_fixed_share * s0
            b = (s0 - a) / u0
            source = f"{tuning.unfitted_fixed_share:.0%} of the step fixed (not fitted yet)"
        # The usage a replica runs at: where the step meets the goal, at
        # most the KV ceiling; the KV held scales with the step time there
        # (Little's law), from what is held now at step s0.
        target = min(max((goal - a) / b, 0.05), cap) if b > 0 else cap
        step_at = a + b * target
        itl = growth * load.usage * (step_at / s0) / target
        if load.load_ratio is not None and ahead is not None and s0 <= role.itl_target_seconds:
            # While the steps meet the target, the KV per unit of load over
            # the decode window is steadier than one period's snapshot of
            # the usage; past it, the snapshot says how far behind the
            # fleet is.
            itl = ahead.ahead * load.load_ratio * step_at / target
        source += f", {target:.2f} a replica"
        if load.waiting > 0 and load.running > 0:
            itl *= 1 + load.waiting / load.running
        detail += f"; steps {s0 * 1000:.1f} ms at {u0:.2f}, {source}"
        if itl > replicas and target < cap:
            replicas, code = itl, "itl_model"
        elif itl > replicas:
            replicas = itl
    detail += f"; ITL goal {goal * 1000:.1f} ms, KV at most {cap:.2f}"
    return Need(replicas * factor, code, detail)


# ---------------------------------------------------------------------------
# phase 4: step-limit


def step_limit(
    name: Role,
    role: RoleScaling,
    need: Need,
    view: RoleView,
    state: RoleState,
    now: float,
    tuning: PolicyTuning,
    floor: int,
    falling: bool = False,
    rising: bool = False,
) -> tuple[RoleDecision, RoleState]:
    """Phase 4: from the replicas needed to the count to run now.

    Up at once (within the up window's lowest, ``scaleUpStabilizationSeconds``,
    0 by default); down only when the down window's largest need with
    ``scale_down_headroom`` (:attr:`Need.down`) is below the current count,
    to that need; no
    scale-down while a replica's metrics are missing or replicas are
    starting (a missing sample's need is remembered as the current count,
    so a gap never shortens the window); never down in the first down window
    after the policy starts; then the steps per period and the bounds."""
    current = view.current
    since = state.since if state.since is not None else now
    # The down window: the spec's while the load falls decisively (a surge
    # ebbing, a day's decline), a longer one otherwise, so that a load that
    # only wanders is not followed down and back up.
    down_seconds = role.scale_down_stabilization_seconds
    if not falling:
        down_seconds *= tuning.steady_down_factor
    horizon = max(
        role.scale_up_stabilization_seconds,
        role.scale_down_stabilization_seconds * max(tuning.steady_down_factor, 1.0),
    )
    needs = [(t, v) for t, v in state.needs if now - t < horizon]
    code, why = need.code, ""
    desired = current
    lo, hi = max(role.min_replicas, floor), role.max_replicas
    if need.replicas is None:
        code, why = need.code, need.detail
    else:
        wanted = min(max(math.ceil(need.replicas - 1e-9), lo), hi)
        kept = need.down if need.down is not None else need.replicas
        leave = min(max(math.ceil(kept - 1e-9), wanted, lo), hi)
        # A missing sample's need is at least the current count: a gap never
        # shortens the down window.
        needs.append((now, float(leave if view.complete else max(leave, current))))
        why = f"{need.replicas:.2f} replicas needed"
        up_window = [v for t, v in needs if now - t < role.scale_up_stabilization_seconds]
        up = int(min([*up_window, wanted]))
        down = int(max(v for t, v in needs if now - t < down_seconds))
        reversal = (
            not rising
            and state.scaled_down is not None
            and now - state.scaled_down < tuning.dwell_seconds
            and need.replicas <= current + max(tuning.reversal_band * current, 1.0)
        )
        if up > current and reversal:
            # Within the dwell after a scale-down, and with no rise out of
            # the noise, only a need clearly above the count undoes it (the
            # models' margins cover a little more).
            code = "stabilization_window"
            why = (
                f"{why}; within {tuning.dwell_seconds:.0f} s of a scale-down, up only past "
                f"{tuning.reversal_band:.0%} (and a replica) more"
            )
        elif up > current:
            extra = round(up * tuning.scale_up_extra) if rising else 0
            desired = min(up + extra, hi)
            if up < wanted:
                code, why = "stabilization_window", f"{why}; {up} is the up window's lowest"
            elif desired > up:
                why = f"{why}; {desired - up} more for what comes next"
        elif down < current:
            least = max(1, round(current * tuning.scale_down_least))
            if current - down < least:
                code = "within_tolerance"
                why = f"{why}; {down} would do, but a scale-down removes at least {least}"
            elif now - since < role.scale_down_stabilization_seconds:
                code = "stabilization_window"
                why = f"{why}; no scale-down in the first {role.scale_down_stabilization_seconds:.0f} s"
            elif view.missing:
                code = "metrics_missing"
                why = f"{why}; holding: no fresh metrics from {', '.join(view.missing)}"
            elif view.starting:
                code = "replicas_starting"
                why = f"{why}; holding: {view.starting} replicas still starting"
            elif (
                state.scaled_up is not None
                and now - state.scaled_up < tuning.dwell_seconds
                and down > (state.up_need or current) * (1 - tuning.decisive_fall)
            ):
                # A scale-up is not undone within the dwell unless the load
                # has clearly fallen (a surge ebbing): the need's own noise
                # would otherwise reverse it.
                code = "stabilization_window"
                why = (
                    f"{why}; {down} would do, but within {tuning.dwell_seconds:.0f} s of a "
                    f"scale-up only a fall of {tuning.decisive_fall:.0%} scales down"
                )
            else:
                desired = down
                why = f"{why}; {down} hold {tuning.scale_down_headroom:.0%} more"
        elif wanted < current:
            code = "within_tolerance" if leave >= current else "stabilization_window"
            why = (
                f"{why}; {current} hold {tuning.scale_down_headroom:.0%} more"
                if leave >= current
                else f"{why}; the down window still needs {down}"
            )
        if desired > current + role.max_scale_up_step:
            desired = current + role.max_scale_up_step
            code, why = "step_limit", f"{why}; at most +{role.max_scale_up_step} per period"
        elif desired < current - role.max_scale_down_step:
            desired = current - role.max_scale_down_step
            code, why = "step_limit", f"{why}; at most -{role.max_scale_down_step} per period"
        if desired == hi and need.replicas > hi + 1e-9:
            code, why = "max_replicas", f"{why}; at maxReplicas {hi}"
        elif desired == lo and need.replicas < lo and desired != current:
            code, why = "min_replicas", f"{why}; at minReplicas {lo}"
        why = f"{why} ({need.detail})"
    if desired < lo or desired > hi:
        bound = lo if desired < lo else hi
        code = "min_replicas" if desired < lo else "max_replicas"
        desired, why = bound, f"{why}; clamped to {code.replace('_', ' ')} {bound}"
    decision = RoleDecision(
        name, current, desired, code, f"{name} {current} -> {desired}: {why}", now, need.replicas
    )
    scaled_up, up_need = state.scaled_up, state.up_need
    if desired > current:
        scaled_up, up_need = now, need.replicas
    scaled_down = now if desired < current else state.scaled_down
    return decision, RoleState(
        since=since,
        needs=tuple(needs),
        count=current,
        scaled_up=scaled_up,
        up_need=up_need,
        scaled_down=scaled_down,
    )


# ---------------------------------------------------------------------------
# phase 5: choose victims


def choose_victims(loads: Sequence[ReplicaLoad], count: int) -> list[str]:
    """Phase 5: the ``count`` replicas a scale-down drains: starting ones
    first, then idle ones, then the least loaded (in-flight work, KV, queued
    tokens); one with work in flight never while an idle one remains
    (:func:`.victims.choose_victims`)."""
    return _choose_victims(loads, count)


# ---------------------------------------------------------------------------
# startups (the forecast's lead)


def _startups(
    observation: FleetObservation,
    state: PolicyState,
    now: float,
    tuning: PolicyTuning,
    period: float,
) -> tuple[float | None, bool, tuple[tuple[str, float], ...]]:
    """How long replicas take from ``starting`` to ``ready``: (the estimate,
    whether it comes from a watched start, replicas starting).

    Watched, a start is first seen a period after it was requested, so the
    time learned is short by about a period (the lead adds it back). Until
    one has been watched, the startups that serving replicas report
    (``ReplicaSample.startup_seconds``, for a fleet started before the
    autoscaler saw it) give it, their low median less that period. A Pod
    whose readiness went away and came back reports the time to its latest
    Ready transition, longer than its cold start: the low median of several
    keeps one such report out, and the first watched start replaces them."""
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
# scale to zero


def _idle(obs: RoleObservation, view: RoleView, now: float, stale: float) -> bool:
    """No request arriving, queued or running on any replica of the role, and
    every replica ready with a fresh sample saying so."""
    if not view.complete or view.starting or obs.activations > 0:
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
    view: RoleView,
    need: Need,
    state: RoleState,
    now: float,
    tuning: PolicyTuning,
    stale: float,
    falling: bool = False,
    rising: bool = False,
) -> tuple[RoleDecision, RoleState]:
    """One role's decision, with ``minReplicas: 0`` handled here and only here:
    at zero, only the gateway's activation signal starts a replica; above
    zero, the load never takes the role below one replica, and the role goes
    to zero once idle for ``scaleToZeroAfterSeconds``."""
    if role.min_replicas > 0:
        return step_limit(
            name, role, need, view, state, now, tuning, role.min_replicas, falling, rising
        )
    if view.current == 0:
        # Nothing to measure: forget the windows, so that the first replica
        # back starts from its own samples.
        return _at_zero(name, role, obs, now), RoleState(since=state.since, count=0)
    decision, new_state = step_limit(name, role, need, view, state, now, tuning, 1, falling, rising)
    idle_since = None
    if _idle(obs, view, now, stale):
        idle_since = state.idle_since if state.idle_since is not None else now
    new_state = replace(new_state, idle_since=idle_since)
    if idle_since is not None and now - idle_since >= role.scale_to_zero_after_seconds:
        why = f"idle for {now - idle_since:.0f} s (scaleToZeroAfterSeconds {role.scale_to_zero_after_seconds:g})"
        decision = replace(
            decision, desired=0, code="idle", reason=f"{name} {view.current} -> 0: {why}"
        )
        new_state = RoleState(since=new_state.since, count=view.current)
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
    stale, period = spec.metrics_stale_seconds, spec.period_seconds
    startup, watched, starting_since = _startups(observation, state, now, tuning, period)
    # A start is first seen a period after it was requested (the time
    # learned is short by one), and capacity requested now must last until
    # the next decision's serves, a period later.
    lead = (startup + period if startup is not None else tuning.default_startup_seconds) + period
    lead = min(max(lead, tuning.min_lead_seconds), tuning.max_lead_seconds)

    p_view = _view(observation.prefill, now, stale)
    d_view = _view(observation.decode, now, stale)
    p_load, d_load, state = observe(
        spec, p_view, d_view, state, now, tuning, observation.decode.deferrable_running
    )
    ahead = forecast(state.rates, now, lead, tuning)
    up = 1 + tuning.scale_down_headroom
    ahead_d = ahead
    if ahead is not None and p_load.waiting > 0 and ahead.level > 0:
        # Requests queued at prefill reach decode as prefill catches up:
        # decode plans for them as arrivals over the backlog's drain.
        surplus = p_load.waiting / tuning.backlog_drain_seconds
        ahead_d = replace(ahead, ahead=ahead.ahead + surplus)
    p_need = size_prefill(spec, p_load, d_load, ahead, p_view, tuning)
    p_need = replace(
        p_need, down=size_prefill(spec, p_load, d_load, ahead, p_view, tuning, up).replicas
    )
    d_need = size_decode(spec, d_load, ahead_d, d_view, tuning)
    d_need = replace(d_need, down=size_decode(spec, d_load, ahead_d, d_view, tuning, up).replicas)
    falling = ahead is not None and ahead.falling
    rising = ahead is not None and ahead.rising
    p, p_state = _decide_role(
        "prefill",
        spec.prefill,
        observation.prefill,
        p_view,
        p_need,
        state.prefill,
        now,
        tuning,
        stale,
        falling,
        rising,
    )
    d, d_state = _decide_role(
        "decode",
        spec.decode,
        observation.decode,
        d_view,
        d_need,
        state.decode,
        now,
        tuning,
        stale,
        falling,
        rising,
    )
    p, d = _apply_ratio(spec, p, d)
    p, d = _apply_budget(spec, p, d)
    new_state = replace(
        state,
        prefill=p_state,
        decode=d_state,
        startup_seconds=startup,
        startup_watched=watched,
        starting_since=starting_since,
    )
    return PolicyResult(prefill=p, decode=d, state=new_state)
