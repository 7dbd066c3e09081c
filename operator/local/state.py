"""The run directory's ``fleet.json`` and ``fleet-secret``: what `pdfleet status`
reads of a local fleet.

``engines.json`` (the gateway's discovery file) lists only routable engines;
``fleet.json`` lists every child with its state (starting, ready, draining,
down; all ``stopped`` once ``pdfleet up`` has stopped them), the autoscaler's
latest decisions and the supervisor's pid and start time, rewritten only when
it changes. A reader tells a fleet whose supervisor died (SIGKILL, a reboot)
from a live one by that pid: :func:`supervisor_alive`. ``fleet-secret`` holds
the run's fleet secret, readable by its owner only (0600), so that `pdfleet
status` run by the same user presents the engines' token with no setup.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # `pdfleet status` imports STATE_FILE without the fleet's imports
    from ..resource import InferenceService
    from .process import Child

STATE_FILE = "fleet.json"
SECRET_FILE = "fleet-secret"
APPLY_FILE = "apply-request.json"
"""Where `pdfleet apply` leaves the new resource (owner-only) before it sends the
supervisor SIGHUP (an :class:`ApplyRequest`); the supervisor reports in
fleet.json's ``apply``."""
STOPPED = "stopped"


@dataclass(frozen=True)
class ApplyRequest:
    """The apply request file, ``{"id": ..., "resource": {...}}``: the id
    `pdfleet apply` follows in fleet.json's ``apply``, and the new
    InferenceService document (checked by the supervisor's resource parser).
    `pdfleet apply` writes it and `pdfleet up` reads it, both on this machine
    and of one pdfleet: it lives here, not in the engine's contracts."""

    id: str
    resource: dict[str, Any]

    def encode(self) -> str:
        return json.dumps({"id": self.id, "resource": self.resource})

    @classmethod
    def decode(cls, text: str) -> ApplyRequest:
        """The request of the file's text; ValueError naming the field."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"malformed apply request: not JSON: {e}") from None
        if not isinstance(data, dict):
            raise ValueError("malformed apply request: not a JSON object")
        unknown = sorted(set(data) - {"id", "resource"})
        if unknown:
            raise ValueError(f"malformed apply request: {unknown[0]}: unknown field")
        ident, resource = data.get("id"), data.get("resource")
        if not isinstance(ident, str) or not ident:
            raise ValueError("malformed apply request: id: missing or not a string")
        if not isinstance(resource, dict):
            raise ValueError("malformed apply request: resource: missing or not an object")
        return cls(ident, resource)


def find_run(run_dir: Path) -> Path:
    """``run_dir`` itself when it is a run, else its newest run (ValueError if none)."""
    if (run_dir / STATE_FILE).exists():
        return run_dir
    runs = sorted(run_dir.glob(f"*/{STATE_FILE}"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise ValueError(
            f"no pdfleet up run in {run_dir} (no */{STATE_FILE}); give --run-dir the "
            "directory `pdfleet up --run-dir` used"
        )
    return runs[-1].parent


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically, readable and writable by the owner only
    (0600 from creation: the bytes are never readable by anyone else)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an old tmp file keeps its mode through O_CREAT
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)


def process_start_ticks(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc/PID/stat field 22), or None
    when there is no such process: with the pid it names one process, never a
    later process that reused the pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] in ("Z", "X"):  # exited, not yet reaped
        return None
    return int(fields[19])


def supervisor_alive(state: dict[str, Any]) -> bool:
    """Whether the ``pdfleet up`` that wrote ``state`` still runs."""
    sup = state.get("supervisor") or {}
    pid, ticks = sup.get("pid"), sup.get("startTicks")
    if not isinstance(pid, int):
        return True  # an older file: nothing to check, trust its states
    now = process_start_ticks(pid)
    return now is not None and (ticks is None or now == ticks)


class FleetView(Protocol):
    """What the state file reads of a fleet (``fleet.LocalFleet`` is one; the
    fleet imports this module, not the other way round)."""

    @property
    def service(self) -> InferenceService: ...

    @property
    def run_dir(self) -> Path: ...

    @property
    def gateway(self) -> Child | None: ...

    @property
    def gateway_url(self) -> str: ...

    def all_children(self) -> Sequence[Child]: ...


def child_state(child: Child) -> str:
    if child.stopping or not child.alive():
        return "down"
    if child.draining:
        return "draining"
    return "ready" if child.ready else "starting"


def fleet_state(
    fleet: FleetView,
    decisions: list[dict[str, Any]],
    stopped: bool = False,
    apply: dict[str, Any] | None = None,
) -> dict[str, Any]:
    gateway = fleet.gateway
    pid = os.getpid()

    def state(child: Child) -> str:
        return STOPPED if stopped else child_state(child)

    return {
        "service": fleet.service.name,
        "supervisor": {"pid": pid, "startTicks": process_start_ticks(pid)},
        "gateway": {
            "url": gateway.url if gateway else fleet.gateway_url,
            "state": state(gateway) if gateway else (STOPPED if stopped else "starting"),
        },
        "engines": [
            {
                "name": c.name,
                "role": c.role,
                "url": c.url,
                "state": state(c),
                "restarts": c.restarts,
            }
            for c in fleet.all_children()
            if c.role != "gateway"
        ],
        "lastDecisions": decisions,
        "apply": apply,
    }


class FleetStateWriter:
    """Writes ``fleet.json`` in the run directory, only when its content changed."""

    def __init__(self, fleet: FleetView) -> None:
        self.fleet = fleet
        self.path = fleet.run_dir / STATE_FILE
        self._last = ""
        self.apply: Any = None
        """The latest apply's status (an object with ``to_dict()``), or None."""

    def write(self, autoscaler: Any = None, stopped: bool = False) -> None:
        """Rewrite the file when its content changed; ``stopped``: every process
        of the fleet has been stopped (the last write of a run)."""
        if not self.path.parent.is_dir():
            return  # the fleet has not created its run directory yet
        history = autoscaler.log.history.latest(10) if autoscaler is not None else []
        decisions = [r.to_dict() for r in history]
        apply = self.apply.to_dict() if self.apply is not None else None
        text = json.dumps(fleet_state(self.fleet, decisions, stopped, apply), indent=2)
        if text == self._last:
            return
        write_private(self.path, text)
        self._last = text
