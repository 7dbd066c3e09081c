"""``pdfleet apply``'s other half: a changed InferenceService applied to a running
local fleet, without a failed request.

:func:`plan` compares the running service with the new one: it refuses a file
for another service, an invalid one, or a change only a restart of ``pdfleet
up`` can make (the gateway's settings, autoscaling); it lists the roles whose
engines must be replaced (their command line changes: engine args, model,
revision, serving flags) and the replica counts to reach. :class:`Rollout`
carries a plan out in a thread while the supervisor keeps supervising:

* decode first, then prefill (as the operator rolls pods), one engine at a
  time per role: start an engine of the new config, wait until it is ready,
  then drain an old one;
* a decode engine is drained by migration (SIGTERM: the gateway resumes its
  streams on another decode engine of the same resume identity, whatever its
  compatibility hash) while such an engine remains; the last one of its
  identity is instead taken out of routing and stopped once idle (bounded),
  since its streams would have nowhere to go; a prefill engine is always
  stopped once idle;
* the gateway pairs a prefill leg only with a decode engine of the same
  compatibility hash, so while the hashes of the two roles differ requests
  are served by decode alone (no mixed pair is ever made);
* a change that needs no new engine (replica counts) only scales;
* spec.adapters never needs one: the new list's directories are resolved
  first (``hf://`` fetched once into the Hugging Face cache, as ``pdfleet up``
  does; a fetch that fails refuses the file), engines started from then on
  get them in ``--lora-modules``, and once the roles are rolled or scaled
  every running engine is told through its load and unload API (fleet token):
  new ones loaded on every engine first, then those whose directory changed
  replaced, then those the file no longer lists unloaded. An added adapter
  whose rank exceeds a role's maxLoraRank refuses the file before anything
  changes; a load an engine refuses undoes every call the apply made, so no
  role is left serving other adapters than another. Requests running on an
  unloaded adapter finish with it.

Every wait is bounded: an engine that is not ready within the fleet's start
timeout, or that keeps exiting, fails the rollout (it is stopped, the engines
not yet replaced keep running, and the message names its log).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from ...engine.contracts.lora import LoRALoad, load_succeeded, name_taken
from ...engine.contracts.model_card import ModelCard, decode_list
from ..compat import check_service
from ..resource import AdapterSpec, InferenceService
from ..roles import (
    adapter_path,
    engine_command,
    publishes_kv_events,
    role_engine_args,
    role_engine_section,
)
from .fleet import MAX_RESTARTS, LocalFleet
from .process import Child
from .state import ApplyReport, ApplyRequest

ORDER = ("decode", "prefill")
"""Rollout order: decode first (as the operator), so a new prefill engine never
waits for a decode engine it can pair with."""


def service_problems(service: InferenceService) -> list[str]:
    """Why ``pdfleet up`` cannot run ``service`` (empty when it can)."""
    problems = [str(p) for p in check_service(service.spec)]
    problems += [
        f"spec.{role}.nodesPerReplica: pdfleet up runs every engine on this machine "
        "(its tensor-parallel ranks as local processes); set nodesPerReplica: 1"
        for role in ("prefill", "decode")
        if service.spec.role(role).nodes_per_replica > 1
    ]
    return problems


def engine_signature(service: InferenceService, role: str, model_path: str) -> list[str]:
    """An engine's command line for ``role`` with placeholder ports and names: two
    configs whose signatures differ need new engines."""
    spec = service.spec
    events = ("tcp://h:1", "tcp://h:2") if publishes_kv_events(spec, role) else None
    # Without the adapters loaded at start: those are loaded and unloaded on
    # running engines instead (LoRA's own flags, which spec.adapters being
    # non-empty implies, still count).
    args = role_engine_args(
        spec,
        role,
        model_path=model_path,
        kv_ip="h",
        kv_port=1,
        engine_id="e",
        kv_events=events,
        adapters=[],
    )
    return engine_command(args, host="h", port=1, serving=spec.serving)


def changed_paths(old: Any, new: Any, path: str = "spec") -> list[str]:
    """The field paths (camelCase, as in the file) where ``old`` and ``new`` differ."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            out += changed_paths(old.get(key), new.get(key), f"{path}.{key}")
        return out
    return [] if old == new else [path]


