"""Status from Deployments, metric scraping and the KV-transfer health check."""

from __future__ import annotations

import asyncio
import socket
import time

from pdfleet.operator.resource import InferenceServiceStatus, ScalingRecord, parse_spec
from pdfleet.operator.scrape import (
    KVHealth,
    PodSample,
    parse_metrics,
    pod_startup_seconds,
    scrape_pods,
)
from pdfleet.operator.status import (
    autoscaling_status,
    build_status,
    invalid_status,
    rollout_done,
    set_condition,
)

SPEC = parse_spec({"model": {"name": "m"}, "kvTransfer": {"connector": "NixlConnector"}})
DESIRED = {"prefill": 2, "decode": 2, "gateway": 1}


def deployment(ready: int, updated: int | None = None, replicas: int = 2) -> dict:
    updated = ready if updated is None else updated
    return {
        "metadata": {"generation": 3},
        "spec": {"replicas": replicas},
        "status": {
            "observedGeneration": 3,
            "replicas": replicas,
            "readyReplicas": ready,
            "updatedReplicas": updated,
        },
    }


def status(prefill, decode, gateway, previous=None, now="t1"):
    return build_status(
        SPEC,
        url="http://demo.ns.svc:8000/v1",
        compat="abc",
        deployments={"prefill": prefill, "decode": decode, "gateway": gateway},
        desired=DESIRED,
        previous=previous,
        kv_healthy=True,
        kv_message="ok",
        now=now,
        generation=3,
    )


def conditions(s):
    return {c["type"]: (c["status"], c["reason"]) for c in s["conditions"]}


def test_all_roles_ready_is_phase_ready():
    s = status(deployment(2), deployment(2), deployment(1, replicas=1))
    assert s["phase"] == "Ready"
    assert conditions(s)["Ready"] == ("True", "AllRolesReady")
    assert s["roles"]["decode"]["summary"] == "2/2"
    assert s["observedGeneration"] == 3


def test_serving_without_prefill_is_degraded_not_down():
    s = status(deployment(0, updated=2), deployment(2), deployment(1, replicas=1))
    assert s["phase"] == "Degraded"
    assert conditions(s)["PrefillReady"] == ("False", "NoReplicasReady")
    assert conditions(s)["Ready"][0] == "False"


def test_rolling_pods_are_progressing():
    s = status(deployment(2, updated=1), deployment(2), deployment(1, replicas=1))
    assert s["phase"] == "Progressing"
    assert conditions(s)["PrefillReady"] == ("False", "RollingOut")


def test_condition_keeps_its_transition_time_while_its_status_holds():
    first = set_condition([], "Ready", "False", "A", "", now="t1")
    same = set_condition(first, "Ready", "False", "B", "", now="t2")
    flipped = set_condition(same, "Ready", "True", "C", "", now="t3")
    assert same[0].last_transition_time == "t1"
    assert flipped[0].last_transition_time == "t3"


def test_the_status_is_written_through_its_model_in_its_stored_shape():
    first = status(deployment(2), deployment(2), deployment(1, replicas=1))
    ready = {
        "type": "Ready",
        "status": "True",
        "reason": "AllRolesReady",
        "message": "serving at http://demo.ns.svc:8000/v1",
        "lastTransitionTime": "t1",
        "observedGeneration": 3,
    }
    assert first["conditions"][0] == ready
    assert first["roles"]["gateway"] == {
        "replicas": 1,
        "readyReplicas": 1,
        "updatedReplicas": 1,
        "desiredReplicas": 1,
        "summary": "1/1",
    }
    assert set(first) == {"phase", "url", "compatHash", "conditions", "roles", "observedGeneration"}
    assert InferenceServiceStatus.model_validate(first).phase == "Ready"
    # A periodic refresh (no generation) leaves the stored observedGeneration alone,
    # and keeps each condition's transition time while its status holds.
    later = build_status(
        SPEC,
        url="http://demo.ns.svc:8000/v1",
        compat="abc",
        deployments={"prefill": deployment(2), "decode": deployment(2), "gateway": None},
        desired=DESIRED,
        previous=first,
        kv_healthy=None,
        kv_message="",
        now="t2",
    )
    assert "observedGeneration" not in later
    times = {c["type"]: c["lastTransitionTime"] for c in later["conditions"]}
    assert times["DecodeReady"] == "t1" and times["GatewayReady"] == "t2"
    invalid = invalid_status(later, "spec.x: bad", now="t3", generation=None)
    assert invalid["phase"] == "Failed" and invalid["observedGeneration"] is None
    assert invalid["conditions"][0]["reason"] == "InvalidSpec"


