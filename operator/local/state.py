"""The run directory's ``fleet.json``: what `pdfleet status` reads of a local fleet.

``engines.json`` (the gateway's discovery file) lists only routable engines;
``fleet.json`` lists every child with its state (starting, ready, draining,
down) and the autoscaler's latest decisions, rewritten only when it changes.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # `pdfleet status` imports STATE_FILE without the fleet's imports
    from .fleet import LocalFleet
    from .process import Child

STATE_FILE = "fleet.json"


def child_state(child: Child) -> str:
    if child.stopping or not child.alive():
        return "down"
    if child.draining:
        return "draining"
    return "ready" if child.ready else "starting"


def fleet_state(fleet: LocalFleet, decisions: list[dict[str, Any]]) -> dict[str, Any]:
    gateway = fleet.gateway
    return {
        "service": fleet.service.name,
        "gateway": {
            "url": gateway.url if gateway else None,
            "state": child_state(gateway) if gateway else "starting",
        },
        "engines": [
            {
                "name": c.name,
                "role": c.role,
                "url": c.url,
                "state": child_state(c),
                "restarts": c.restarts,
            }
            for c in fleet.all_children()
            if c.role != "gateway"
        ],
        "lastDecisions": decisions,
    }


class FleetStateWriter:
    """Writes ``fleet.json`` in the run directory, only when its content changed."""

    def __init__(self, fleet: LocalFleet) -> None:
        self.fleet = fleet
        self.path = fleet.run_dir / STATE_FILE
        self._last = ""

    def write(self, autoscaler: Any = None) -> None:
        history = autoscaler.log.history.latest(10) if autoscaler is not None else []
        text = json.dumps(fleet_state(self.fleet, [r.to_dict() for r in history]), indent=2)
        if text == self._last:
            return
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # owner-only
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, self.path)
        self._last = text
