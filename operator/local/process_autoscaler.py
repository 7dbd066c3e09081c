"""``pdfleet up``'s adapter of the autoscaling loop: local engine processes.

Once per ``periodSeconds``: scrape every engine's ``/metrics`` and the
gateway's activation counter (requests that found no engine of a role), run one step
of the same :class:`~pdfleet.operator.autoscaling.control_loop.ScalingLoop`
the operator runs, record the decisions (log, metrics, bounded history),
then start engines or drain the victims the loop names (stop routing, wait
for in-flight work and KV leases, bounded, then stop). In mode ``Advisory``
it records them as not applied and changes nothing.

The fleet is reached only through :class:`ScalableFleet`, so this module and
``fleet.py`` do not import each other: ``pdfleet up`` hands the fleet in.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

from ..autoscaling.control_loop import (
    ROLES,
    ActivationCounter,
    ReplicaScrape,
    ScalingLoop,
    gateway_batch_running,
    parse_gateway_activations,
    parse_gateway_batch_running,
)
from ..autoscaling.decisions import DecisionLog
from ..autoscaling.samples import EngineSnapshot, ReplicaState, parse_engine_metrics
from ..autoscaling.spec import AutoscalingSpec
from .process import Child

logger = logging.getLogger("pdfleet.up.autoscaler")


class ScalableFleet(Protocol):
    """What the autoscaler needs of a local fleet (``LocalFleet`` has it)."""

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles it runs (decode only when not disaggregating)."""
        ...

    def engines_of(self, role: str) -> list[Child]:
        """Every engine of ``role`` still running: starting, ready or draining."""
        ...

    def add_engine(self, role: str) -> Child:
        """Start one more engine of ``role`` (it joins routing once ready)."""
        ...

    def drain(self, child: Child) -> Any:
        """Stop routing to ``child``; stop it once idle (bounded wait)."""
        ...

    def gateway_metrics_text(self) -> str | None:
        """The gateway's ``/metrics`` text, or None when it does not answer."""
        ...


def _state(child: Child) -> ReplicaState:
    if not child.ready:
        return "starting"
    return "draining" if child.draining else "ready"


class LocalAutoscaler:
    def __init__(
        self, fleet: ScalableFleet, spec: AutoscalingSpec, log: DecisionLog | None = None
    ) -> None:
        self.fleet = fleet
        self.spec = spec
        self.loop = ScalingLoop()
        self.log = log or DecisionLog()
        self.activations = ActivationCounter()

    def _gateway_totals(self, text: str | None = None) -> dict[str, dict[str, float]]:
        text = self.fleet.gateway_metrics_text() if text is None else text
        if text is None:
            return {}
        try:
            return {"gateway": parse_gateway_activations(text)}
        except ValueError:
            return {}

    @staticmethod
    def _batch_running(text: str | None) -> float:
        if text is None:
            return 0.0
        try:
            return gateway_batch_running([parse_gateway_batch_running(text)])
        except ValueError:
            return 0.0

    def activation_pending(self) -> bool:
        """Whether a role at zero replicas has had requests wanting it since the
        last step: the caller then steps at once instead of waiting for the
        period, so the first request after scale-to-zero waits one cold start,
        not a period more. Scrapes only the gateway, and only while a role
        that may scale to zero has no engine."""
        at_zero = {
            role
            for role in self.fleet.roles
            if self.spec.role(role).min_replicas == 0
            and not [c for c in self.fleet.engines_of(role) if not c.draining]
        }
        if not at_zero:
            return False
        return bool(self.activations.pending(self._gateway_totals()) & at_zero)

    def _scrape(self, child: Child, now: float) -> EngineSnapshot | None:
        # The child's own scrape presents the fleet token (engines require it).
        text = child.metrics_text(timeout=2.0)
        if text is None:
            return None
        try:
            return parse_engine_metrics(text, now)
        except ValueError:
            return None

    def step(self, now: float | None = None) -> list[Any]:
        """One period: scrape, decide, act; returns the decision records."""
        now = time.monotonic() if now is None else now
        scrapes = [
            ReplicaScrape(
                child.name,
                role,
                _state(child),
                self._scrape(child, now) if child.ready else None,
                child.startup_seconds,
            )
            for role in ROLES
            for child in self.fleet.engines_of(role)
        ]
        gateway = self.fleet.gateway_metrics_text()
        activations = self.activations.update(self._gateway_totals(gateway))
        step = self.loop.step(
            self.spec,
            scrapes,
            now,
            activations=activations,
            batch_running=self._batch_running(gateway),
        )
        # The loop decides for every role; a fleet that does not disaggregate
        # runs decode only, and a decision for a role it does not run is
        # neither carried out nor reported.
        roles = self.fleet.roles
        decisions = [d for d in step.result.decisions if d.role in roles]
        records = self.log.record(decisions, self.spec.mode)
        if self.spec.mode == "Advisory":
            return records  # computed and reported (log, metrics, fleet.json), not carried out
        by_name = {c.name: c for role in roles for c in self.fleet.engines_of(role)}
        for action in step.actions:
            if action.role not in roles:
                continue
            for _ in range(action.desired - action.current):
                self.fleet.add_engine(action.role)
            for name in action.victims:
                if name in by_name:
                    self.fleet.drain(by_name[name])
        return records