@dataclass
class Plan:
    service: InferenceService
    model_path: str
    roll: list[str]
    """Roles whose engines are replaced, in rollout order."""
    replicas: dict[str, int]
    """Engines per role to end with."""
    changed: list[str]
    """Every field path the new file changes."""
    adapter_paths: dict[str, str] = field(default_factory=dict)
    """The local directory of each of the new spec.adapters."""
    sync_adapters: bool = False
    """spec.adapters changed: load and unload on the running engines."""

    def summary(self) -> str:
        if not self.changed:
            return "no change"
        what = [f"rolling {role}" for role in self.roll]
        what += [f"{role} to {n} replica(s)" for role, n in self.replicas.items()]
        return f"changed {', '.join(self.changed)}: {'; '.join(what) or 'nothing to restart'}"


def plan(
    fleet: LocalFleet,
    service: InferenceService,
    resolve: Callable[[InferenceService], str],
    autoscaling: bool,
    resolve_adapters: Callable[[list[AdapterSpec]], dict[str, str]] | None = None,
) -> Plan:
    """What applying ``service`` to ``fleet`` takes; ValueError (the fleet
    untouched) when it may not be applied. ``resolve``: the model directory of
    a service whose model changed; ``autoscaling``: an autoscaler owns the
    replica counts; ``resolve_adapters``: the local directories of adapters
    the fleet does not have yet (ValueError when one cannot be had; default:
    the path a ``file://`` source names)."""
    old = fleet.service
    if service.name != old.name:
        raise ValueError(
            f"metadata.name: this fleet runs {old.name!r}, the file is for {service.name!r}"
        )
    problems = service_problems(service)
    if problems:
        raise ValueError("; ".join(problems))
    dump_old = old.spec.model_dump(mode="json", by_alias=True)
    dump_new = service.spec.model_dump(mode="json", by_alias=True)
    changed = changed_paths(dump_old, dump_new)
    model_path = fleet.model_path
    if (service.spec.model.uri, service.spec.model.revision) != (
        old.spec.model.uri,
        old.spec.model.revision,
    ):
        model_path = resolve(service)
    if service.spec.gateway.tenants is not None and fleet.tenants_file is None:
        raise ValueError(
            "spec.gateway.tenants names a Secret or ConfigMap, which only exists in "
            "Kubernetes: give the file itself with `pdfleet up --tenants-file`"
        )
    before, after = fleet.gateway_config(), fleet.gateway_config(service, model_path)
    if before != after:
        fields = [
            name
            for name in before.__dataclass_fields__
            if getattr(before, name) != getattr(after, name)
        ]
        raise ValueError(
            f"the change needs a new gateway ({', '.join(fields)}), which would cut the "
            "requests in flight: stop `pdfleet up` and start it with the new file"
        )
    if (old.spec.autoscaling is None) != (service.spec.autoscaling is None) or (
        autoscaling and old.spec.autoscaling != service.spec.autoscaling
    ):
        raise ValueError(
            "spec.autoscaling: the local autoscaler is set up when `pdfleet up` starts; "
            "restart it with the new file"
        )
    roll, replicas = [], {}
    for role in ORDER:
        if role not in fleet.roles:
            continue
        if engine_signature(old, role, fleet.model_path) != engine_signature(
            service, role, model_path
        ):
            roll.append(role)
        want = service.spec.role(role).replicas
        if want != old.spec.role(role).replicas:
            if autoscaling:
                raise ValueError(
                    f"spec.{role}.replicas: the autoscaler owns the replica count while "
                    "spec.autoscaling is set"
                )
            replicas[role] = want
    adapter_paths, sync = _plan_adapters(fleet, service, resolve_adapters)
    return Plan(service, model_path, roll, replicas, changed, adapter_paths, sync)


