"""The operator's autoscaling seam runs the real policy over scraped pods."""

from __future__ import annotations

import dataclasses

from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.cluster_autoscaler import PolicyDecider
from pdfleet.operator.scrape import PodSample, parse_metrics

SPEC = AutoscalingSpec.from_spec(
    {
        "periodSeconds": 15,
        "decode": {"minReplicas": 1, "maxReplicas": 4, "scaleDownStabilizationSeconds": 30},
        "prefill": {"minReplicas": 1, "maxReplicas": 4},
    }
)


def pod(
    name: str,
    role: str,
    t: float,
    kv: float,
    running: float,
    waiting: float = 0.0,
    error: str | None = None,
) -> PodSample:
    values = {
        "pdfleet_engine_kv_cache_usage_ratio": kv,
        "pdfleet_engine_num_requests_running": running,
        "pdfleet_engine_num_requests_waiting": waiting,
        "pdfleet_engine_waiting_prompt_tokens": 0.0,
        "pdfleet_engine_prompt_tokens_total": 1000.0 + t,
        "pdfleet_engine_prefill_busy_seconds_total": t / 100,
    }
    return PodSample(name, role, True, t, {} if error else values, error)


def test_a_full_decode_kv_cache_scales_decode_up_with_a_reason():
    decide = PolicyDecider()
    out = []
    for i, t in enumerate((1000.0, 1015.0, 1030.0)):
        samples = [pod("p-0", "prefill", t, 0.05, 1), pod("d-0", "decode", t, 0.95, 30, 6 + i)]
        out = decide("ns/llama", SPEC, samples, {"prefill": 1, "decode": 1}, t)
    decode = [d for d in out if d.role == "decode"]
    assert decode and decode[0].replicas >= 2
    assert "KV" in decode[0].reason or "kv" in decode[0].reason.lower()


def test_failed_scrapes_never_scale_down_and_victims_are_the_least_loaded():
    decide = PolicyDecider()
    replicas = {"prefill": 1, "decode": 3}
    for t in (1000.0, 1015.0, 1030.0, 1045.0, 1060.0, 1075.0):
        samples = [
            pod("p-0", "prefill", t, 0.0, 0),
            pod("d-0", "decode", t, 0.0, 0, error="timeout"),
            pod("d-1", "decode", t, 0.01, 1),
            pod("d-2", "decode", t, 0.0, 0),
        ]
        out = decide("ns/llama", SPEC, samples, replicas, t)
        assert not [d for d in out if d.role == "decode" and d.replicas < 3], out
    # With every scrape healthy and the window passed, decode may come down, idle first.
    for t in range(1090, 1400, 15):
        samples = [
            pod("p-0", "prefill", t, 0.0, 0),
            pod("d-0", "decode", t, 0.0, 0),
            pod("d-1", "decode", t, 0.01, 1),
            pod("d-2", "decode", t, 0.0, 0),
        ]
        out = decide("ns/llama", SPEC, samples, replicas, t)
        down = [d for d in out if d.role == "decode" and d.replicas < 3]
        if down:
            assert "d-1" not in down[0].victims
            break
    else:
        raise AssertionError("an idle decode pool never scaled down")


def test_the_pods_startup_seeds_the_policys_projection_horizon():
    decide = PolicyDecider()
    samples = [
        dataclasses.replace(pod("p-0", "prefill", 1000.0, 0.05, 1), startup_seconds=95.0),
        dataclasses.replace(pod("d-0", "decode", 1000.0, 0.2, 4), startup_seconds=125.0),
    ]
    decide("ns/llama", SPEC, samples, {"prefill": 1, "decode": 1}, 1000.0)
    # The low median of the pods' cold starts, less the period a watched start misses.
    assert decide.loops["ns/llama"].state.startup_seconds == 95.0 - 15.0


def gateway(name: str, t: float, batch_running: float) -> PodSample:
    """A gateway pod as the operator scrapes it (the real text parser)."""
    text = (
        "# TYPE pdfleet_gateway_batch_requests gauge\n"
        f'pdfleet_gateway_batch_requests{{state="pending"}} 900\n'
        f'pdfleet_gateway_batch_requests{{state="running"}} {batch_running}\n'
    )
    return PodSample(name, "gateway", True, t, parse_metrics(text))


def test_running_batch_requests_are_deferrable_demand_not_a_scale_up():
    """A decode replica whose KV is full of Batch API requests (the gateway
    says they run) is not scaled up; the same KV held by online requests is."""

    def decode_out(batch_running: float) -> list:
        decide = PolicyDecider()
        out = []
        for t in (1000.0, 1015.0, 1030.0):
            samples = [
                pod("p-0", "prefill", t, 0.05, 1),
                pod("d-0", "decode", t, 0.95, 30),
                gateway("gw-0", t, batch_running),
                gateway("gw-1", t, batch_running),  # one shared store: the max, not the sum
            ]
            out = decide("ns/llama", SPEC, samples, {"prefill": 1, "decode": 1}, t)
        return [d for d in out if d.role == "decode"]

    assert decode_out(0.0) and decode_out(0.0)[0].replicas >= 2
    assert not [d for d in decode_out(28.0) if d.replicas > 1]
    # Two gateways each reporting 15 of the 30: the max (15) leaves online
    # demand (half the KV, 0.475) that one replica holds.
    assert not [d for d in decode_out(15.0) if d.replicas > 1]
