"""Offline check of LeaderWorkerSet objects (leaderworkerset.x-k8s.io/v1).

The cluster's API server validates a LeaderWorkerSet against the CRD that the
LeaderWorkerSet project installs; that CRD is not here, so this is a small
hand-written copy of the fields it documents for v1 (names, types, enums,
bounds, required keys), plus the rules its admission webhook adds (size at
least 1, maxSurge and maxUnavailable not both 0). Pod templates are checked
against Kubernetes' own PodTemplateSpec schema.
"""

from __future__ import annotations

from typing import Any

from helpers.kube_schema import validate as validate_builtin

API_VERSION = "leaderworkerset.x-k8s.io/v1"
INT_OR_STRING = "int-or-string"
POD_TEMPLATE = "PodTemplateSpec"

# field -> type, or (type, {"enum": [...], "minimum": n, "maximum": n}), or a nested dict.
SPEC_FIELDS: dict[str, Any] = {
    "replicas": ("integer", {"minimum": 0, "maximum": 1_000_000}),
    "leaderWorkerTemplate": {
        "leaderTemplate": POD_TEMPLATE,
        "workerTemplate": POD_TEMPLATE,
        "size": ("integer", {"minimum": 1}),
        "restartPolicy": (
            "string",
            {"enum": ["Default", "RecreateGroupOnPodRestart", "RecreateGroupAfterStart", "None"]},
        ),
        "subGroupPolicy": {
            "subGroupPolicyType": ("string", {"enum": ["LeaderWorker", "LeaderExcluded"]}),
            "subGroupSize": "integer",
        },
        "volumeClaimTemplates": "array",
        "persistentVolumeClaimRetentionPolicy": {"whenDeleted": "string", "whenScaled": "string"},
    },
    "rolloutStrategy": {
        "type": ("string", {"enum": ["RollingUpdate"]}),
        "rollingUpdateConfiguration": {
            "partition": "integer",
            "maxUnavailable": INT_OR_STRING,
            "maxSurge": INT_OR_STRING,
        },
    },
    "startupPolicy": ("string", {"enum": ["LeaderCreated", "LeaderReady"]}),
    "networkConfig": {"subdomainPolicy": ("string", {"enum": ["Shared", "UniquePerReplica"]})},
}
REQUIRED = {
    "spec": ["leaderWorkerTemplate"],
    "spec.leaderWorkerTemplate": ["workerTemplate"],
    "spec.rolloutStrategy": ["type"],
    "spec.networkConfig": ["subdomainPolicy"],
}
TYPES = {"integer": int, "string": str, "array": list}


def _check(node: Any, schema: Any, path: str) -> None:
    if isinstance(schema, dict):
        if not isinstance(node, dict):
            raise AssertionError(f"{path}: expected an object, got {node!r}")
        for key in REQUIRED.get(path, []):
            if key not in node:
                raise AssertionError(f"{path}.{key}: required")
        for key, value in node.items():
            if key not in schema:
                raise AssertionError(f"{path}.{key}: not a LeaderWorkerSet field")
            _check(value, schema[key], f"{path}.{key}")
        return
    kind, rules = schema if isinstance(schema, tuple) else (schema, {})
    if kind == POD_TEMPLATE:
        validate_builtin(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": node}
        )
        return
    if kind == INT_OR_STRING:
        ok = isinstance(node, (int, str)) and not isinstance(node, bool)
    else:
        ok = isinstance(node, TYPES[kind]) and not isinstance(node, bool)
    if not ok:
        raise AssertionError(f"{path}: expected {kind}, got {node!r}")
    if "enum" in rules and node not in rules["enum"]:
        raise AssertionError(f"{path}: {node!r} is not one of {rules['enum']}")
    if "minimum" in rules and node < rules["minimum"]:
        raise AssertionError(f"{path}: {node} is below {rules['minimum']}")
    if "maximum" in rules and node > rules["maximum"]:
        raise AssertionError(f"{path}: {node} is above {rules['maximum']}")


def validate_lws(obj: dict[str, Any]) -> None:
    """Raise AssertionError naming the first field that the LWS API would refuse."""
    assert obj.get("apiVersion") == API_VERSION, obj.get("apiVersion")
    assert obj.get("kind") == "LeaderWorkerSet"
    unknown = set(obj) - {"apiVersion", "kind", "metadata", "spec", "status"}
    assert not unknown, f"unknown top-level fields {unknown}"
    meta = obj["metadata"]
    assert isinstance(meta.get("name"), str) and meta["name"], "metadata.name"
    _check(obj["spec"], SPEC_FIELDS, "spec")
    rolling = (obj["spec"].get("rolloutStrategy") or {}).get("rollingUpdateConfiguration") or {}
    if rolling.get("maxSurge", 0) == 0 and rolling.get("maxUnavailable", 1) == 0:
        raise AssertionError("maxUnavailable must not be 0 when maxSurge is 0")
