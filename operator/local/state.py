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

Each file has one carrier here, written and read through it:
:class:`FleetState` (``fleet.json``) and :class:`ApplyRequest`
(``apply-request.json``). They are not engine contracts: only `pdfleet up`,
`pdfleet status` and `pdfleet apply` write and read them, on one machine.
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


def _field(name: str, why: str) -> ValueError:
    return ValueError(f"{name}: {why}")


def _str(data: dict[str, Any], key: str, where: str) -> str:
    value = data.get(key)
    if not isinstance(value, str):
        raise _field(f"{where}{key}", "missing or not a string")
    return value


def _int(value: Any, name: str, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if type(value) is not int:
        raise _field(name, "not an integer")
    return value


def _object(value: Any, name: str, known: frozenset[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _field(name, "not an object")
    for key in value:
        if key not in known:
            raise _field(f"{name}.{key}" if name else str(key), "unknown field")
    return value


@dataclass(frozen=True)
class SupervisorInfo:
    """The ``pdfleet up`` process: its pid and its start time (clock ticks since
    boot; None when it could not be read), which tell it from a later process
    that reused the pid."""

    pid: int
    start_ticks: int | None


@dataclass(frozen=True)
class GatewayInfo:
    url: str
    state: str
    """starting, ready, draining, down or stopped."""


@dataclass(frozen=True)
class ChildInfo:
    """One engine process of the fleet."""

    name: str
    role: str
    url: str
    state: str
    """starting, ready, draining, down or stopped."""
    restarts: int = 0


@dataclass(frozen=True)
class ApplyReport:
    """The latest `pdfleet apply`: its request's id, ``rolling``, ``done`` or
    ``failed``, the outcome's message and the steps so far."""

    id: str
    state: str
    message: str = ""
    steps: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "state": self.state,
            "message": self.message,
            "steps": list(self.steps),
        }


_FLEET_FIELDS = frozenset({"service", "supervisor", "gateway", "engines", "lastDecisions", "apply"})


@dataclass(frozen=True)
class FleetState:
    """``fleet.json``: what `pdfleet up` tells `pdfleet status` and `pdfleet
    apply` of its fleet. It lives here, not in the engine's contracts: only
    pdfleet's local commands write and read it, on one machine.

    ``last_decisions`` are the autoscaler's decision records as
    ``status.autoscaling.lastDecisions`` has them (``operator/autoscaling``
    owns their shape; they are shown, not interpreted). A file with no
    ``supervisor`` (an older one) is trusted as it is."""

    service: str
    gateway: GatewayInfo
    engines: tuple[ChildInfo, ...]
    supervisor: SupervisorInfo | None = None
    last_decisions: tuple[dict[str, Any], ...] = ()
    apply: ApplyReport | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"service": self.service}
        if self.supervisor is not None:
            out["supervisor"] = {
                "pid": self.supervisor.pid,
                "startTicks": self.supervisor.start_ticks,
            }
        out["gateway"] = {"url": self.gateway.url, "state": self.gateway.state}
        out["engines"] = [
            {"name": c.name, "role": c.role, "url": c.url, "state": c.state, "restarts": c.restarts}
            for c in self.engines
        ]
        out["lastDecisions"] = list(self.last_decisions)
        out["apply"] = self.apply.to_json() if self.apply is not None else None
        return out

    def encode(self) -> str:
        """The file's text (indented: people read it)."""
        return json.dumps(self.to_json(), indent=2)

    @classmethod
    def decode(cls, text: str) -> FleetState:
        """The state of the file's text; ValueError naming the field
        (``engines[1].state``, ``apply.steps``...)."""
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"not JSON: {e}") from None
        data = _object(data, "", _FLEET_FIELDS)
        sup = data.get("supervisor")
        supervisor = None
        if sup is not None:
            sup = _object(sup, "supervisor", frozenset({"pid", "startTicks"}))
            supervisor = SupervisorInfo(
                _int(sup.get("pid"), "supervisor.pid"),
                _int(sup.get("startTicks"), "supervisor.startTicks", optional=True),
            )
        gw = _object(data.get("gateway"), "gateway", frozenset({"url", "state"}))
        engines = data.get("engines")
        if not isinstance(engines, list):
            raise _field("engines", "missing or not a list")
        children = []
        for i, item in enumerate(engines):
            where = f"engines[{i}]"
            entry = _object(item, where, frozenset({"name", "role", "url", "state", "restarts"}))
            children.append(
                ChildInfo(
                    _str(entry, "name", where + "."),
                    _str(entry, "role", where + "."),
                    _str(entry, "url", where + "."),
                    _str(entry, "state", where + "."),
                    _int(entry.get("restarts", 0), where + ".restarts"),
                )
            )
        decisions = data.get("lastDecisions") or []
        if not isinstance(decisions, list) or not all(isinstance(d, dict) for d in decisions):
            raise _field("lastDecisions", "not a list of objects")
        apply = None
        if data.get("apply") is not None:
            a = _object(data["apply"], "apply", frozenset({"id", "state", "message", "steps"}))
            steps = a.get("steps") or []
            if not isinstance(steps, list) or not all(isinstance(s, str) for s in steps):
                raise _field("apply.steps", "not a list of strings")
            message = a.get("message") or ""
            if not isinstance(message, str):
                raise _field("apply.message", "not a string")
            apply = ApplyReport(
                _str(a, "id", "apply."), _str(a, "state", "apply."), message, tuple(steps)
            )
        return cls(
            _str(data, "service", ""),
            GatewayInfo(_str(gw, "url", "gateway."), _str(gw, "state", "gateway.")),
            tuple(children),
            supervisor,
            tuple(decisions),
            apply,
        )


