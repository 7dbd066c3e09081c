"""The InferenceService status, computed from its Deployments (pure functions).

Conditions are metav1.Condition-shaped; a condition keeps its
``lastTransitionTime`` while its status does not change.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .resource import InferenceServiceSpec
from .roles import disaggregating

ROLE_CONDITIONS = {"prefill": "PrefillReady", "decode": "DecodeReady", "gateway": "GatewayReady"}
CONDITION_TYPES = ("Ready", *ROLE_CONDITIONS.values(), "KVTransferHealthy")


def role_status(deployment: Mapping[str, Any] | None, desired: int) -> dict[str, Any]:
    status = (deployment or {}).get("status") or {}
    ready = int(status.get("readyReplicas") or 0)
    return {
        "replicas": int(status.get("replicas") or 0),
        "readyReplicas": ready,
        "updatedReplicas": int(status.get("updatedReplicas") or 0),
        "desiredReplicas": desired,
        "summary": f"{ready}/{desired}",
    }


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
    conditions: Sequence[Mapping[str, Any]],
    type_: str,
    status: str,
    reason: str,
    message: str,
    *,
    now: str,
    generation: int | None = None,
) -> list[dict[str, Any]]:
    """``conditions`` with ``type_`` set (others kept, in CONDITION_TYPES order)."""
    by_type = {c["type"]: dict(c) for c in conditions}
    old = by_type.get(type_)
    changed = old is None or old.get("status") != status
    new: dict[str, Any] = {
        "type": type_,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": now if changed or old is None else old.get("lastTransitionTime", now),
    }
    if generation is not None:
        new["observedGeneration"] = generation
    by_type[type_] = new
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(by_type.values(), key=lambda c: order.get(c["type"], len(order)))


def _role_condition(role: str, status: Mapping[str, Any], used: bool) -> tuple[str, str, str]:
    ready, desired = status["readyReplicas"], status["desiredReplicas"]
    updated = status["updatedReplicas"]
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
    previous = previous or {}
    conditions: list[dict[str, Any]] = list(previous.get("conditions") or [])
    roles = {role: role_status(deployments.get(role), desired[role]) for role in ROLE_CONDITIONS}
    states = {}
    for role, cond in ROLE_CONDITIONS.items():
        used = role != "prefill" or disaggregating(spec)
        state, reason, message = _role_condition(role, roles[role], used)
        states[role] = state
        conditions = set_condition(
            conditions, cond, state, reason, message, now=now, generation=generation
        )
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
    serving = roles["gateway"]["readyReplicas"] > 0 and roles["decode"]["readyReplicas"] > 0
    rolling = any(roles[r]["updatedReplicas"] < roles[r]["desiredReplicas"] for r in roles)
    if all(s == "True" for s in states.values()):
        phase, reason, message = "Ready", "AllRolesReady", f"serving at {url}"
    elif rolling:
        phase, reason = "Progressing", "RollingOut"
        message = "; ".join(
            c["message"]
            for c in conditions
            if c["type"] in ROLE_CONDITIONS.values() and c["status"] != "True"
        )
    elif serving:
        phase, reason = "Degraded", "SomeRolesNotReady"
        message = "; ".join(
            c["message"] for c in conditions if c["type"] in ROLE_CONDITIONS.values()
        )
        message += " (requests are still served)"
    else:
        phase, reason = "Pending", "NotServing"
        message = "waiting for gateway and decode pods to become ready"
    ready = "True" if phase == "Ready" else "False"
    conditions = set_condition(
        conditions, "Ready", ready, reason, message, now=now, generation=generation
    )
    out: dict[str, Any] = {
        "phase": phase,
        "url": url,
        "compatHash": compat,
        "conditions": conditions,
        "roles": roles,
    }
    if generation is not None:
        out["observedGeneration"] = generation
    return out


def invalid_status(
    previous: Mapping[str, Any] | None, message: str, *, now: str, generation: int | None
) -> dict[str, Any]:
    """Status of a spec that cannot run: ``Ready=False`` with what to change."""
    conditions = list((previous or {}).get("conditions") or [])
    conditions = set_condition(
        conditions, "Ready", "False", "InvalidSpec", message, now=now, generation=generation
    )
    return {"phase": "Failed", "conditions": conditions, "observedGeneration": generation}
