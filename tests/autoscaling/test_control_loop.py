"""The observe -> decide -> choose-victims loop both actuators run."""

from __future__ import annotations

from pdfleet.operator.autoscaling.control_loop import (
    ReplicaScrape,
    ScalingLoop,
    in_flight,
    replica_load,
)
from pdfleet.operator.autoscaling.samples import EngineSnapshot
from pdfleet.operator.autoscaling.spec import AutoscalingSpec

SPEC = AutoscalingSpec.from_spec(
    {
        "periodSeconds": 15,
        "prefill": {"minReplicas": 1, "maxReplicas": 4, "scaleDownStabilizationSeconds": 30},
        "decode": {"minReplicas": 1, "maxReplicas": 4},
    }
)


def snap(t: float, running: float = 0, waiting: float = 0, held: float = 0, kv: float = 0.0):
    return EngineSnapshot(
        time=t,
        num_running=running,
        num_waiting=waiting,
        kv_cache_usage=kv,
        kv_transfer_held_requests=held,
        waiting_prompt_tokens=0.0,
        prompt_tokens_total=1000.0,
        prefill_busy_seconds_total=1.0,
    )


def test_in_flight_work_counts_running_waiting_and_held_kv_leases():
    assert in_flight(snap(0, running=2, waiting=1, held=3)) == 6
    assert in_flight(None) == 0
    load = replica_load(ReplicaScrape("p-0", "prefill", "ready", snap(0, held=2)))
    assert load.in_flight == 2 and load.ready
    assert not replica_load(ReplicaScrape("p-1", "prefill", "starting")).ready


def test_a_prefill_holding_kv_leases_is_not_the_scale_down_victim():
    loop = ScalingLoop()
    for i in range(40):
        t = 1000.0 + 15 * i
        replicas = [
            # Idle but for its leases; without them it would go first (ties go by name).
            ReplicaScrape("p-0", "prefill", "ready", snap(t, held=4)),
            ReplicaScrape("p-1", "prefill", "ready", snap(t)),
            ReplicaScrape("p-2", "prefill", "ready", snap(t)),
            ReplicaScrape("d-0", "decode", "ready", snap(t)),
        ]
        step = loop.step(SPEC, replicas, t, requested={"prefill": 3, "decode": 1})
        down = [a for a in step.actions if a.role == "prefill" and a.desired < a.current]
        if down:
            assert down[0].victims and "p-0" not in down[0].victims
            assert len(down[0].victims) == down[0].current - down[0].desired
            return
    raise AssertionError("an idle prefill pool never scaled down")


def test_draining_replicas_are_never_victims():
    loop = ScalingLoop()
    for i in range(40):
        t = 1000.0 + 15 * i
        replicas = [
            ReplicaScrape("p-0", "prefill", "draining", snap(t)),
            ReplicaScrape("p-1", "prefill", "ready", snap(t, running=1)),
            ReplicaScrape("p-2", "prefill", "ready", snap(t, running=2)),
            ReplicaScrape("d-0", "decode", "ready", snap(t)),
        ]
        step = loop.step(SPEC, replicas, t)
        for action in step.actions:
            assert "p-0" not in action.victims
            if action.role == "prefill" and action.desired < action.current:
                assert action.victims == ("p-1",)
                return
    raise AssertionError("the prefill pool never scaled down")


def test_a_failed_scrape_keeps_the_last_snapshot_so_the_next_rate_spans_both_periods():
    loop = ScalingLoop()
    loop.observe([ReplicaScrape("p-0", "prefill", "ready", snap(100.0))])
    missing = loop.observe([ReplicaScrape("p-0", "prefill", "ready", None)])
    assert missing["prefill"][0].time is None  # the policy sees missing metrics
    later = loop.observe([ReplicaScrape("p-0", "prefill", "ready", snap(130.0))])
    assert later["prefill"][0].interval_seconds == 30.0


def test_replicas_that_left_are_forgotten():
    loop = ScalingLoop()
    loop.observe([ReplicaScrape("p-0", "prefill", "ready", snap(100.0))])
    loop.observe([ReplicaScrape("p-1", "prefill", "ready", snap(115.0))])
    assert set(loop.snapshots) == {"p-1"}