def read_state(run: Path) -> FleetState:
    """The run's ``fleet.json``; ValueError naming the file (and the field) when
    it cannot be read."""
    path = run / STATE_FILE
    try:
        return FleetState.decode(path.read_text())
    except PermissionError:
        raise ValueError(
            f"cannot read {path} (its owner's only): run the command "
            "as the user who ran `pdfleet up`"
        ) from None
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


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


def supervisor_alive(state: FleetState) -> bool:
    """Whether the ``pdfleet up`` that wrote ``state`` still runs."""
    sup = state.supervisor
    if sup is None:
        return True  # an older file: nothing to check, trust its states
    now = process_start_ticks(sup.pid)
    return now is not None and (sup.start_ticks is None or now == sup.start_ticks)


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
    apply: ApplyReport | None = None,
) -> FleetState:
    gateway = fleet.gateway
    pid = os.getpid()

    def state(child: Child) -> str:
        return STOPPED if stopped else child_state(child)

    return FleetState(
        fleet.service.name,
        GatewayInfo(
            gateway.url if gateway else fleet.gateway_url,
            state(gateway) if gateway else (STOPPED if stopped else "starting"),
        ),
        tuple(
            ChildInfo(c.name, c.role, c.url, state(c), c.restarts)
            for c in fleet.all_children()
            if c.role != "gateway"
        ),
        SupervisorInfo(pid, process_start_ticks(pid)),
        tuple(decisions),
        apply,
    )


class FleetStateWriter:
    """Writes ``fleet.json`` in the run directory, only when its content changed."""

    def __init__(self, fleet: FleetView) -> None:
        self.fleet = fleet
        self.path = fleet.run_dir / STATE_FILE
        self._last = ""
        self.apply: Any = None
        """The latest apply's status (an object with ``report()``), or None."""

    def write(self, autoscaler: Any = None, stopped: bool = False) -> None:
        """Rewrite the file when its content changed; ``stopped``: every process
        of the fleet has been stopped (the last write of a run)."""
        if not self.path.parent.is_dir():
            return  # the fleet has not created its run directory yet
        history = autoscaler.log.history.latest(10) if autoscaler is not None else []
        decisions = [r.to_dict() for r in history]
        apply = self.apply.report() if self.apply is not None else None
        text = fleet_state(self.fleet, decisions, stopped, apply).encode()
        if text == self._last:
            return
        write_private(self.path, text)
        self._last = text
