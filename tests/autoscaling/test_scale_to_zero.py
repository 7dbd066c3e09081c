"""minReplicas 0: idle pools go to zero, the gateway's activation signal brings them back."""

from __future__ import annotations

from pdfleet.operator.autoscaling.control_loop import (
    ActivationCounter,
    ReplicaScrape,
    ScalingLoop,
    gateway_batch_running,
    parse_gateway_activations,
    parse_gateway_batch_running,
)
from pdfleet.operator.autoscaling.policy import FleetObservation, RoleObservation, decide
from pdfleet.operator.autoscaling.spec import AutoscalingSpec

from .helpers import PERIOD, decode, idle_prefill, prefill

ZERO = AutoscalingSpec.from_spec(
    {
        "decode": {"minReplicas": 0, "scaleToZeroAfterSeconds": 60},
        "prefill": {"minReplicas": 0, "scaleToZeroAfterSeconds": 60},
    }
)


def run_idle(spec: AutoscalingSpec, periods: int, busy_until: float = -1.0):
    """Decode d0 and prefill p0, idle from ``busy_until`` on; the decisions per period."""
    state, out = None, []
    for i in range(1, periods + 1):
        t = i * PERIOD
        busy = t <= busy_until
        obs = FleetObservation(
            prefill=RoleObservation((prefill("p0", t, arrivals=2000.0 if busy else 0.0),)),
            decode=RoleObservation(
                (decode("d0", t, kv=0.3 if busy else 0.0, running=3 if busy else 0),)
            ),
        )
        result = decide(spec, obs, t, state)
        state = result.state
        out.append((t, result))
    return out, state


def test_an_idle_pool_goes_to_zero_after_scale_to_zero_after_seconds_and_not_before():
    decisions, _ = run_idle(ZERO, 12, busy_until=30.0)
    zero_at = [t for t, r in decisions if r.decode.desired == 0]
    assert zero_at, "decode never went to zero"
    # Idle from the first sample after t=30 (t=45): 60 s later, not sooner.
    assert zero_at[0] == 45 + 60
    first = next(r for t, r in decisions if t == zero_at[0])
    assert first.decode.code == "idle" and "idle for 60 s" in first.decode.reason
    assert first.prefill.desired == 0 and first.prefill.code == "idle"


def test_a_busy_pool_with_min_replicas_zero_keeps_at_least_one():
    decisions, _ = run_idle(ZERO, 12, busy_until=1e9)
    assert all(r.decode.desired >= 1 and r.prefill.desired >= 1 for _, r in decisions)


def test_min_replicas_one_never_goes_to_zero_even_when_idle():
    spec = AutoscalingSpec.from_spec({"decode": {"scaleToZeroAfterSeconds": 15}})
    decisions, _ = run_idle(spec, 30)
    assert all(r.decode.desired >= 1 for _, r in decisions)


def test_at_zero_only_the_activation_signal_starts_a_replica():
    obs = FleetObservation(
        prefill=RoleObservation(tuple(idle_prefill(PERIOD))),
        decode=RoleObservation((), requested=0),
    )
    held = decide(ZERO, obs, PERIOD)
    assert held.decode.desired == 0 and held.decode.code == "scaled_to_zero"
    activated = decide(
        ZERO,
        FleetObservation(
            prefill=obs.prefill, decode=RoleObservation((), requested=0, activations=3)
        ),
        2 * PERIOD,
        held.state,
    )
    assert activated.decode.desired == 1 and activated.decode.code == "activation"
    assert "3 requests found no decode replica" in activated.decode.reason


def test_prefill_at_zero_stays_there_with_decode_up_until_requests_want_it():
    # Conditional mode serves decode-only meanwhile: prefill at zero is fine
    # until the gateway reports prompts that wanted a prefill leg.
    spec = AutoscalingSpec.from_spec(
        {"prefill": {"minReplicas": 0}, "prefillDecodeRatio": {"min": 0.5}}
    )
    obs = FleetObservation(
        prefill=RoleObservation((), requested=0),
        decode=RoleObservation((decode("d0", PERIOD, kv=0.5, running=8),)),
    )
    result = decide(spec, obs, PERIOD)
    assert result.prefill.desired == 0  # the ratio guardrail leaves a role at zero alone
    wanted = FleetObservation(prefill=RoleObservation((), 0, activations=1), decode=obs.decode)
    assert decide(spec, wanted, 2 * PERIOD, result.state).prefill.desired == 1


def test_activation_counter_counts_the_rise_per_gateway_and_survives_a_restart():
    counter = ActivationCounter()
    assert counter.update({"gw-a": {"decode": 5.0, "prefill": 0.0}}) == {
        "prefill": 0.0,
        "decode": 0.0,
    }  # the first reading is the baseline
    assert counter.pending({"gw-a": {"decode": 7.0, "prefill": 0.0}}) == {"decode"}
    rise = counter.update({"gw-a": {"decode": 7.0, "prefill": 1.0}, "gw-b": {"decode": 4.0}})
    assert rise == {"prefill": 1.0, "decode": 2.0}
    # gw-a restarted (its counter went back to 1): the 1 counts in full.
    assert counter.update({"gw-a": {"decode": 1.0}, "gw-b": {"decode": 6.0}})["decode"] == 3.0


def test_gateway_activation_series_are_parsed_by_role():
    text = (
        "# HELP pdfleet_gateway_activation_requests_total x\n"
        "# TYPE pdfleet_gateway_activation_requests_total counter\n"
        'pdfleet_gateway_activation_requests_total{role="decode"} 4.0\n'
        'pdfleet_gateway_activation_requests_total{role="prefill"} 2.0\n'
    )
    assert parse_gateway_activations(text) == {"prefill": 2.0, "decode": 4.0}
    assert parse_gateway_activations("") == {"prefill": 0.0, "decode": 0.0}


def test_the_gateways_running_batch_requests_are_parsed_and_not_summed():
    text = (
        "# TYPE pdfleet_gateway_batch_requests gauge\n"
        'pdfleet_gateway_batch_requests{state="pending"} 900.0\n'
        'pdfleet_gateway_batch_requests{state="running"} 4.0\n'
    )
    assert parse_gateway_batch_running(text) == 4.0
    assert parse_gateway_batch_running("") == 0.0
    # Replicas sharing one store each report all of it: the maximum.
    assert gateway_batch_running([4.0, 4.0, 3.0]) == 4.0
    assert gateway_batch_running([]) == 0.0


def test_the_loop_passes_activations_to_the_policy_and_names_no_victim_at_zero():
    loop = ScalingLoop()
    scrapes = [ReplicaScrape("p0", "prefill", "ready", None)]
    step = loop.step(ZERO, scrapes, PERIOD, requested={"decode": 0}, activations={"decode": 2})
    (action,) = [a for a in step.actions if a.role == "decode"]
    assert (action.current, action.desired, action.victims) == (0, 1, ())
