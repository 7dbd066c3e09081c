"""The operator's autoscaling seam runs the real policy over scraped pods."""

from __future__ import annotations

import dataclasses

from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.cluster_autoscaler import PolicyDecider
from pdfleet.operator.scrape import PodSample

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
