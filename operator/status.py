"""The InferenceService status, computed from its Deployments (pure functions).

Every status field the operator writes is built here as the resource's status
model (``resource.InferenceServiceStatus`` and its parts, the schema the CRD's
status comes from) and turned into a merge patch by :func:`status_patch`, the
one place a status becomes a dict. Conditions are metav1.Condition-shaped; a
condition keeps its ``lastTransitionTime`` while its status does not change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from .resource import (
    AutoscalingStatus,
    Condition,
    InferenceServiceSpec,
    InferenceServiceStatus,
    RolesStatus,
    RoleStatus,
    ScalingRecord,
)
from .roles import disaggregating

ROLE_CONDITIONS = {"prefill": "PrefillReady", "decode": "DecodeReady", "gateway": "GatewayReady"}
CONDITION_TYPES = ("Ready", *ROLE_CONDITIONS.values(), "KVTransferHealthy")


MAX_RECORDED_DECISIONS = 10
"""``status.autoscaling.lastDecisions`` keeps this many, newest last."""
ConditionStatus = Literal["True", "False", "Unknown"]


def status_patch(status: BaseModel, *, nulls: bool = False) -> dict[str, Any]:
    """A status model (or part of one) as the merge patch that writes it: the
    fields its builder set, camelCase. ``nulls``: a field set to None is
    written as null, which clears it (a figure no longer known); otherwise
    it is left out, and the stored value stays (``observedGeneration`` on a
    periodic refresh)."""
    return status.model_dump(by_alias=True, mode="json", exclude_unset=True, exclude_none=not nulls)


def _conditions(previous: Mapping[str, Any] | None) -> list[Condition]:
    """The stored conditions (one the model cannot read is dropped: it is
    written again, whole, by the next change of its type)."""
    out = []
    for c in (previous or {}).get("conditions") or []:
        try:
            out.append(Condition.model_validate(c))
        except ValidationError:
            continue
    return out


def _records(previous: Mapping[str, Any] | None) -> list[ScalingRecord]:
    """The stored autoscaling decisions (unreadable ones dropped, as above)."""
    stored = ((previous or {}).get("autoscaling") or {}).get("lastDecisions") or []
    out = []
    for r in stored:
        try:
            out.append(ScalingRecord.model_validate(r))
        except ValidationError:
            continue
    return out


def role_status(deployment: Mapping[str, Any] | None, desired: int) -> RoleStatus:
    status = (deployment or {}).get("status") or {}
    ready = int(status.get("readyReplicas") or 0)
    return RoleStatus(
        replicas=int(status.get("replicas") or 0),
        ready_replicas=ready,
        updated_replicas=int(status.get("updatedReplicas") or 0),
        desired_replicas=desired,
        summary=f"{ready}/{desired}",
    )


def rollout_done(deployment: Mapping[str, Any] | None) -> bool:
    """Whether a Deployment runs its current template on all its replicas, ready."""
    if deployment is None:
        return False
    generation = int(deployment.get("metadata", {}).get("generation") or 0)
    status = deployment.get("status") or {}
    wanted = int((deployment.get("spec") or {}).get("replicas", 1))
    return (
        int(status.get("observedGeneration", -1)) >= generation
        and int(status.get("updatedReplicas") or 0) >= wanted
        and int(status.get("readyReplicas") or 0) >= wanted
        and int(status.get("replicas") or 0) == wanted
    )


def set_condition(
    conditions: Sequence[Condition],
    type_: str,
    status: ConditionStatus,
    reason: str,
    message: str,
    *,
    now: str,
    generation: int | None = None,
) -> list[Condition]:
    """``conditions`` with ``type_`` set (others kept, in CONDITION_TYPES order)."""
    by_type = {c.type: c for c in conditions}
    old = by_type.get(type_)
    changed = old is None or old.status != status
    since = now if changed or old is None else (old.last_transition_time or now)
    new = Condition(
        type=type_, status=status, reason=reason, message=message, last_transition_time=since
    )
    if generation is not None:
        new.observed_generation = generation
    by_type[type_] = new
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(by_type.values(), key=lambda c: order.get(c.type, len(order)))


def _role_condition(role: str, status: RoleStatus, used: bool) -> tuple[ConditionStatus, str, str]:
    ready, desired = status.ready_replicas, status.desired_replicas
    updated = status.updated_replicas
    if not used:
        return "True", "NotUsed", f"no {role} pods run while disaggregation is Disabled"
    if desired == 0:
        return "False", "ScaledToZero", f"{role} has 0 desired replicas"
    if ready >= desired and updated >= desired:
        return "True", "AllReplicasReady", f"{ready}/{desired} {role} pods ready"
    if ready == 0:
        return "False", "NoReplicasReady", f"0/{desired} {role} pods ready"
    if updated < desired:
        return "False", "RollingOut", f"{updated}/{desired} {role} pods updated, {ready} ready"
    return "False", "ReplicasNotReady", f"{ready}/{desired} {role} pods ready"


def build_status(
    spec: InferenceServiceSpec,
    *,
    url: str,
    compat: str,
    deployments: Mapping[str, Mapping[str, Any] | None],
    desired: Mapping[str, int],
    previous: Mapping[str, Any] | None,
    kv_healthy: bool | None,
    kv_message: str,
    now: str,
    kv_reason: str | None = None,
    generation: int | None = None,
) -> dict[str, Any]:
    """The status fields the operator owns (``autoscaling`` is written apart).

    ``generation`` is set by the reconcile that acted on it (it becomes
    ``observedGeneration``); a periodic refresh passes ``None``.
    """
    conditions = _conditions(previous)
    roles = {role: role_status(deployments.get(role), desired[role]) for role in ROLE_CONDITIONS}
    states: dict[str, ConditionStatus] = {}
    for role, cond in ROLE_CONDITIONS.items():
        used = role != "prefill" or disaggregating(spec)
        state, reason, message = _role_condition(role, roles[role], used)
        states[role] = state
        conditions = set_condition(
            conditions, cond, state, reason, message, now=now, generation=generation
        )
    kv_state: ConditionStatus
    if not disaggregating(spec):
        kv_state, kv_reason, kv_message = "True", "NotUsed", "disaggregation is Disabled"
    elif kv_healthy is None:
        kv_state, kv_reason = "Unknown", kv_reason or "NoMetrics"
    elif kv_healthy:
        kv_state, kv_reason = "True", kv_reason or "NoFailedTransfers"
    else:
        kv_state, kv_reason = "False", kv_reason or "KVTransferDegraded"
    conditions = set_condition(
        conditions, "KVTransferHealthy", kv_state, kv_reason, kv_message, now=now
    )
    serving = roles["gateway"].ready_replicas > 0 and roles["decode"].ready_replicas > 0
    rolling = any(r.updated_replicas < r.desired_replicas for r in roles.values())
    phase: Literal["Pending", "Progressing", "Ready", "Degraded"]
    if all(s == "True" for s in states.values()):
        phase, reason, message = "Ready", "AllRolesReady", f"serving at {url}"
    elif rolling:
        phase, reason = "Progressing", "RollingOut"
        message = "; ".join(
            c.message
            for c in conditions
            if c.type in ROLE_CONDITIONS.values() and c.status != "True"
        )
    elif serving:
        phase, reason = "Degraded", "SomeRolesNotReady"
        message = "; ".join(c.message for c in conditions if c.type in ROLE_CONDITIONS.values())
        message += " (requests are still served)"
    else:
        phase, reason = "Pending", "NotServing"
        message = "waiting for gateway and decode pods to become ready"
    ready: ConditionStatus = "True" if phase == "Ready" else "False"
    conditions = set_condition(
        conditions, "Ready", ready, reason, message, now=now, generation=generation
    )
    return status_patch(
        InferenceServiceStatus(
            phase=phase,
            url=url,
            compat_hash=compat,
            conditions=conditions,
            roles=RolesStatus(**roles),
            observed_generation=generation,
        )
    )


def invalid_status(
    previous: Mapping[str, Any] | None, message: str, *, now: str, generation: int | None
) -> dict[str, Any]:
    """Status of a spec that cannot run: ``Ready=False`` with what to change."""
    conditions = set_condition(
        _conditions(previous),
        "Ready",
        "False",
        "InvalidSpec",
        message,
        now=now,
        generation=generation,
    )
    return status_patch(
        InferenceServiceStatus(
            phase="Failed", conditions=conditions, observed_generation=generation
        ),
        nulls=True,
    )


def autoscaling_status(
    previous: Mapping[str, Any] | None,
    mode: Literal["Active", "Advisory"],
    records: Sequence[ScalingRecord],
) -> dict[str, Any]:
    """``status.autoscaling`` after ``records`` (the changes made, or in mode
    Advisory advised): the bounded decision history, newest last, and, once
    replicas changed, when."""
    status = AutoscalingStatus(
        mode=mode, last_decisions=[*_records(previous), *records][-MAX_RECORDED_DECISIONS:]
    )
    if mode == "Active" and records:
        status.last_scale_time = records[-1].time
    return status_patch(status)


def role_figures(
    running: int, waiting: int, kv_cache_usage: float, prefix_hit_rate: float | None
) -> dict[str, Any]:
    """The headline load figures of one role as ``status.roles.<role>`` holds
    them (``prefixHitRate`` null while there were no lookups)."""
    load = f"{running}/{waiting} kv {100 * kv_cache_usage:.0f}%"
    if prefix_hit_rate is not None:
        load += f" hit {100 * prefix_hit_rate:.0f}%"
    figures = RoleStatus(
        running=running,
        waiting=waiting,
        kv_cache_usage=round(kv_cache_usage, 4),
        prefix_hit_rate=None if prefix_hit_rate is None else round(prefix_hit_rate, 4),
        load=load,
    )
    return status_patch(figures, nulls=True)
