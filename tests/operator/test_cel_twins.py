"""Each cross-field validator of the resource has a CEL twin in the CRD: the API
server (``helpers.crd_checks.admit``, cel-python) and ``parse_spec`` refuse and
admit the same specs."""

from __future__ import annotations

import pytest
from helpers.crd_checks import admit

from pdfleet.operator.compat import check_service
from pdfleet.operator.resource import parse_spec

BASE = {"model": {"name": "m"}, "kvTransfer": {"connector": "NixlConnector"}}
AGGREGATED = {"mode": "Disabled"}
ZMQ = {"connector": "ZmqConnector"}
TP1 = {"tensorParallelSize": 1}


def _spec(**sections: object) -> dict:
    spec = {**BASE}
    for key, value in sections.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


CASES = [
    (_spec(gateway={"tenants": {"secret": "t"}}), True),
    (_spec(gateway={"tenants": {"configMap": "t"}}), True),
    (_spec(gateway={"tenants": {"secret": "t", "configMap": "t"}}), False),
    (_spec(gateway={"tenants": {"key": "x.yaml"}}), False),
    (_spec(gateway={"batch": {"claimName": "b"}}), True),
    (_spec(gateway={"batch": {"emptyDir": True}, "replicas": 1}), True),
    (_spec(gateway={"batch": {"emptyDir": False}}), False),
    (_spec(gateway={"batch": {"claimName": "b", "emptyDir": True}}), False),
    (_spec(gateway={"batch": {"claimName": "b"}, "replicas": 2}), False),
    (_spec(gateway={"batch": {"databaseSecret": {"name": "db"}}, "replicas": 3}), True),
    (_spec(gateway={"batch": {"databaseSecret": {"name": "db"}, "emptyDir": True}}), False),
    (_spec(gateway={"replicas": 2}), True),
    (_spec(serving={"enableAutoToolChoice": True}), False),
    (_spec(serving={"enableAutoToolChoice": True, "toolCallParser": "hermes"}), True),
    (_spec(serving={"enableAutoToolChoice": False}), True),
    (_spec(gateway={"enginePriority": True}), False),
    (_spec(gateway={"enginePriority": True}, engine={"schedulingPolicy": "priority"}), True),
    (
        _spec(
            gateway={"enginePriority": True},
            engine={"schedulingPolicy": "priority"},
            decode={"engine": {"schedulingPolicy": "fcfs"}},
        ),
        False,
    ),
    (_spec(model={"name": "m", "hfEndpoint": "https://hub.example"}), False),
    (
        _spec(
            model={"name": "m", "hfEndpoint": "https://hub.example"},
            adapters=[{"name": "a", "source": "hf://o/a"}],
        ),
        True,
    ),
    (_spec(model={"name": "m", "uri": "hf://o/n", "hfEndpoint": "https://hub.example"}), True),
    (_spec(model={"name": "m", "uri": "hf://o/n", "hfEndpoint": "ftp://hub"}), False),
    (_spec(model={"name": "m", "uri": "builtin://tiny", "tokenSecret": {"name": "s"}}), False),
    # Peer pulls: the decode role of an aggregated fleet, with a connector and kvEvents.
    (_spec(decode={"peerPull": True}, disaggregation=AGGREGATED), True),
    (_spec(decode={"peerPull": False}), True),
    (_spec(decode={"peerPull": True}), False),
    (_spec(prefill={"peerPull": True}, disaggregation=AGGREGATED), False),
    # ... and the prefill role of a disaggregating one.
    (_spec(prefill={"peerPull": True}), True),
    ({**_spec(prefill={"peerPull": True}), "kvTransfer": {}}, False),
    (_spec(prefill={"peerPull": True}, gateway={"kvEvents": False}), False),
    ({**_spec(decode={"peerPull": True}, disaggregation=AGGREGATED), "kvTransfer": {}}, False),
    (
        _spec(decode={"peerPull": True}, disaggregation=AGGREGATED, gateway={"kvEvents": False}),
        False,
    ),
    (_spec(decode={"peerPull": True}, disaggregation=AGGREGATED, gateway={"kvEvents": True}), True),
    # What decides the KV blocks' shape matches across the roles of a disaggregated fleet.
    (_spec(engine={"blockSize": 32}, decode={"engine": {"maxNumSeqs": 8}}), True),
    (_spec(prefill={"engine": {"blockSize": 32}}, decode={"engine": {"blockSize": 32}}), True),
    (_spec(decode={"engine": {"blockSize": 32}}), False),
    (_spec(engine={"blockSize": 32}, prefill={"engine": {"blockSize": 16}}), False),
    (_spec(decode={"engine": {"blockSize": 16}}), True),  # the default, written out
    (_spec(decode={"engine": {"blockSize": 32}}, disaggregation=AGGREGATED), True),
    (_spec(decode={"engine": {"kvCacheDtype": "float16"}}), False),
    (_spec(engine={"kvCacheDtype": "float16"}), True),
    (_spec(prefill={"engine": {"dtype": "bfloat16"}}), False),
    (_spec(prefill={"engine": {"dtype": "auto"}}), True),
    # extraConfig does not repeat a typed kvTransfer field.
    (_spec(kvTransfer={"extraConfig": {"lease_seconds": 5}}), False),
    (_spec(kvTransfer={"extraConfig": {"backends": ["UCX"]}}), False),
    (_spec(kvTransfer={"extraConfig": {"transfer_timeout_seconds": 1}}), False),
    (_spec(kvTransfer={"extraConfig": {"handshake_timeout_seconds": 1}}), False),
    (_spec(kvTransfer={"extraConfig": {"num_threads": 4}}), True),
    # ZmqConnector reaches one process's KV: tensor parallelism 1 while disaggregating.
    (_spec(kvTransfer=ZMQ, decode={"engine": {"tensorParallelSize": 2}}), False),
    (_spec(kvTransfer=ZMQ, engine={"tensorParallelSize": 2}), False),
    (_spec(kvTransfer=ZMQ, engine={"tensorParallelSize": 2}, prefill={"engine": TP1}), False),
    (_spec(kvTransfer=ZMQ, engine={"tensorParallelSize": 1}), True),
    (
        _spec(
            kvTransfer=ZMQ, decode={"engine": {"tensorParallelSize": 2}}, disaggregation=AGGREGATED
        ),
        True,
    ),
    (_spec(decode={"engine": {"tensorParallelSize": 2}}), True),
]


