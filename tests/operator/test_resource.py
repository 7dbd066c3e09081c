"""The InferenceService model and its loader (also what `pdfleet up` reads)."""

from __future__ import annotations

import pathlib
import re

import pytest
import yaml

from pdfleet.operator.resource import (
    AutoscalingSpec,
    InferenceServiceSpec,
    load_inference_service,
    parse_spec,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("inferenceservice-*.yaml"))


def doc(spec: dict, name: str = "demo") -> dict:
    return {
        "apiVersion": "pdfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": name},
        "spec": spec,
    }


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_load(path):
    svc = load_inference_service(path)
    assert svc.spec.model.name


def test_loader_errors_name_every_bad_field_path():
    bad = doc(
        {
            "model": {"name": "m", "uri": "s3://bucket/x"},
            "prefill": {"replicas": -1, "engine": {"maxNumSeqs": "many"}},
            "engine": {"revision": "abc"},
            "decode": {"engine": {"maxNumBatchedToken": 1}},
            "decod": {},
        }
    )
    with pytest.raises(ValueError, match=r"spec\.") as e:
        load_inference_service(bad)
    lines = str(e.value).splitlines()[1:]
    fields = {line.split(":")[0] for line in lines}
    assert fields == {
        "spec.model.uri",
        "spec.prefill.replicas",
        "spec.prefill.engine.maxNumSeqs",
        "spec.engine.revision",
        "spec.decode.engine.maxNumBatchedToken",
        "spec.decod",
    }
    assert any("set spec.model.revision instead" in line for line in lines)
    assert any("did you mean maxNumBatchedTokens" in line for line in lines)
    assert any("hf://ORG/NAME or builtin://NAME" in line for line in lines)


def test_loader_reads_multi_document_yaml_and_requires_one_inference_service(tmp_path):
    path = tmp_path / "svc.yaml"
    other = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "x"}}
    path.write_text(yaml.safe_dump_all([other, doc({"model": {"name": "m"}})]))
    assert load_inference_service(path).name == "demo"
    path.write_text(yaml.safe_dump(other))
    with pytest.raises(ValueError, match="exactly one document with kind: InferenceService"):
        load_inference_service(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_inference_service(tmp_path / "missing.yaml")


def test_name_must_fit_child_object_names():
    with pytest.raises(ValueError, match=r"metadata\.name"):
        load_inference_service(doc({"model": {"name": "m"}}, name="x" * 46))
    with pytest.raises(ValueError, match=r"metadata\.name"):
        load_inference_service(doc({"model": {"name": "m"}}, name="9lives"))


def test_null_means_default_as_on_the_api_server():
    spec = parse_spec(
        {"model": {"name": "m", "uri": None}, "gateway": None, "engine": {"seed": None}}
    )
    assert spec.model.uri == "builtin://tiny"
    assert spec.gateway.port == 8000
    assert spec.engine == {}


def test_engine_values_are_coerced_to_the_engine_field_types():
    spec = parse_spec({"model": {"name": "m"}, "engine": {"maxNumBatchedTokens": "2K"}})
    assert spec.engine == {"maxNumBatchedTokens": 2048}


def test_autoscaling_section_is_the_policy_spec_with_its_keys_and_defaults():
    # One definition: the resource holds the policy's own model, and dumps it
    # with the keys and defaults tests/autoscaling/test_spec.py pins.
    expected = AutoscalingSpec().to_spec()
    spec = InferenceServiceSpec.model_validate({"model": {"name": "m"}, "autoscaling": {}})
    assert isinstance(spec.autoscaling, AutoscalingSpec)
    assert spec.model_dump(by_alias=True)["autoscaling"] == expected
    again = InferenceServiceSpec.model_validate({"model": {"name": "m"}, "autoscaling": expected})
    assert again.autoscaling == AutoscalingSpec()


def test_bad_autoscaling_values_name_the_field_under_spec():
    # 0 is allowed (scale to zero); below it is named under spec.
    with pytest.raises(
        ValueError,
        match=r"spec\.autoscaling\.decode\.minReplicas: Input should be greater than or equal to 0",
    ):
        parse_spec({"model": {"name": "m"}, "autoscaling": {"decode": {"minReplicas": -1}}})


def test_values_are_typed_as_the_api_server_types_them():
    # Strict, as the CRD's structural schema: no "3" for 3, no true for 1, and a
    # snake_case key is unknown (the API server would prune it), with a hint.
    base = {"model": {"name": "m"}}
    for bad, where in (
        ({"prefill": {"replicas": "3"}}, "spec.prefill.replicas: Input should be a valid integer"),
        ({"prefill": {"replicas": True}}, "spec.prefill.replicas: Input should be a valid integer"),
        ({"kv_transfer": {}}, "spec.kv_transfer: unknown field (did you mean kvTransfer?)"),
        ({"autoscaling": {"periodSeconds": "20"}}, "spec.autoscaling.periodSeconds"),
    ):
        with pytest.raises(ValueError, match=re.escape(where)):
            parse_spec({**base, **bad})
    assert (
        parse_spec({**base, "autoscaling": {"periodSeconds": 20}}).autoscaling.period_seconds == 20
    )


def test_role_lookup_rejects_unknown_roles():
    spec = InferenceServiceSpec.model_validate({"model": {"name": "m"}})
    assert spec.role("decode") is spec.decode
    with pytest.raises(ValueError, match="unknown role"):
        spec.role("gateway")
