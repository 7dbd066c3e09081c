"""The autoscaling section: exact keys, defaults, validation by key name."""

from __future__ import annotations

import re

import pytest

from pdfleet.operator.autoscaling.spec import (
    AutoscalingSpec,
    DecodeScaling,
    PrefillScaling,
    RatioBounds,
)

# The keys the CRD and `pdfleet up` read; renaming one breaks them.
EXPECTED = {
    "mode": "Active",
    "periodSeconds": 15,
    "maxTotalReplicas": None,
    "prefillDecodeRatio": {"min": None, "max": None},
    "metricsStaleSeconds": 45,
    "activationTimeoutSeconds": 120,
    "prefill": {
        "minReplicas": 1,
        "maxReplicas": 4,
        "ttftTargetSeconds": 2.0,
        "prefillTokensPerSecond": None,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 90,
        "maxScaleUpStep": 4,
        "maxScaleDownStep": 1,
        "scaleToZeroAfterSeconds": 300,
        "targetWaitingPerReplica": 4,
    },
    "decode": {
        "minReplicas": 1,
        "maxReplicas": 4,
        "itlTargetSeconds": 0.05,
        "targetKVCacheUsage": 0.7,
        "targetWaitingPerReplica": 4,
        "scaleUpStabilizationSeconds": 0,
        "scaleDownStabilizationSeconds": 90,
        "maxScaleUpStep": 4,
        "maxScaleDownStep": 1,
        "scaleToZeroAfterSeconds": 300,
    },
}


def test_default_section_has_exactly_the_documented_keys_and_values():
    assert AutoscalingSpec().to_spec() == EXPECTED


def test_from_spec_round_trips_the_camel_case_section():
    section = {
        "periodSeconds": 10,
        "maxTotalReplicas": 12,
        "prefillDecodeRatio": {"min": 0.5, "max": 3},
        "prefill": {"maxReplicas": 8, "prefillTokensPerSecond": 9000},
        "decode": {"maxReplicas": 6, "targetKVCacheUsage": 0.8},
    }
    spec = AutoscalingSpec.from_spec(section)
    assert spec.decode.target_kv_cache_usage == 0.8
    assert spec.prefill.prefill_tokens_per_second == 9000.0
    assert spec.prefill_decode_ratio.max == 3.0
    assert AutoscalingSpec.from_spec(spec.to_spec()) == spec


def test_empty_or_missing_section_gives_the_defaults():
    assert AutoscalingSpec.from_spec(None) == AutoscalingSpec()
    assert AutoscalingSpec.from_spec({}) == AutoscalingSpec()


@pytest.mark.parametrize(
    ("section", "message"),
    [
        (
            {"prefill": {"minReplicas": 5}},
            "autoscaling.prefill.maxReplicas: must be at least minReplicas (5), got 4",
        ),
        (
            {"decode": {"minReplicas": -1}},
            "autoscaling.decode.minReplicas: Input should be greater than or equal to 0",
        ),
        (
            {"decode": {"targetKVCacheUsage": 1.5}},
            "autoscaling.decode.targetKVCacheUsage: Input should be less than or equal to 1",
        ),
        (
            {"decode": {"targetKVCacheUsage": 0}},
            "autoscaling.decode.targetKVCacheUsage: Input should be greater than 0",
        ),
        (
            {"prefill": {"ttftTargetSeconds": 0}},
            "autoscaling.prefill.ttftTargetSeconds: Input should be greater than 0",
        ),
        ({"prefill": {"prefillTokensPerSecond": -1}}, "autoscaling.prefill.prefillTokensPerSecond"),
        (
            {"prefill": {"maxScaleUpStep": 0}},
            "autoscaling.prefill.maxScaleUpStep: Input should be greater than or equal to 1",
        ),
        (
            {"decode": {"maxScaleDownStep": 0}},
            "autoscaling.decode.maxScaleDownStep: Input should be greater than or equal to 1",
        ),
        (
            {"decode": {"scaleDownStabilizationSeconds": -1}},
            "autoscaling.decode.scaleDownStabilizationSeconds",
        ),
        ({"decode": {"targetWaitingPerReplica": 0}}, "autoscaling.decode.targetWaitingPerReplica"),
        ({"periodSeconds": 0}, "autoscaling.periodSeconds: Input should be greater than 0"),
        (
            {"metricsStaleSeconds": 5},
            "autoscaling.metricsStaleSeconds: must be at least periodSeconds (15), got 5",
        ),
        (
            {"prefillDecodeRatio": {"min": 2, "max": 1}},
            "autoscaling.prefillDecodeRatio.max: must be at least min (2), got 1",
        ),
        (
            {"prefillDecodeRatio": {"max": 0}},
            "autoscaling.prefillDecodeRatio.max: Input should be greater than 0",
        ),
        (
            {"maxTotalReplicas": 1},
            "autoscaling.maxTotalReplicas: must be at least prefill.minReplicas + decode.minReplicas (2)",
        ),
        ({"decode": {"maxReplicas": "many"}}, "autoscaling.decode.maxReplicas"),
        ({"decode": {"targetKvCacheUsage": 0.5}}, "did you mean targetKVCacheUsage?"),
        (
            {"prefill": {"min_replicas": 2}},
            "autoscaling.prefill.min_replicas: unknown field (did you mean minReplicas?)",
        ),
        ({"prefill": 3}, "autoscaling.prefill: Input should be a valid dictionary"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_key(section, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        AutoscalingSpec.from_spec(section)


def test_constructing_in_python_validates_too():
    with pytest.raises(ValueError, match="maxReplicas"):
        AutoscalingSpec(prefill=PrefillScaling(min_replicas=3, max_replicas=2))


@pytest.mark.parametrize("cls", [AutoscalingSpec, PrefillScaling, DecodeScaling, RatioBounds])
def test_every_field_has_a_docstring_for_the_generated_schema(cls):
    undocumented = [name for name, f in cls.model_fields.items() if not f.description]
    assert undocumented == []
