"""The operator exports the autoscaler's decisions (the fleet dashboard's
autoscaling panels and the at-max alert read them)."""

from __future__ import annotations

import kopf
from prometheus_client.parser import text_string_to_metric_families

from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.cluster_autoscaler import PolicyDecider
from pdfleet.operator.handlers import OperatorConfig, OperatorState, register
from pdfleet.operator.scrape import PodSample

SPEC = AutoscalingSpec.from_spec(
    {"periodSeconds": 15, "decode": {"minReplicas": 1, "maxReplicas": 4}, "prefill": {}}
)


def pod(name: str, role: str, t: float, kv: float, running: float, waiting: float = 0.0):
    values = {
        "pdfleet_engine_kv_cache_usage_ratio": kv,
        "pdfleet_engine_num_requests_running": running,
        "pdfleet_engine_num_requests_waiting": waiting,
        "pdfleet_engine_waiting_prompt_tokens": 0.0,
        "pdfleet_engine_prompt_tokens_total": 1000.0 + t,
        "pdfleet_engine_prefill_busy_seconds_total": t / 100,
    }
    return PodSample(name, role, True, t, values)


def samples_of(state: OperatorState) -> dict[tuple[str, tuple], float]:
    from prometheus_client import generate_latest

    out = {}
    for family in text_string_to_metric_families(generate_latest(state.metrics).decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_register_exports_every_decision_of_the_policy_on_the_operator_registry():
    decide = PolicyDecider()
    state = register(kopf.OperatorRegistry(), OperatorConfig(decide=decide), OperatorState())
    replicas = {"prefill": 1, "decode": 4}  # decode already at maxReplicas
    for i, t in enumerate((1000.0, 1015.0, 1030.0)):
        samples = [pod("p-0", "prefill", t, 0.05, 1)] + [
            pod(f"d-{n}", "decode", t, 0.97, 30, 6 + i) for n in range(4)
        ]
        decide("ns/llama", SPEC, samples, replicas, t)
    values = samples_of(state)
    desired = ("pdfleet_autoscaler_desired_replicas", (("mode", "Active"), ("role", "decode")))
    assert values[desired] == 4
    capped = [
        v
        for (name, labels), v in values.items()
        if name == "pdfleet_autoscaler_decisions_total"
        and dict(labels)
        == {"role": "decode", "direction": "none", "reason": "max_replicas", "mode": "Active"}
    ]
    assert capped and capped[0] >= 1, values