def _plan_adapters(
    fleet: LocalFleet,
    service: InferenceService,
    resolve: Callable[[list[AdapterSpec]], dict[str, str]] | None,
) -> tuple[dict[str, str], bool]:
    """(the local directory of each new adapter, whether the list changed)."""
    old = {a.name: a for a in fleet.service.spec.adapters}
    new = service.spec.adapters
    kept = {
        a.name: fleet.adapter_paths[a.name]
        for a in new
        if old.get(a.name) == a and a.name in fleet.adapter_paths
    }
    missing = [a for a in new if a.name not in kept]
    fetched = (
        resolve(missing) if resolve is not None else {a.name: adapter_path(a) for a in missing}
    )
    paths = {a.name: kept.get(a.name) or fetched[a.name] for a in new}
    for i, a in enumerate(new):
        if a.name not in kept:
            check_adapter_limits(service, i, a.name, paths[a.name], fleet.roles)
    return paths, list(old.values()) != list(new)


def check_adapter_limits(
    service: InferenceService, index: int, name: str, path: str, roles: Any
) -> None:
    """ValueError (the file refused, nothing changed) when an added adapter's
    ``adapter_config.json`` is unreadable or its rank (``r``, any
    ``rank_pattern`` value) exceeds the maxLoraRank of an engine role that
    would load it. The engines check the rest (shapes, tensors) at the load;
    a failure there is rolled back."""
    import json

    from ...engine.config.lora import LoRAConfig

    where = f"spec.adapters[{index}] ({name})"
    try:
        with open(os.path.join(path, "adapter_config.json"), "rb") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{where}: cannot read its adapter_config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{where}: adapter_config.json is not a JSON object")
    pattern = cfg.get("rank_pattern") or {}
    ranks = [cfg.get("r"), *(pattern.values() if isinstance(pattern, dict) else [None])]
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in ranks):
        raise ValueError(
            f"{where}: adapter_config.json r and rank_pattern must be positive integers"
        )
    for role in ORDER:
        if role not in roles:
            continue
        section = role_engine_section(service.spec, role)
        limit = section.get("maxLoraRank") or LoRAConfig.max_lora_rank
        if max(ranks) > limit:
            field_path = (
                f"spec.{role}.engine.maxLoraRank"
                if service.spec.role(role).engine.get("maxLoraRank") is not None
                else "spec.engine.maxLoraRank"
            )
            raise ValueError(
                f"{where}: rank {max(ranks)} exceeds the {role} engines' maxLoraRank "
                f"{limit} ({field_path}); raise it (the engines restart) or use a "
                "smaller adapter"
            )


def engine_identity(child: Child) -> str | None:
    """What an engine's streams may resume on (its cache-config series): its
    resume identity, or its P/D compatibility hash when it reports none."""
    from ...engine.contracts import metrics as m

    text = child.metrics_text()
    if not text:
        return None
    labels = m.parse_metrics(text).labels(m.ENGINE_CACHE_CONFIG.name, m.VLLM_CACHE_CONFIG_INFO.name)
    labels = labels or {}
    return labels.get(m.RESUME_IDENTITY) or labels.get(m.COMPAT_HASH) or None


@dataclass
class ApplyStatus:
    """What fleet.json says of the latest apply (``pdfleet apply`` follows it)."""

    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    state: str = "rolling"
    """rolling, done or failed."""
    message: str = ""
    steps: list[str] = field(default_factory=list)

    def report(self) -> ApplyReport:
        """What fleet.json says of it now."""
        return ApplyReport(self.id, self.state, self.message, tuple(self.steps))


