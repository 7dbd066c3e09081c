"""Which replicas to remove on scale-down.

The policy only says how many replicas a role should have; the actuator asks
:func:`choose_victims` which ones go, then drains them (stop routing to the
victim, let its in-flight work finish, bounded, then stop it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ReplicaLoad:
    """One replica's load as the actuator sees it."""

    name: str
    ready: bool = True
    """False while starting: removing it loses no work and no warm cache."""
    in_flight: int = 0
    """Requests running or waiting on it (and, for prefill, KV leases held)."""
    kv_cache_usage: float = 0.0
    waiting_prompt_tokens: float = 0


def choose_victims(replicas: Sequence[ReplicaLoad], count: int) -> list[str]:
    """Names of ``count`` replicas to drain, least loaded first.

    Order: replicas still starting, then idle ones, then by in-flight
    requests, KV usage and queued tokens; ties by name, so the choice is
    deterministic. A replica with in-flight work is therefore never chosen
    while an idle one remains.
    """
    if count < 0:
        raise ValueError(f"victim count must be >= 0, got {count}")
    if count > len(replicas):
        raise ValueError(f"cannot remove {count} of {len(replicas)} replicas")
    ranked = sorted(
        replicas,
        key=lambda r: (
            r.ready,
            r.in_flight > 0,
            r.in_flight,
            r.kv_cache_usage,
            r.waiting_prompt_tokens,
            r.name,
        ),
    )
    return [r.name for r in ranked[:count]]
