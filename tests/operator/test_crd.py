"""The CRD: generated from the resource model and the engine fields, kept in sync."""

from __future__ import annotations

import pathlib

import pytest
import yaml
from helpers.crd_checks import admit, crd_schema

from pdfleet.engine.config import EngineArgs
from pdfleet.operator.crd import build_crd, crd_yaml
from pdfleet.operator.engine_spec import spec_fields
from pdfleet.operator.reconcile import InvalidSpec, checked_spec
from pdfleet.operator.resource import load_inference_service

ROOT = pathlib.Path(__file__).resolve().parents[2]
CRD_FILES = [
    ROOT / "crds" / "inferenceservices.pdfleet.dev.yaml",
    ROOT / "charts" / "pdfleet" / "crds" / "inferenceservices.pdfleet.dev.yaml",
]
EXAMPLES = sorted((ROOT / "examples").glob("inferenceservice-*.yaml"))


@pytest.mark.parametrize("path", CRD_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_checked_in_crd_is_what_pdfleet_crd_generates(path):
    assert path.read_text() == crd_yaml(), f"regenerate: pdfleet crd > {path.relative_to(ROOT)}"


def walk(schema, path="$"):
    yield path, schema
    for key, prop in (schema.get("properties") or {}).items():
        yield from walk(prop, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from walk(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural():
    for path, node in walk(crd_schema()):
        untyped_ok = node.get("x-kubernetes-int-or-string") or node.get(
            "x-kubernetes-preserve-unknown-fields"
        )
        assert "type" in node or untyped_ok, f"{path} has no type"
        assert not {"$ref", "anyOf", "oneOf", "allOf", "nullable"} & set(node), path
        assert not ("properties" in node and "additionalProperties" in node), path


def test_engine_sections_are_generated_from_engine_args_with_their_docstrings():
    spec = crd_schema()["properties"]["spec"]["properties"]
    expected = set(spec_fields())
    for section in (spec["engine"], spec["prefill"]["properties"]["engine"]):
        assert set(section["properties"]) == expected
        # No defaults: an unset role key must not override spec.engine.
        assert all("default" not in p for p in section["properties"].values())
    field = next(f for f, _ in spec_fields().values() if f.name == "max_num_batched_tokens")
    doc = " ".join(EngineArgs.field_help(field).split())
    described = spec["engine"]["properties"]["maxNumBatchedTokens"]["description"]
    assert described.startswith(doc) and "--max-num-batched-tokens" in described
    assert spec["engine"]["properties"]["dtype"]["enum"][0] == "auto"


def test_crd_names_columns_and_status_subresource():
    crd = build_crd()
    names = crd["spec"]["names"]
    assert (names["kind"], names["shortNames"], names["categories"]) == (
        "InferenceService",
        ["pdsvc"],
        ["pdfleet", "llm"],
    )
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    # Status holds observations only: no defaults the API server would invent.
    status = version["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert all("default" not in node for _, node in walk(status))
    columns = [
        c["name"].upper() for c in version["additionalPrinterColumns"] if not c.get("priority")
    ]
    assert columns == ["MODEL", "PREFILL", "DECODE", "READY", "URL", "AGE"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_admitted_by_the_crd_schema_and_rules(path):
    stored, errors = admit(yaml.safe_load(path.read_text()))
    assert errors == []
    # What the API server stores (defaults applied) still loads the same way.
    assert load_inference_service(stored).spec == load_inference_service(path).spec


def minimal(**spec):
    return {
        "apiVersion": "pdfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "demo"},
        "spec": {"model": {"name": "m"}, "kvTransfer": {"connector": "NixlConnector"}, **spec},
    }


def test_defaults_fill_nested_sections():
    stored, errors = admit(minimal())
    assert errors == []
    assert stored["spec"]["disaggregation"] == {"mode": "Conditional", "minPromptTokens": 256}
    assert stored["spec"]["kvTransfer"]["leaseSeconds"] == 30.0
    assert stored["spec"]["prefill"]["replicas"] == 1
    assert "engine" not in stored["spec"]["prefill"] or stored["spec"]["prefill"]["engine"] == {}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"kvTransfer": {}}, "kvTransfer.connector is required"),
        ({"autoscaling": {"prefill": {"minReplicas": 3, "maxReplicas": 2}}}, "minReplicas"),
        ({"autoscaling": {"prefillDecodeRatio": {"min": 2, "max": 1}}}, "prefillDecodeRatio"),
        ({"autoscaling": {"maxTotalReplicas": 1}}, "maxTotalReplicas"),
        ({"prefill": {"replicas": -1}}, "minimum"),
        ({"gateway": {"batch": {"emptyDir": True}, "replicas": 2}}, "one SQLite database"),
        ({"gateway": {"batch": {}}}, "exactly one of claimName"),
        ({"engine": {"dtype": "int4"}}, "is not one of"),
        ({"disaggregation": {"mode": "Sometimes"}}, "is not one of"),
        ({"autoscaling": {"decode": {"targetKVCacheUsage": 1.5}}}, "maximum"),
        ({"kvTransfer": {"connector": "ZmqConnector", "identity": "Maybe"}}, "is not one of"),
        (
            {
                "decode": {
                    "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "a-identity"}}}]
                }
            },
            "may not read an identity authority",
        ),
    ],
)
def test_the_api_server_rejects_what_the_rules_forbid(spec, message):
    _, errors = admit(minimal(**spec))
    assert any(message in e for e in errors), errors


def test_names_too_long_for_child_services_are_rejected_at_admission():
    obj = minimal()
    obj["metadata"]["name"] = "x" * 46
    assert admit(obj)[1]
    obj["metadata"]["name"] = "x" * 45
    assert not admit(obj)[1]


def test_the_operator_rejects_names_that_are_no_dns_label():
    with pytest.raises(InvalidSpec, match=r"metadata\.name"):
        checked_spec("9lives", minimal()["spec"])
    assert checked_spec("lives9", minimal()["spec"]).model.name == "m"
