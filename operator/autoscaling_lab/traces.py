"""Seeded synthetic request traces for the fleet simulator.

A trace is a sorted list of requests (arrival time, prompt tokens, output
tokens) drawn from a time-varying Poisson process, plus the rate function it
was drawn from (the oracle strategy reads both). Four shapes:

* ``steady``  -- a constant rate.
* ``diurnal`` -- one sinusoidal "day" per trace: the rate swings between
  ``1 - amplitude`` and ``1 + amplitude`` times the base rate.
* ``burst``   -- the base rate plus surges about every ``burst_every_seconds``
  (each gap drawn within +-25% of it, the first within the first gap): each
  multiplies the rate by a factor drawn from ``burst_factor``, rises linearly
  over ``burst_ramp_seconds``, holds for a duration drawn from
  ``burst_seconds`` and falls back over the same ramp.
* ``heavytail`` -- the diurnal rate with heavy-tailed prompts: a mix of short
  chat turns (log-normal around ``chat_tokens_mean``) and, with probability
  ``document_share``, long documents (log-normal around
  ``document_tokens_mean``). A few documents can fill a prefill queue alone.

Prompt and output lengths are log-normal with the given means, clipped.
"""

from __future__ import annotations

import bisect
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

TraceKind = Literal["steady", "diurnal", "burst", "heavytail"]
TRACE_KINDS: tuple[str, ...] = ("burst", "diurnal", "steady", "heavytail")