class Rollout(threading.Thread):
    """Carries out a :class:`Plan` (see the module); ``status`` tells how far."""

    def __init__(
        self, fleet: LocalFleet, todo: Plan, status: ApplyStatus, ready_timeout: float
    ) -> None:
        super().__init__(name="pdfleet-apply", daemon=True)
        self.fleet = fleet
        self.plan = todo
        self.status = status
        self.ready_timeout = ready_timeout
        self._identities: dict[str, str | None] = {}

    def step(self, text: str) -> None:
        self.status.steps.append(text)
        self.fleet.say(f"  apply: {text}")

    def run(self) -> None:
        fleet, todo = self.fleet, self.plan
        old_service, old_path = fleet.service, fleet.model_path
        replaced = False
        old_adapters = dict(fleet.adapter_paths)
        try:
            self.step(todo.summary())
            fleet.use(todo.service, todo.model_path, todo.adapter_paths)
            for role in ORDER:
                if role not in fleet.roles:
                    continue
                target = todo.service.spec.role(role).replicas
                if role in todo.roll:
                    replaced = self._roll(role, target) or replaced
                else:
                    self._scale(role, target)
            if todo.sync_adapters:
                self._sync_adapters()
        except (RuntimeError, TimeoutError) as e:
            if not replaced:  # nothing new runs: later engines keep the old config
                fleet.use(old_service, old_path, old_adapters)
            self.status.message = str(e)
            self.status.state = "failed"
            self.fleet.say(f"! apply failed: {e}")
            return
        self.status.message = todo.summary()
        self.status.state = "done"
        self.fleet.say("  apply: done")

    # -- steps --------------------------------------------------------------------

    def _identity(self, child: Child) -> str | None:
        if self._identities.get(child.name) is None:
            self._identities[child.name] = engine_identity(child)
        return self._identities[child.name]

    def _start(self, role: str) -> Child:
        """A new engine of ``role``, ready (bounded); RuntimeError/TimeoutError
        after stopping it when it does not become ready."""
        child = self.fleet.add_engine(role)
        deadline = time.monotonic() + self.ready_timeout
        while not child.ready:  # the supervisor's tick marks it ready
            if child.restarts >= MAX_RESTARTS or child.stopping:
                self.fleet.discard(child)
                raise RuntimeError(
                    f"{child.name} of the new config keeps exiting (log: {child.log_path}):\n"
                    f"{child.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.fleet.discard(child)
                raise TimeoutError(
                    f"{child.name} of the new config was not ready after "
                    f"{self.ready_timeout:.0f}s (log: {child.log_path})"
                )
            time.sleep(0.2)
        self._identity(child)
        self.step(f"{child.name} ready")
        return child

    def _retire(self, victim: Child) -> None:
        """Drain ``victim`` and wait until it stopped (bounded)."""
        fleet = self.fleet
        migrate = False
        if victim.role == "decode":
            mine = self._identity(victim)
            migrate = mine is not None and any(
                c is not victim and c.ready and self._identity(c) == mine
                for c in fleet.role_engines("decode")
            )
        how = "by migration" if migrate else "once idle"
        self.step(f"draining {victim.name} ({how})")
        fleet.drain(victim, migrate=migrate).join(fleet.drain_timeout + 30.0)
        if victim.alive():
            raise TimeoutError(f"{victim.name} did not stop after its drain")
        self.step(f"{victim.name} stopped")

    def _roll(self, role: str, target: int) -> bool:
        """Replace every engine of ``role`` (one at a time) and end with
        ``target`` of them; True once one was replaced."""
        old = list(self.fleet.engines_of(role))
        for c in old:
            self._identity(c)
        for i in range(max(len(old), target)):
            if i < target:
                self._start(role)
            if i < len(old):
                self._retire(old[i])
        return bool(old)

    def _sync_adapters(self) -> None:
        """Every running engine serves exactly the plan's adapters (bounded
        calls). Additions are loaded on every engine first, then adapters
        whose directory changed are replaced, then removed ones unloaded, so
        no role serves a name another role lost. On any failure every call
        this apply made is undone (loads unloaded, unloads loaded again from
        the directory the engine reported), so the fleet serves what it served
        before, and RuntimeError names the engine and adapter."""
        wanted = self.plan.adapter_paths
        served: dict[str, dict[str, str | None]] = {}
        engines = [c for role in ORDER for c in self.fleet.role_engines(role)]
        for child in engines:
            served[child.name] = self._served(child)
        done: list[tuple[Child, str, str, str | None]] = []  # (engine, action, name, path)
        try:
            for child in engines:
                for name, path in wanted.items():
                    if name not in served[child.name]:
                        self._lora_call(child, "load", name, path, done)
            for child in engines:
                for name, path in wanted.items():
                    root = served[child.name].get(name, path)
                    if root != path:
                        self._lora_call(child, "unload", name, root, done)
                        self._lora_call(child, "load", name, path, done)
            for child in engines:
                for name, root in served[child.name].items():
                    if name not in wanted:
                        self._lora_call(child, "unload", name, root, done)
        except RuntimeError as e:
            undone = self._undo_lora_calls(done)
            raise RuntimeError(f"{e}; {undone}") from None

    def _served(self, child: Child) -> dict[str, str | None]:
        """{adapter name: its directory} of what ``child`` serves now."""
        with httpx.Client(headers=self.fleet.auth_headers) as http:
            return served_adapters(http, child.url, child.name)

    def _lora_call(
        self,
        child: Child,
        action: str,
        name: str,
        path: str | None,
        done: list[tuple[Child, str, str, str | None]],
    ) -> None:
        """One load or unload (bounded); appended to ``done`` once it succeeded,
        RuntimeError naming the engine and adapter otherwise. ``path``: the
        directory loaded, or the one an unloaded adapter was served from."""
        with httpx.Client(headers=self.fleet.auth_headers) as http:
            lora_call(http, child.url, child.name, action, name, path)
        done.append((child, action, name, path))
        self.step(f"{child.name}: adapter {name} {action}ed")

    def _undo_lora_calls(self, done: list[tuple[Child, str, str, str | None]]) -> str:
        """Undo ``done`` newest first; what became of it, for the message."""
        if not done:
            return "no engine was changed"
        failed: list[str] = []
        for child, action, name, path in reversed(done):
            undo = "unload" if action == "load" else "load"
            if undo == "load" and path is None:
                failed.append(f"{child.name}: {name} (its directory is unknown)")
                continue
            try:
                self._lora_call(child, undo, name, path, [])
            except RuntimeError as e:
                failed.append(str(e))
        if failed:
            return "rolling back failed: " + "; ".join(failed)
        return f"rolled back the {len(done)} adapter change(s) this apply made"

    def _scale(self, role: str, target: int) -> None:
        while len(self.fleet.role_engines(role)) < target:
            self._start(role)
        for victim in self.fleet.role_engines(role)[target:]:
            self._retire(victim)


def served_adapters(http: httpx.Client, url: str, name: str) -> dict[str, str | None]:
    """{adapter name: its directory} of what the engine at ``url`` (called
    ``name``) serves now; RuntimeError naming it when it cannot tell."""
    try:
        r = http.get(url + "/v1/models", timeout=10)
        r.raise_for_status()
        cards = decode_list(r.json())
    except (httpx.HTTPError, ValueError) as e:
        raise RuntimeError(f"{name}: cannot list its adapters ({e})") from None
    return {c.id: c.root for c in cards if c.is_adapter}


def lora_call(
    http: httpx.Client, url: str, name: str, action: str, adapter: str, path: str | None
) -> None:
    """One bounded load (from ``path``) or unload of ``adapter`` on the engine at
    ``url`` (called ``name``); RuntimeError naming the engine and adapter on a
    failure. A load answered name_taken (the gateway loaded it meanwhile) is
    done when the engine's card of the name shows the directory wanted."""
    load = LoRALoad(adapter, str(path)) if action == "load" else LoRALoad(adapter)

    def card_root() -> str | None:
        try:
            r = http.get(f"{url}/v1/models/{adapter}", timeout=10)
            card = ModelCard.from_wire(r.json()) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None
        return card.root if card is not None else None

    try:
        r = http.post(
            f"{url}/v1/{action}_lora_adapter",
            content=load.encode(),
            headers={"content-type": "application/json"},
            timeout=120,
        )
        ok = load_succeeded(r.status_code) or (
            action == "load"
            and name_taken(r.status_code, r.content)
            and card_root() == load.lora_path
        )
        error = None if ok else r.text.strip()[:500]
    except httpx.HTTPError as e:
        error = repr(e)
    if error is not None:
        raise RuntimeError(f"{name}: {action} of adapter {adapter!r} failed: {error}")


def read_request(text: str) -> tuple[str, dict[str, Any]]:
    """(id, resource) of an apply request file (``state.ApplyRequest``),
    ValueError naming the field when malformed."""
    request = ApplyRequest.decode(text)
    return request.id, request.resource
