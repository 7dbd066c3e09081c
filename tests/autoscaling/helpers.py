"""Builders for policy inputs."""

from __future__ import annotations

from pdfleet.operator.autoscaling.policy import FleetObservation, RoleObservation
from pdfleet.operator.autoscaling.samples import ReplicaSample

PERIOD = 15.0


def decode(name: str, t: float, kv: float = 0.0, running: float = 0, waiting: float = 0, **kw):
    """A ready decode replica's sample taken at ``t``."""
    return ReplicaSample(
        name=name,
        time=t,
        kv_cache_usage=kv,
        num_running=running,
        num_waiting=waiting,
        interval_seconds=PERIOD,
        **kw,
    )


def prefill(
    name: str,
    t: float,
    arrivals: float = 0.0,
    queued: float = 0.0,
    busy: float | None = None,
    rate: float = 10_000.0,
    **kw,
):
    """A ready prefill replica's sample at ``t``: ``arrivals`` prompt tokens/s
    arriving, ``queued`` tokens waiting, computing at ``rate`` tokens/s."""
    busy = min(arrivals / rate, 1.0) if busy is None else busy
    return ReplicaSample(
        name=name,
        time=t,
        waiting_prompt_tokens=queued,
        interval_seconds=PERIOD,
        prompt_tokens_per_second=busy * rate,
        prompt_token_arrivals_per_second=arrivals,
        prefill_busy_fraction=busy,
        **kw,
    )


def starting(name: str) -> ReplicaSample:
    return ReplicaSample(name=name, state="starting")


def fleet(prefills=(), decodes=(), prefill_requested=None, decode_requested=None):
    return FleetObservation(
        prefill=RoleObservation(tuple(prefills), prefill_requested),
        decode=RoleObservation(tuple(decodes), decode_requested),
    )


def idle_prefill(t: float, n: int = 1):
    """``n`` idle prefill replicas: keeps the prefill role steady while a test
    exercises decode."""
    return [prefill(f"p{i}", t) for i in range(n)]
