"""The CRD's autoscaling schema and CEL rules refuse exactly what ``validate()`` refuses.

Each spec below goes through both: the API server's handling of the generated
CRD (defaults, OpenAPI bounds, CEL with cel-python: ``helpers.crd_checks``)
and ``AutoscalingSpec.from_spec``. They must agree, spec by spec.
"""

from __future__ import annotations

import dataclasses

import pytest
from helpers.crd_checks import admit, crd_schema

from pdfleet.engine.config.fields import resolved_fields
from pdfleet.operator.autoscaling.rules import field_bounds, rules_of, spec_key
from pdfleet.operator.autoscaling.spec import AutoscalingSpec


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


def boundary_cases() -> list[tuple[dict, bool]]:
    """For every bounded field: each bound's limit, and a step past it."""
    cases = []
    sections = {"": AutoscalingSpec}
    sections |= {
        spec_key(f): tp
        for f, tp in resolved_fields(AutoscalingSpec)
        if dataclasses.is_dataclass(tp)
    }
    for where, cls in sections.items():
        for f, tp in resolved_fields(cls):
            for bound in field_bounds(f):
                step = 1 if int in (tp, *getattr(tp, "__args__", ())) else 0.01
                past = bound.limit + step if bound.op == "<=" else bound.limit - step
                for value in (bound.limit, past):
                    section = {spec_key(f): value}
                    if where:
                        section = {where: section}
                    cases.append((section, bound.holds(value)))
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
    schema = crd_schema()["properties"]["spec"]["properties"]["autoscaling"]
    found = {r["fieldPath"] for r in schema.get("x-kubernetes-validations", [])}
    for key in ("prefill", "decode", "prefillDecodeRatio"):
        found |= {
            f"{key}{r['fieldPath']}"
            for r in schema["properties"][key].get("x-kubernetes-validations", [])
        }
    wanted = set()
    for cls, key in (
        (AutoscalingSpec, ""),
        *[
            (tp, spec_key(f))
            for f, tp in resolved_fields(AutoscalingSpec)
            if dataclasses.is_dataclass(tp)
        ],
    ):
        for rule in rules_of(cls):
            field = next(g for g in dataclasses.fields(cls) if g.name == rule.field)
            wanted.add(f"{key}.{spec_key(field)}")
    assert found == wanted
    assert len(wanted) == 5
