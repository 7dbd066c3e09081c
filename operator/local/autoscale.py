"""The local actuator: the autoscaling policy applied to `pdfleet up`'s processes.

Once per ``periodSeconds``: scrape every engine's ``/metrics``, turn two
consecutive scrapes into the policy's samples, call the same pure
``decide()`` that the operator and ``pdfleet sim`` use, record the decisions
(log, metrics, bounded history), then start engines or drain the victims
``choose_victims`` names (stop routing, wait for in-flight work and KV leases,
bounded, then stop).
"""

from __future__ import annotations

import logging
import time

import httpx

from ..autoscaling.decisions import DecisionLog
from ..autoscaling.policy import FleetObservation, PolicyState, RoleObservation, decide
from ..autoscaling.samples import EngineSnapshot, parse_engine_metrics, sample_from_snapshots
from ..autoscaling.spec import AutoscalingSpec
from ..autoscaling.victims import ReplicaLoad, choose_victims
from .fleet import LocalFleet
from .process import Child

logger = logging.getLogger("pdfleet.up.autoscaler")


class LocalAutoscaler:
    def __init__(self, fleet: LocalFleet, spec: AutoscalingSpec, log: DecisionLog | None = None):
        self.fleet = fleet
        self.spec = spec
        self.state = PolicyState()
        self.log = log or DecisionLog()
        self.snapshots: dict[str, tuple[EngineSnapshot | None, EngineSnapshot | None]] = {}

    def _scrape(self, child: Child, now: float) -> EngineSnapshot | None:
        try:
            text = httpx.get(child.url + "/metrics", timeout=2.0).text
        except httpx.HTTPError:
            return None
        return parse_engine_metrics(text, now)

    def observe(self, now: float) -> FleetObservation:
        roles = {}
        for role in ("prefill", "decode"):
            samples = []
            for child in self.fleet.engines_of(role):
                state = (
                    "starting" if not child.ready else ("draining" if child.draining else "ready")
                )
                current = self._scrape(child, now) if child.ready else None
                _, previous = self.snapshots.get(child.name, (None, None))
                if current is not None:
                    self.snapshots[child.name] = (previous, current)
                samples.append(sample_from_snapshots(child.name, current, previous, state))
            roles[role] = RoleObservation(tuple(samples))
        return FleetObservation(**roles)

    def step(self, now: float | None = None) -> list:
        now = time.monotonic() if now is None else now
        result = decide(self.spec, self.observe(now), now, self.state)
        self.state = result.state
        records = self.log.record(result.decisions)
        for decision in result.decisions:
            if decision.role not in self.fleet.roles or decision.desired == decision.current:
                continue
            self.apply(decision.role, decision.desired)
        return records

    def apply(self, role: str, desired: int) -> None:
        active = self.fleet.role_engines(role)
        if desired > len(active):
            for _ in range(desired - len(active)):
                self.fleet.add_engine(role)
            return
        loads = []
        for child in active:
            snap = self.snapshots.get(child.name, (None, None))[1] if child.ready else None
            loads.append(
                ReplicaLoad(
                    name=child.name,
                    ready=child.ready,
                    in_flight=int((snap.num_running or 0) + (snap.num_waiting or 0)) if snap else 0,
                    kv_cache_usage=(snap.kv_cache_usage or 0.0) if snap else 0.0,
                    waiting_prompt_tokens=(snap.waiting_prompt_tokens or 0.0) if snap else 0.0,
                )
            )
        victims = set(choose_victims(loads, len(active) - desired))
        for child in active:
            if child.name in victims:
                self.fleet.drain(child)
