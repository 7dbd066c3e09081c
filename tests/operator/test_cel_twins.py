"""Each cross-field validator of the resource has a CEL twin in the CRD: the API
server (``helpers.crd_checks.admit``, cel-python) and ``parse_spec`` refuse and
admit the same specs."""

from __future__ import annotations

import pytest
from helpers.crd_checks import admit

from pdfleet.operator.resource import parse_spec

BASE = {"model": {"name": "m"}, "kvTransfer": {"connector": "NixlConnector"}}


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