def _validated(spec: dict) -> bool:
    try:
        parse_spec(spec)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize(("spec", "ok"), CASES, ids=str)
def test_the_crd_and_the_model_agree(spec, ok):
    obj = {
        "apiVersion": "pdfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "demo"},
        "spec": spec,
    }
    assert _validated(spec) is ok
    assert (not admit(obj)[1]) is ok


# Rules that read more than the spec have their twin in compat.check_service:
# a multi-node role's worker set names (metadata.name), and the connector a
# disaggregated fleet needs (a check_service rule, so that it is listed with
# the others: the model's validators would stop before them).
MULTI = {"engine": {"tensorParallelSize": 2}, "nodesPerReplica": 2}
OUTSIDE_CASES = [
    ("a" * 43, _spec(decode=MULTI)),  # demo-decode-0 at 52 characters: fits
    ("a" * 44, _spec(decode=MULTI)),
    ("a" * 43, _spec(decode={**MULTI, "replicas": 11})),  # group 10: one digit more
    ("a" * 43, _spec(decode={**MULTI, "replicas": 10})),
    ("a" * 43, _spec(decode=MULTI, autoscaling={"decode": {"maxReplicas": 11}})),
    ("a" * 43, _spec(decode=MULTI, autoscaling={"decode": {"maxReplicas": 10}})),
    ("a" * 42, _spec(prefill=MULTI)),
    ("a" * 43, _spec(prefill=MULTI)),
    ("a" * 43, _spec(prefill=MULTI, disaggregation=AGGREGATED)),
    ("demo", {"model": {"name": "m"}}),
    ("demo", {"model": {"name": "m"}, "disaggregation": AGGREGATED}),
]


@pytest.mark.parametrize(("name", "spec"), OUTSIDE_CASES, ids=str)
def test_the_crd_and_check_service_agree_on_the_rules_beyond_the_model(name, spec):
    obj = {
        "apiVersion": "pdfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": spec,
    }
    refused = {v.field for v in check_service(parse_spec(spec), name=name)}
    errors = admit(obj)[1]
    assert ("metadata.name" in refused) is any("multi-node groups" in e for e in errors)
    assert ("spec.kvTransfer.connector" in refused) is any(
        "kvTransfer.connector is required" in e for e in errors
    )
