"""Hostile InferenceService values are refused before any object is rendered: by
the resource model (so `pdfleet render`, `pdfleet up` and the operator refuse
them) and, where a schema can say it, by the CRD at admission."""

from __future__ import annotations

import contextlib
import copy
import io
import re

import pytest
import yaml
from helpers.crd_checks import admit

from pdfleet.engine.cli import main
from pdfleet.operator.manifests import build_children, fleet_secret_name
from pdfleet.operator.resource import load_inference_service

BASE = {
    "apiVersion": "pdfleet.dev/v1alpha1",
    "kind": "InferenceService",
    "metadata": {"name": "llama"},
    "spec": {"model": {"name": "llama"}, "kvTransfer": {"connector": "ZmqConnector"}},
}
FLEET_SECRET = fleet_secret_name("llama")  # llama-fleet


def with_spec(**changes) -> dict:
    doc = copy.deepcopy(BASE)
    for path, value in changes.items():
        node = doc["spec"]
        *parents, last = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return doc


def secret_ref(secret: str) -> dict:
    return {
        "name": "STOLEN",
        "valueFrom": {"secretKeyRef": {"name": secret, "key": "fleet-secret"}},
    }


HOSTILE = [
    # The fleet secret moved into a variable, or one of pdfleet's own variables replaced.
    ("decode.env", with_spec(decode__env=[secret_ref(FLEET_SECRET)]), "fleet secret"),
    ("prefill.env", with_spec(prefill__env=[secret_ref("other-svc-fleet")]), "fleet secret"),
    (
        "decode.env",
        with_spec(decode__env=[{"name": "PDFLEET_FLEET_SECRET_FILE", "value": "/tmp/x"}]),
        "PDFLEET_",
    ),
    (
        "gateway.env",
        with_spec(gateway__env=[{"name": "PDFLEET_API_KEY", "value": "chosen-by-me"}]),
        "PDFLEET_",
    ),
    # A revision or a name that would become a flag of fetch-model or the engine.
    ("model.revision", with_spec(model__revision="--output=/etc"), "pattern"),
    ("model.name", with_spec(model__name="--served-model-name=x"), "pattern"),
]
PYDANTIC_ONLY = [
    # Checked by the resource model (the CRD has a pattern for each, not this rule).
    ("model.revision", with_spec(model__revision="main/../../etc"), "'..'"),
    (
        "model.tokenSecret.name",
        with_spec(model__uri="hf://org/name", model__tokenSecret={"name": FLEET_SECRET}),
        "reserved for fleet secrets",
    ),
    (
        "gateway.apiKeySecret.name",
        with_spec(gateway__apiKeySecret={"name": FLEET_SECRET}),
        "reserved for fleet secrets",
    ),
    ("model.uri", with_spec(model__uri="pvc://Bad_Claim/x"), "claim"),
]


@pytest.mark.parametrize(("field", "doc", "needle"), HOSTILE + PYDANTIC_ONLY)
def test_the_resource_model_refuses_hostile_values(field, doc, needle):
    with pytest.raises(ValueError, match=re.escape(f"spec.{field}")) as e:
        load_inference_service(doc)
    message = str(e.value)
    assert f"spec.{field}" in message and needle in message, message


@pytest.mark.parametrize(("field", "doc", "needle"), HOSTILE)
def test_pdfleet_render_refuses_them_and_prints_nothing(tmp_path, field, doc, needle):
    path = tmp_path / "svc.yaml"
    path.write_text(yaml.safe_dump(doc))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["render", str(path)])
    assert code == 2 and out.getvalue() == ""
    assert f"spec.{field}" in err.getvalue()


@pytest.mark.parametrize(("field", "doc", "needle"), HOSTILE)
def test_the_crd_refuses_them_at_admission(field, doc, needle):
    _, errors = admit(doc)
    said = "does not match" if needle == "pattern" else needle
    assert any(f"spec.{field}" in e and said in e for e in errors), errors


def test_ordinary_values_still_render():
    doc = with_spec(
        model__revision="refs/pr/12",
        model__name="meta-llama/Llama-3.1-8B-Instruct",
        decode__env=[
            {"name": "UCX_TLS", "value": "tcp,self"},
            {"name": "WANDB_KEY", "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "k"}}},
        ],
    )
    assert admit(doc)[1] == []
    svc = load_inference_service(doc)
    objects = build_children(svc.name, svc.spec, namespace="default")
    assert any(o["kind"] == "Deployment" for o in objects)
