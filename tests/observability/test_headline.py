"""The headline load figures in status.roles.* and the -o wide printer columns."""

from __future__ import annotations

from pdfleet.operator.crd import PRINTER_COLUMNS
from pdfleet.operator.headline import merge_role_load, role_load
from pdfleet.operator.scrape import PodSample


def sample(
    pod: str, role: str, ready: bool = True, error: str | None = None, **values
) -> PodSample:
    names = {
        "running": "pdfleet_engine_num_requests_running",
        "waiting": "pdfleet_engine_num_requests_waiting",
        "kv": "pdfleet_engine_kv_cache_usage_ratio",
        "hits": "pdfleet_engine_prefix_cache_hits_total",
        "queries": "pdfleet_engine_prefix_cache_queries_total",
    }
    return PodSample(pod, role, ready, 0.0, {names[k]: v for k, v in values.items()}, error)


def test_role_load_sums_requests_averages_kv_and_skips_pods_without_figures():
    samples = [
        sample("d0", "decode", running=3, waiting=1, kv=0.5, hits=30, queries=100),
        sample("d1", "decode", running=2, waiting=0, kv=0.3, hits=10, queries=100),
        sample("d2", "decode", ready=False, running=50, kv=1.0),  # still loading
        sample("d3", "decode", error="timeout"),  # did not answer
        sample("p0", "prefill", running=1, waiting=4, kv=0.1),
        sample("g0", "gateway"),
    ]
    load = role_load(samples)
    assert set(load) == {"decode", "prefill"}
    assert load["decode"] == {
        "running": 5,
        "waiting": 1,
        "kvCacheUsage": 0.4,
        "prefixHitRate": 0.2,
        "load": "5/1 kv 40% hit 20%",
    }
    assert load["prefill"]["load"] == "1/4 kv 10%"  # no lookups yet: no hit rate


def test_merge_keeps_the_replica_counts_of_the_status_patch():
    patch = {"status": {"roles": {"decode": {"summary": "2/2", "readyReplicas": 2}}}}
    merge_role_load(patch, [sample("d0", "decode", running=1, kv=0.25)])
    decode = patch["status"]["roles"]["decode"]
    assert decode["summary"] == "2/2" and decode["load"] == "1/0 kv 25%"


def test_wide_printer_columns_show_load_per_role_and_the_last_scale_reason():
    wide = {c["name"]: c["jsonPath"] for c in PRINTER_COLUMNS if c.get("priority") == 1}
    assert wide["Prefill load"] == ".status.roles.prefill.load"
    assert wide["Decode load"] == ".status.roles.decode.load"
    assert wide["Last scale"] == ".status.autoscaling.lastDecisions[-1:].reason"
