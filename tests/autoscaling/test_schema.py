"""The CRD's autoscaling schema and CEL rules refuse exactly what the models refuse.

Each spec below goes through both: the API server's handling of the generated
CRD (defaults, OpenAPI bounds, CEL with cel-python: ``helpers.crd_checks``)
and ``AutoscalingSpec.from_spec``. They must agree, spec by spec.
"""

from __future__ import annotations

import annotated_types
import pytest
from helpers.crd_checks import admit, crd_schema
from pydantic import BaseModel

from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.crd import AUTOSCALING_RULES


def admitted(section: dict) -> bool:
    obj = {
        "apiVersion": "pdfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "demo"},
        "spec": {
            "model": {"name": "m"},
            "kvTransfer": {"connector": "NixlConnector"},
            "autoscaling": section,
        },
    }
    return not admit(obj)[1]


def validated(section: dict) -> bool:
    try:
        AutoscalingSpec.from_spec(section)
    except ValueError:
        return False
    return True


GOOD = [
    {},
    {"maxTotalReplicas": 2},
    {"maxTotalReplicas": 5, "prefill": {"minReplicas": 2}, "decode": {"minReplicas": 3}},
    {"prefill": {"minReplicas": 2, "maxReplicas": 2}},
    {"prefillDecodeRatio": {"min": 0.5, "max": 0.5}},
    {"prefillDecodeRatio": {"max": 0.25}},
    {"periodSeconds": 5, "metricsStaleSeconds": 5},
    {"periodSeconds": 30},
    {"decode": {"targetKVCacheUsage": 1}},
    {"prefill": {"prefillTokensPerSecond": 1000, "ttftTargetSeconds": 0.5}},
    {"decode": {"scaleDownStabilizationSeconds": 0, "scaleUpStabilizationSeconds": 0}},
]
BAD = [
    {"prefill": {"minReplicas": -1}},
    {"decode": {"scaleToZeroAfterSeconds": 0}},
    {"activationTimeoutSeconds": 0},
    {"decode": {"minReplicas": 0, "maxReplicas": 0}},
    {"prefill": {"minReplicas": 3, "maxReplicas": 2}},
    {"decode": {"minReplicas": 5}},
    {"prefillDecodeRatio": {"min": 2, "max": 1}},
    {"prefillDecodeRatio": {"max": 0}},
    {"prefillDecodeRatio": {"min": -1}},
    {"maxTotalReplicas": 1},
    {"maxTotalReplicas": 4, "prefill": {"minReplicas": 2}, "decode": {"minReplicas": 3}},
    {"metricsStaleSeconds": 10},
    {"periodSeconds": 60},
    {"periodSeconds": 0},
    {"decode": {"targetKVCacheUsage": 0}},
    {"decode": {"targetKVCacheUsage": 1.5}},
    {"prefill": {"ttftTargetSeconds": 0}},
    {"prefill": {"prefillTokensPerSecond": 0}},
    {"decode": {"scaleDownStabilizationSeconds": -1}},
    {"prefill": {"maxScaleUpStep": 0}},
    {"decode": {"maxScaleDownStep": 0}},
    {"decode": {"targetWaitingPerReplica": 0}},
]


def _sections() -> dict[str, type[BaseModel]]:
    """Resource key of each nested section ("" for the top) -> its model."""
    out: dict[str, type[BaseModel]] = {"": AutoscalingSpec}
    for name, info in AutoscalingSpec.model_fields.items():
        tp = info.annotation
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            out[info.alias or name] = tp
    return out


def _holds(bound: object, value: float) -> bool:
    if isinstance(bound, annotated_types.Gt):
        return value > bound.gt
    if isinstance(bound, annotated_types.Ge):
        return value >= bound.ge
    assert isinstance(bound, annotated_types.Le)
    return value <= bound.le


def boundary_cases() -> list[tuple[dict, bool]]:
    """For every bounded field: each bound's limit, and a step past it."""
    cases = []
    for where, cls in _sections().items():
        for name, info in cls.model_fields.items():
            for bound in info.metadata:
                limit = getattr(bound, "gt", getattr(bound, "ge", getattr(bound, "le", None)))
                if limit is None:
                    continue
                step = (
                    1
                    if int in (info.annotation, *getattr(info.annotation, "__args__", ()))
                    else 0.01
                )
                upper = isinstance(bound, annotated_types.Le)
                past = limit + step if upper else limit - step
                for value in (limit, past):
                    section = {info.alias or name: value}
                    if where:
                        section = {where: section}
                    cases.append((section, _holds(bound, value)))
    assert len(cases) > 30
    return cases


@pytest.mark.parametrize("section", GOOD, ids=str)
def test_a_good_section_passes_the_crd_and_validate(section):
    assert validated(section)
    assert admitted(section)


@pytest.mark.parametrize("section", BAD, ids=str)
def test_a_bad_section_is_refused_by_the_crd_and_by_validate(section):
    assert not validated(section)
    assert not admitted(section)


@pytest.mark.parametrize(("section", "_"), boundary_cases(), ids=str)
def test_crd_and_validate_agree_at_every_bound(section, _):
    assert admitted(section) == validated(section)


def test_min_replicas_zero_is_admitted_by_both_for_either_role():
    schema = crd_schema()["properties"]["spec"]["properties"]["autoscaling"]
    for role in ("prefill", "decode"):
        assert schema["properties"][role]["properties"]["minReplicas"]["minimum"] == 0
        section = {role: {"minReplicas": 0, "scaleToZeroAfterSeconds": 60}}
        assert validated(section) and admitted(section)
    assert not validated({"decode": {"minReplicas": -1}})


def test_every_cross_field_rule_has_its_cel_rule_in_the_crd():
    """Each section with a cross-field validator carries its CEL twin, and only
    those (the GOOD/BAD cases above hold the two to the same verdicts)."""
    schema = crd_schema()["properties"]["spec"]["properties"]["autoscaling"]
    found = {r["fieldPath"] for r in schema.get("x-kubernetes-validations", [])}
    for key in ("prefill", "decode", "prefillDecodeRatio"):
        found |= {
            f"{key}{r['fieldPath']}"
            for r in schema["properties"][key].get("x-kubernetes-validations", [])
        }
    assert found == {
        ".metricsStaleSeconds",
        ".maxTotalReplicas",
        "prefill.maxReplicas",
        "decode.maxReplicas",
        "prefillDecodeRatio.max",
    }
    with_validators = {
        cls
        for cls in _sections().values()
        if any(
            d.info.mode == "after" for d in cls.__pydantic_decorators__.model_validators.values()
        )
    }
    assert with_validators == set(AUTOSCALING_RULES)