def test_autoscaling_status_keeps_a_bounded_history_and_the_last_scale_time():
    def record(i: int, applied: bool = True) -> ScalingRecord:
        return ScalingRecord.change("decode", i, i + 1, "r", f"t{i}", applied=applied)

    stored = {
        "autoscaling": {"lastDecisions": [record(i).model_dump(by_alias=True) for i in range(9)]}
    }
    active = autoscaling_status(stored, "Active", [record(9), record(10)])
    assert [r["from"] for r in active["lastDecisions"]] == list(range(1, 11))
    assert active["mode"] == "Active" and active["lastScaleTime"] == "t10"
    advised = autoscaling_status(None, "Advisory", [record(1, applied=False)])
    assert advised == {
        "mode": "Advisory",
        "lastDecisions": [
            {"role": "decode", "from": 1, "to": 2, "reason": "r", "time": "t1", "applied": False}
        ],
    }


def test_rollout_done_needs_every_replica_updated_and_ready():
    assert rollout_done(deployment(2))
    assert not rollout_done(deployment(2, updated=1))
    assert not rollout_done(deployment(1))
    stale = deployment(2)
    stale["status"]["observedGeneration"] = 2
    assert not rollout_done(stale)
    assert not rollout_done(None)


def test_parse_metrics_sums_label_sets_and_drops_buckets():
    text = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{engine="0"} 3\n'
        'vllm:num_requests_waiting{engine="1"} 4\n'
        "# TYPE ttft histogram\n"
        'ttft_bucket{le="1.0"} 5\n'
        "ttft_sum 2.5\n"
        "ttft_count 5\n"
    )
    values = parse_metrics(text)
    assert values["vllm:num_requests_waiting"] == 7
    assert values["ttft_sum"] == 2.5 and values["ttft_count"] == 5
    assert not any(name.endswith("_bucket") for name in values)


def kv_sample(pod, failed, ok=None, at=0.0):
    values = {"vllm:nixl_num_failed_transfers_total": failed}
    if ok is not None:
        values["pdfleet_engine_kv_transfers_total"] = ok
    return PodSample(pod, "decode", True, at, values)


def test_kv_health_turns_false_when_a_failure_counter_rises():
    health = KVHealth()
    assert health.update([PodSample("d-1", "decode", True, 0.0)]).healthy is None
    assert health.update([kv_sample("d-1", 2)]).healthy is True  # first sighting: a baseline
    assert health.update([kv_sample("d-1", 2)]).healthy is True
    verdict = health.update([kv_sample("d-1", 5)])
    assert (verdict.healthy, verdict.reason) == (False, "KVTransferDegraded")
    assert "d-1 +3" in verdict.message


def test_kv_health_weighs_failed_against_all_pulls_in_the_window():
    health = KVHealth(window_seconds=60, max_failure_ratio=0.1)
    health.update([kv_sample("d-1", 0, 0, at=0), kv_sample("d-2", 0, 0, at=0)])
    # 1 failure in 100 pulls: within the ratio.
    verdict = health.update([kv_sample("d-1", 1, 50, at=10), kv_sample("d-2", 0, 49, at=10)])
    assert (verdict.healthy, verdict.reason) == (True, "FewFailedTransfers")
    assert "1 of 100" in verdict.message
    # 30 more failures and 10 more good pulls: 31 of 140 is over 10%.
    verdict = health.update([kv_sample("d-1", 31, 50, at=20), kv_sample("d-2", 0, 59, at=20)])
    assert (verdict.healthy, verdict.reason) == (False, "KVTransferDegraded")
    assert "31 of 140" in verdict.message and "d-1 +31" in verdict.message
    # A restarted engine's counters start again from 0: their new value is growth.
    verdict = health.update([kv_sample("d-1", 0, 5, at=30), kv_sample("d-2", 0, 59, at=30)])
    assert "31 of 145" in verdict.message
    # Once the failures leave the window, the condition recovers.
    verdict = health.update([kv_sample("d-1", 0, 105, at=85), kv_sample("d-2", 0, 59, at=85)])
    assert (verdict.healthy, verdict.reason) == (True, "NoFailedTransfers")
    assert "105 KV pulls" in verdict.message