@dataclass(frozen=True)
class TraceConfig:
    kind: TraceKind = "burst"
    """Shape of the request rate over time: steady, diurnal, burst or heavytail
    (diurnal rate, chat turns mixed with long documents)."""
    duration_seconds: float = 3600.0
    """Simulated seconds."""
    base_rate: float = 12.0
    """Requests per second outside surges (the mean rate for ``diurnal``)."""
    seed: int = 0
    """Trace and simulation seed."""
    prompt_tokens_mean: float = 1500.0
    """Mean prompt length in tokens."""
    prompt_tokens_sigma: float = 0.8
    """Log-normal shape of prompt lengths (sigma of the underlying normal)."""
    prompt_tokens_max: int = 16384
    """Longest prompt drawn, in tokens."""
    output_tokens_mean: float = 300.0
    """Mean output length in tokens."""
    output_tokens_sigma: float = 0.8
    """Log-normal shape of output lengths."""
    output_tokens_max: int = 4096
    """Longest output drawn, in tokens."""
    diurnal_amplitude: float = 0.6
    """Diurnal trace: the rate swings between 1 - this and 1 + this times the base."""
    burst_every_seconds: float = 1200.0
    """Mean gap between surge starts."""
    burst_factor: tuple[float, float] = (2.5, 4.0)
    """Surge rate as a multiple of the base rate, drawn from [LOW, HIGH]."""
    burst_seconds: tuple[float, float] = (60.0, 240.0)
    """Seconds a surge holds its peak, drawn from [LOW, HIGH]."""
    burst_ramp_seconds: float = 300.0
    """Seconds a surge takes to rise (and to fall)."""
    chat_tokens_mean: float = 400.0
    """Heavytail trace: mean prompt length of a chat turn."""
    document_tokens_mean: float = 8000.0
    """Heavytail trace: mean prompt length of a document."""
    document_share: float = 0.15
    """Heavytail trace: probability that a request is a document."""

    def __post_init__(self) -> None:
        if self.kind not in TRACE_KINDS:
            raise ValueError(f"trace must be one of {', '.join(TRACE_KINDS)}, got {self.kind!r}")
        if not 0 <= self.document_share <= 1:
            raise ValueError(f"document share must be in [0, 1], got {self.document_share}")
        if self.duration_seconds <= 0:
            raise ValueError(f"--duration must be > 0, got {self.duration_seconds}")
        if self.base_rate <= 0:
            raise ValueError(f"--rate must be > 0, got {self.base_rate}")
        if not 0 <= self.diurnal_amplitude < 1:
            raise ValueError(f"diurnal amplitude must be in [0, 1), got {self.diurnal_amplitude}")
        lo, hi = self.burst_factor
        if not 1 <= lo <= hi:
            raise ValueError(f"--burst-factor needs 1 <= low <= high, got {lo}, {hi}")
        lo, hi = self.burst_seconds
        if not 0 < lo <= hi:
            raise ValueError(f"--burst-seconds needs 0 < low <= high, got {lo}, {hi}")
        if self.burst_ramp_seconds < 0 or self.burst_every_seconds <= 0:
            raise ValueError("burst ramp must be >= 0 and burst gap > 0")
        for name in (
            "prompt_tokens_mean",
            "output_tokens_mean",
            "chat_tokens_mean",
            "document_tokens_mean",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass(frozen=True)
class Burst:
    start: float
    factor: float
    hold: float
    ramp: float

    def extra(self, t: float) -> float:
        """Added multiple of the base rate at time ``t`` (0 outside the burst)."""
        x = t - self.start
        if x < 0:
            return 0.0
        up, top = self.ramp, self.ramp + self.hold
        if x < up:
            return (self.factor - 1) * x / up
        if x < top:
            return self.factor - 1
        if x < top + self.ramp:
            return (self.factor - 1) * (1 - (x - top) / self.ramp)
        return 0.0


@dataclass
class Trace:
    config: TraceConfig
    arrivals: list[float]
    prompt_tokens: list[int]
    output_tokens: list[int]
    bursts: list[Burst]
    rate: Callable[[float], float]
    """Expected requests per second at time t."""

    def __len__(self) -> int:
        return len(self.arrivals)

    def between(self, start: float, end: float) -> range:
        """Indices of requests arriving in [start, end)."""
        return range(
            bisect.bisect_left(self.arrivals, start), bisect.bisect_left(self.arrivals, end)
        )


def _lognormal(rng: random.Random, mean: float, sigma: float, cap: int) -> int:
    mu = math.log(mean) - sigma * sigma / 2
    return max(1, min(cap, round(rng.lognormvariate(mu, sigma))))


def make_trace(config: TraceConfig, bursts: Sequence[Burst] | None = None) -> Trace:
    """Draw a trace; the same config (seed included) gives the same trace.

    ``bursts`` replaces the drawn surges of a ``burst`` trace (to place them
    by hand).
    """
    rng = random.Random(config.seed)
    duration, base = config.duration_seconds, config.base_rate
    if bursts is not None:
        bursts = list(bursts)
    elif config.kind == "burst":
        bursts = []
        every = config.burst_every_seconds
        t = every * rng.uniform(0.25, 0.75)
        while t < duration:
            bursts.append(
                Burst(
                    start=t,
                    factor=rng.uniform(*config.burst_factor),
                    hold=rng.uniform(*config.burst_seconds),
                    ramp=config.burst_ramp_seconds,
                )
            )
            t += every * rng.uniform(0.75, 1.25)
    else:
        bursts = []

    if config.kind in ("diurnal", "heavytail"):
        amp = config.diurnal_amplitude

        def rate(t: float) -> float:
            # Starts at the trough ("night"), peaks mid-trace.
            return base * (1 - amp * math.cos(2 * math.pi * t / duration))

        peak = base * (1 + amp)
    elif bursts:

        def rate(t: float) -> float:
            return base * (1 + sum(b.extra(t) for b in bursts))  # noqa: S610 (a burst's own extra(), not Django's)

        # The rate is piecewise linear: its maximum is at a breakpoint (just
        # before one, where a surge without ramp ends).
        corners = [
            b.start + dt
            for b in bursts
            for dt in (0.0, b.ramp, b.ramp + b.hold - 1e-6, 2 * b.ramp + b.hold - 1e-6)
        ]
        peak = max([base, *(rate(t) for t in corners)])
    else:

        def rate(t: float) -> float:
            return base

        peak = base

    # Thinning: candidates at the peak rate, kept with probability rate/peak.
    arrivals: list[float] = []
    t = 0.0
    while True:
        t += rng.expovariate(peak)
        if t >= duration:
            break
        if rng.random() * peak < rate(t):
            arrivals.append(t)
    if config.kind == "heavytail":
        cap = config.prompt_tokens_max
        prompts = [
            _lognormal(rng, config.document_tokens_mean, 0.5, cap)
            if rng.random() < config.document_share
            else _lognormal(rng, config.chat_tokens_mean, 0.6, cap)
            for _ in arrivals
        ]
    else:
        prompts = [
            _lognormal(
                rng, config.prompt_tokens_mean, config.prompt_tokens_sigma, config.prompt_tokens_max
            )
            for _ in arrivals
        ]
    outputs = [
        _lognormal(
            rng, config.output_tokens_mean, config.output_tokens_sigma, config.output_tokens_max
        )
        for _ in arrivals
    ]
    return Trace(config, arrivals, prompts, outputs, bursts, rate)
