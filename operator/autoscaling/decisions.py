"""Decision records, their bounded history, and the autoscaler's Prometheus metrics.

The actuators (local processes for ``pdfleet up``, replica patches for the
Kubernetes operator) call :meth:`DecisionLog.record` with every
:class:`~pdfleet.operator.autoscaling.policy.RoleDecision` the policy returns;
the log keeps the changes for ``status.autoscaling.lastDecisions`` and counts
every decision in the metrics.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ...engine.contracts import metrics as m
from .policy import RoleDecision

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecisionRecord:
    """One decision as kept in the history and shown in the resource's status."""

    role: str
    from_replicas: int
    to_replicas: int
    reason: str
    code: str
    time: float
    """Seconds since the epoch (or the caller's clock)."""
    applied: bool = True
    """False in mode Advisory: computed and reported, not carried out."""

    @classmethod
    def of(cls, decision: RoleDecision, applied: bool = True) -> DecisionRecord:
        return cls(
            role=decision.role,
            from_replicas=decision.current,
            to_replicas=decision.desired,
            reason=decision.reason,
            code=decision.code,
            time=decision.time,
            applied=applied,
        )

    @property
    def direction(self) -> str:
        if self.to_replicas > self.from_replicas:
            return "up"
        return "down" if self.to_replicas < self.from_replicas else "none"

    def to_dict(self) -> dict[str, Any]:
        """The status shape: ``{role, from, to, reason, code, time, applied}``."""
        return {
            "role": self.role,
            "from": self.from_replicas,
            "to": self.to_replicas,
            "reason": self.reason,
            "code": self.code,
            "time": self.time,
            "applied": self.applied,
        }


class DecisionHistory:
    """The latest ``capacity`` records, oldest first (a ring buffer)."""

    def __init__(self, capacity: int = 50) -> None:
        if capacity < 1:
            raise ValueError(f"decision history capacity must be >= 1, got {capacity}")
        self._records: deque[DecisionRecord] = deque(maxlen=capacity)

    def append(self, record: DecisionRecord) -> None:
        self._records.append(record)

    def __iter__(self) -> Iterator[DecisionRecord]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def latest(self, n: int | None = None) -> list[DecisionRecord]:
        """The newest ``n`` records (all when None), oldest first."""
        records = list(self._records)
        return records if n is None else records[-n:] if n > 0 else []


class AutoscalerMetrics:
    """The autoscaler's series, registered on the registry the caller owns.

    * ``pdfleet_autoscaler_desired_replicas{role,mode}`` (gauge)
    * ``pdfleet_autoscaler_decisions_total{role,direction,reason,mode}``
      (counter; every decision, ``direction="none"`` included, so holds are
      visible)

    ``mode`` is the spec's: ``Active`` (carried out) or ``Advisory``
    (reported only).
    """

    def __init__(self, registry: Any) -> None:
        self.desired_replicas = m.AUTOSCALER_DESIRED_REPLICAS.create(registry)
        self.decisions = m.AUTOSCALER_DECISIONS.create(registry)

    def observe(self, decision: RoleDecision, mode: str = "Active") -> None:
        # Label values in the order of the series' label names (the contract's).
        self.desired_replicas.labels(decision.role, mode).set(decision.desired)
        self.decisions.labels(decision.role, decision.direction, decision.code, mode).inc()


class DecisionLog:
    """Logs, counts and keeps decisions: what an actuator calls once per decision.

    Only changes (``direction != "none"``) enter the history; holds are logged
    at debug level and counted.
    """

    def __init__(self, metrics: AutoscalerMetrics | None = None, capacity: int = 50) -> None:
        self.metrics = metrics
        self.history = DecisionHistory(capacity)

    def record(
        self, decisions: Iterable[RoleDecision], mode: str = "Active"
    ) -> list[DecisionRecord]:
        """Record decisions; returns the records added to the history. In mode
        ``Advisory`` the records say they were not applied."""
        added = []
        applied = mode != "Advisory"
        for decision in decisions:
            if self.metrics is not None:
                self.metrics.observe(decision, mode)
            if decision.direction == "none":
                logger.debug("autoscaler: %s", decision.reason)
                continue
            if applied:
                logger.info("autoscaler: %s", decision.reason)
            else:
                logger.info("autoscaler (advisory, not applied): %s", decision.reason)
            record = DecisionRecord.of(decision, applied)
            self.history.append(record)
            added.append(record)
        return added