def test_kv_health_keeps_failures_of_an_engine_that_went_away():
    health = KVHealth(window_seconds=60)
    health.update([kv_sample("d-1", 0, 0, at=0)])
    health.update([kv_sample("d-1", 4, 0, at=10)])
    verdict = health.update([kv_sample("d-2", 0, 0, at=20)])  # d-1 was replaced
    assert verdict.healthy is False and "d-1 +4" in verdict.message


def test_a_pod_that_never_answers_costs_at_most_the_scrape_timeout():
    # A listening socket that accepts connections and never replies.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        pod = {
            "metadata": {"name": "d-1", "labels": {"pdfleet.dev/role": "decode"}},
            "spec": {"containers": [{"ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1"},
        }
        no_ip = {"metadata": {"name": "d-2", "labels": {"pdfleet.dev/role": "decode"}}}
        start = time.monotonic()
        samples = asyncio.run(scrape_pods([pod, no_ip], timeout_seconds=0.3))
        elapsed = time.monotonic() - start
    assert elapsed < 2.0
    assert [s.error is not None for s in samples] == [True, True]
    assert samples[1].error == "no pod IP yet"


def test_an_open_kv_circuit_breaker_of_a_gateway_makes_kv_unhealthy():
    health = KVHealth()
    engines = [kv_sample("d-1", 0, 10, at=0)]
    gateway = PodSample("gw-1", "gateway", True, 0.0, {"pdfleet_gateway_kv_pair_open": 2.0})
    verdict = health.update([*engines, gateway])
    assert (verdict.healthy, verdict.reason) == (False, "KVCircuitOpen")
    assert "gw-1 2" in verdict.message
    closed = PodSample("gw-1", "gateway", True, 10.0, {"pdfleet_gateway_kv_pair_open": 0.0})
    verdict = health.update([kv_sample("d-1", 0, 20, at=10), closed])
    assert (verdict.healthy, verdict.reason) == (True, "NoFailedTransfers")


def test_a_decode_engine_under_its_pull_bandwidth_floor_makes_kv_unhealthy():
    health = KVHealth()
    fast = {
        "pdfleet_engine_kv_transfer_failures_total": 0.0,
        "pdfleet_engine_kv_transfers_total": 5.0,
    }
    assert health.update([PodSample("d-1", "decode", True, 0.0, fast)]).healthy is not False
    slow = {
        **fast,
        "pdfleet_engine_kv_transfer_degraded": 1.0,
        "pdfleet_engine_kv_pull_bandwidth_bytes_per_second": 2.5e9,
    }
    verdict = health.update([PodSample("d-1", "decode", True, 10.0, slow)])
    assert verdict.healthy is False and verdict.reason == "KVPullBandwidthLow"
    assert "d-1 2.5 GB/s" in verdict.message
    recovered = {**slow, "pdfleet_engine_kv_transfer_degraded": 0.0}
    assert health.update([PodSample("d-1", "decode", True, 20.0, recovered)]).healthy is True


def _pod(created, ready_status="True", became="2026-12-02T10:01:35Z") -> dict:
    conditions = [{"type": "PodScheduled", "status": "True"}]
    if ready_status is not None:
        conditions.append({"type": "Ready", "status": ready_status, "lastTransitionTime": became})
    return {
        "metadata": {
            "name": "d-1",
            "labels": {"pdfleet.dev/role": "decode"},
            "creationTimestamp": created,
        },
        "status": {"conditions": conditions},
    }


def test_a_pods_startup_is_its_creation_to_its_ready_transition():
    assert pod_startup_seconds(_pod("2026-12-02T10:00:00Z")) == 95.0
    assert pod_startup_seconds(_pod("2026-12-02T10:00:00+00:00")) == 95.0
    # Not ready (yet, or any more), never ready, or times that do not read: unknown.
    assert pod_startup_seconds(_pod("2026-12-02T10:00:00Z", ready_status="False")) is None
    assert pod_startup_seconds(_pod("2026-12-02T10:00:00Z", ready_status=None)) is None
    assert pod_startup_seconds(_pod(None)) is None
    assert pod_startup_seconds(_pod("yesterday")) is None
    assert pod_startup_seconds(_pod("2026-12-02T10:00:00Z", became=None)) is None
    assert pod_startup_seconds(_pod("2026-12-02T10:05:00Z")) is None  # ready before created


def test_scraping_a_pod_carries_its_startup():
    samples = asyncio.run(scrape_pods([_pod("2026-12-02T10:00:00Z")], timeout_seconds=0.3))
    assert [(s.error, s.startup_seconds) for s in samples] == [("no pod IP yet", 95.0)]
