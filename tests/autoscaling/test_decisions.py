"""Decision records, the bounded history, and the autoscaler's metrics."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdfleet.operator.autoscaling.decisions import (
    AutoscalerMetrics,
    DecisionHistory,
    DecisionLog,
    DecisionRecord,
)
from pdfleet.operator.autoscaling.policy import RoleDecision


def decision(role="decode", current=2, desired=3, code="kv_cache", t=10.0) -> RoleDecision:
    return RoleDecision(role, current, desired, code, f"{role} {current} -> {desired}: x", t)


def test_record_has_the_status_shape():
    record = DecisionRecord.of(decision())
    assert record.to_dict() == {
        "role": "decode",
        "from": 2,
        "to": 3,
        "reason": "decode 2 -> 3: x",
        "code": "kv_cache",
        "time": 10.0,
        "applied": True,
    }
    assert record.direction == "up"
    assert DecisionRecord.of(decision(), applied=False).to_dict()["applied"] is False


def test_history_keeps_only_the_latest_records():
    history = DecisionHistory(capacity=3)
    for i in range(5):
        history.append(DecisionRecord.of(decision(t=float(i))))
    assert [r.time for r in history] == [2.0, 3.0, 4.0]
    assert [r.time for r in history.latest(2)] == [3.0, 4.0]
    assert len(history) == 3


def test_history_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity"):
        DecisionHistory(0)


def test_metrics_expose_desired_replicas_and_decisions_by_direction_and_reason():
    registry = CollectorRegistry()
    log = DecisionLog(AutoscalerMetrics(registry))
    log.record(
        [decision(), decision(role="prefill", current=2, desired=2, code="within_tolerance")]
    )
    log.record([decision(current=3, desired=2, code="kv_cache")])
    text = generate_latest(registry).decode()
    assert 'pdfleet_autoscaler_desired_replicas{mode="Active",role="decode"} 2.0' in text
    assert 'pdfleet_autoscaler_desired_replicas{mode="Active",role="prefill"} 2.0' in text
    assert (
        'pdfleet_autoscaler_decisions_total{direction="up",mode="Active",reason="kv_cache",'
        'role="decode"} 1.0' in text
    )
    assert (
        'pdfleet_autoscaler_decisions_total{direction="none",mode="Active",'
        'reason="within_tolerance",role="prefill"} 1.0' in text
    )


def test_advisory_decisions_are_counted_and_recorded_as_not_applied():
    registry = CollectorRegistry()
    log = DecisionLog(AutoscalerMetrics(registry))
    added = log.record([decision()], mode="Advisory")
    assert [r.applied for r in added] == [False]
    text = generate_latest(registry).decode()
    assert 'pdfleet_autoscaler_desired_replicas{mode="Advisory",role="decode"} 3.0' in text


def test_log_keeps_changes_only():
    log = DecisionLog()
    added = log.record([decision(), decision(role="prefill", current=1, desired=1)])
    assert [r.role for r in added] == ["decode"]
    assert [r.role for r in log.history] == ["decode"]
