"""One request cannot take an engine: `n` and `n × max_tokens` are bounded (400
naming the field, at the engine and at the gateway, with one check), and the
scheduler never lets one request's sequences hold every slot while others wait.

The latency that follows from the scheduling rule (a small request's TTFT next
to an ``n=128`` request) is measured by benchmarks/n_fairness.py, not here.
"""

from __future__ import annotations

import httpx
import pytest
from helpers.fleet import ENGINE_ARGS, start_gateway
from helpers.server import ServerProcess

from pdfleet.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from pdfleet.engine.contracts.sampling_checks import check_sampling
from pdfleet.engine.core.sched_output import ModelRunnerOutput
from pdfleet.engine.core.scheduler import Scheduler
from pdfleet.engine.request import Request, RequestStatus
from pdfleet.engine.sampling_params import SamplingParams

# -- the scheduler on its own ------------------------------------------------------------


def scheduler(seqs=8, tokens=64, caching=True, share=0.5, policy="fcfs") -> Scheduler:
    config = EngineConfig(
        model_config=ModelConfig(model="m", max_model_len=256),
        cache_config=CacheConfig(block_size=8, enable_prefix_caching=caching),
        scheduler_config=SchedulerConfig(
            max_num_batched_tokens=tokens,
            max_num_seqs=seqs,
            max_model_len=256,
            max_request_share=share,
            policy=policy,
        ),
        device_config=DeviceConfig(device="cpu"),
    )
    return Scheduler(config, 256, None)


def req(rid: str, n_prompt: int = 4, group: str | None = None, max_tokens: int = 100) -> Request:
    return Request(
        rid,
        list(range(10, 10 + n_prompt)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        group_id=group,
    )


def step(s: Scheduler):
    out = s.schedule()
    sampled = {
        rid: 1
        for rid in out.num_scheduled_tokens
        if s.requests[rid].num_computed_tokens == s.requests[rid].num_tokens
    }
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
    return out


def running_of(s: Scheduler, group: str) -> int:
    return sum(1 for r in s.running if r.group == group)


def test_a_request_alone_may_use_every_slot():
    s = scheduler(seqs=8)
    for i in range(8):
        s.add_request(req(f"big-{i}", group="big"))
    step(s)
    assert running_of(s, "big") == 8 and s.num_preemptions == 0


def test_a_full_engine_gives_a_waiting_request_a_slot_at_its_next_step():
    s = scheduler(seqs=8)
    for i in range(8):
        s.add_request(req(f"big-{i}", group="big"))
    for _ in range(3):
        step(s)  # all eight decode; nothing else waits
    assert running_of(s, "big") == 8
    s.add_request(req("small", max_tokens=5))
    out = step(s)
    assert "small" in out.num_scheduled_tokens, "the small request waited for a big one to end"
    assert s.requests["small"].status == RequestStatus.RUNNING
    # Only as many sequences as the waiting request needs were given back.
    assert running_of(s, "big") == 7 and s.num_preemptions == 1
    # The preempted one stays out while the small request runs, and comes back after.
    for _ in range(200):
        if "small" not in s.requests:
            break
        assert len(s.running) <= 8
        step(s)
    assert "small" not in s.requests
    step(s)
    assert running_of(s, "big") == 8


def test_a_group_takes_at_most_its_share_while_others_wait():
    s = scheduler(seqs=8)
    for i in range(8):
        s.add_request(req(f"big-{i}", group="big"))
    for i in range(3):
        s.add_request(req(f"other-{i}"))
    out = step(s)
    assert running_of(s, "big") == 4  # max_request_share 0.5 of 8 slots
    assert {"other-0", "other-1", "other-2"} <= set(out.num_scheduled_tokens)
    assert s.num_preemptions == 0


def test_a_group_takes_at_most_its_share_of_the_token_budget_while_others_wait():
    # No prefix caching: each of the n sequences prefills the whole prompt itself.
    s = scheduler(seqs=8, tokens=64, caching=False)
    for i in range(4):
        s.add_request(req(f"big-{i}", n_prompt=60, group="big"))
    s.add_request(req("small", n_prompt=20))
    out = step(s)
    big = sum(n for rid, n in out.num_scheduled_tokens.items() if rid.startswith("big"))
    assert big <= 32 and out.num_scheduled_tokens.get("small") == 20


def test_two_groups_each_at_its_share_still_make_room_for_a_third_without_thrashing():
    s = scheduler(seqs=8)
    for i in range(8):
        s.add_request(req(f"a-{i}", group="a", max_tokens=1000))
    step(s)
    for i in range(8):
        s.add_request(req(f"b-{i}", group="b", max_tokens=1000))
    for _ in range(2):
        step(s)
    assert (running_of(s, "a"), running_of(s, "b")) == (4, 4)  # every slot, each at its share
    preemptions = s.num_preemptions
    s.add_request(req("small", max_tokens=30))
    out = step(s)
    assert "small" in out.num_scheduled_tokens, "two groups at their share kept every slot"
    # One slot given back, by the newest group's newest sequence.
    assert s.num_preemptions == preemptions + 1
    assert (running_of(s, "a"), running_of(s, "b")) == (4, 3)
    assert s.requests["b-3"].status == RequestStatus.PREEMPTED
    # Groups one apart keep their slots: nothing more is preempted while the small
    # request runs, and the freed slot goes back to b when it ends.
    while "small" in s.requests:
        assert running_of(s, "a") + running_of(s, "b") == 7
        step(s)
    step(s)
    assert (running_of(s, "a"), running_of(s, "b")) == (4, 4)
    assert s.num_preemptions == preemptions + 1


def test_the_group_with_most_slots_gives_back_until_every_waiting_group_is_within_one():
    s = scheduler(seqs=8, share=0.75)
    for i in range(8):
        s.add_request(req(f"a-{i}", group="a", max_tokens=1000))
    step(s)
    for i in range(2):
        s.add_request(req(f"b-{i}", group="b", max_tokens=1000))
    out = step(s)
    # b's two requests: a (8, over 2 + 1) gives back two slots, newest first.
    assert {"b-0", "b-1"} <= set(out.num_scheduled_tokens)
    assert (running_of(s, "a"), running_of(s, "b")) == (6, 2)
    assert {r for r in ("a-6", "a-7") if s.requests[r].status == RequestStatus.PREEMPTED} == {
        "a-6",
        "a-7",
    }
    # A third group with three requests: a (the most) gives back until no group is
    # more than one ahead of c; b, already within one, keeps its two.
    s.add_request(req("c-0", group="c", max_tokens=1000))
    s.add_request(req("c-1", group="c", max_tokens=1000))
    s.add_request(req("c-2", group="c", max_tokens=1000))
    step(s)
    counts = (running_of(s, "a"), running_of(s, "b"), running_of(s, "c"))
    assert counts == (3, 2, 3), counts  # max-min: nobody more than one ahead of c
    for _ in range(5):
        step(s)
        assert (running_of(s, "a"), running_of(s, "b"), running_of(s, "c")) == counts


def test_share_one_turns_the_bound_off():
    s = scheduler(seqs=8, share=1.0)
    for i in range(8):
        s.add_request(req(f"big-{i}", group="big"))
    step(s)
    s.add_request(req("small"))
    out = step(s)
    assert "small" not in out.num_scheduled_tokens and s.num_preemptions == 0


# -- the shared check ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"n": 9}, "n"),
        ({"n": 2, "best_of": 9}, "best_of"),
        ({"n": 4, "max_tokens": 17}, "max_tokens"),
        ({"n": 2, "max_completion_tokens": 40}, "max_completion_tokens"),
        ({"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 11}, "max_tokens"),
    ],
)
def test_the_shared_check_names_the_field_over_the_bound(body, field):
    with pytest.raises(ValueError, match=f"^{field}") as e:
        check_sampling(body, max_n=8, max_output_tokens=64)
    assert str(e.value).split()[0].rstrip(":") == field
    check_sampling({"n": 8, "max_tokens": 8}, max_n=8, max_output_tokens=64)


# -- real processes ----------------------------------------------------------------------

CAPS = ["--max-n", "4", "--max-request-output-tokens", "64"]


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    proc = ServerProcess(
        ["serve", tiny_model, *ENGINE_ARGS, *CAPS], tmp_path_factory.mktemp("caps"), "engine"
    )
    try:
        yield proc.wait_healthy(180)
    finally:
        proc.stop()


def refused(resp: httpx.Response) -> str:
    assert resp.status_code == 400, resp.text
    return resp.json()["error"]["param"]


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"prompt": "Hi", "n": 5, "max_tokens": 1}, "n"),
        ("/v1/completions", {"prompt": "Hi", "n": 4, "max_tokens": 17}, "max_tokens"),
        ("/v1/completions", {"prompt": ["Hi", "Yo"], "n": 2, "max_tokens": 17}, "max_tokens"),
        # No max_tokens: the engine counts what the context leaves (512 - prompt) × 2.
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "n": 2},
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 65},
            "max_completion_tokens",
        ),
    ],
)
def test_the_engine_refuses_requests_over_its_bounds(engine, path, body, field):
    resp = httpx.post(
        engine.url + path, json={"model": "tiny", **body}, headers=engine.headers, timeout=60
    )
    assert refused(resp) == field
    assert field in resp.json()["error"]["message"]


def test_the_engine_serves_requests_within_its_bounds(engine):
    resp = httpx.post(
        engine.url + "/v1/completions",
        json={"model": "tiny", "prompt": "Hi", "n": 4, "max_tokens": 16, "ignore_eos": True},
        headers=engine.headers,
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"]) == 4


def test_the_gateway_refuses_them_before_any_engine_is_called(engine, tmp_path):
    # The engine's bounds are larger: a 400 here is the gateway's own.
    gateway = start_gateway(
        [
            "--decode",
            engine.url,
            "--disaggregation-mode",
            "Disabled",
            *CAPS[:2],
            "--max-request-output-tokens",
            "32",
        ],
        tmp_path,
    )
    try:
        for body, field in (
            ({"prompt": "Hi", "n": 5, "max_tokens": 1}, "n"),
            ({"prompt": "Hi", "n": 2, "max_tokens": 17}, "max_tokens"),
        ):
            resp = httpx.post(
                gateway.url + "/v1/completions", json={"model": "tiny", **body}, timeout=60
            )
            assert refused(resp) == field
        ok = httpx.post(
            gateway.url + "/v1/completions",
            json={"model": "tiny", "prompt": "Hi", "n": 2, "max_tokens": 16},
            timeout=60,
        )
        assert ok.status_code == 200, ok.text
    finally:
        gateway.stop()


def test_a_lower_priority_request_takes_no_slot_from_a_higher_priority_group():
    s = scheduler(seqs=4, share=0.5, policy="priority")
    for i in range(4):
        r = req(f"hi-{i}", group="hi", max_tokens=1000)
        r.priority = 0
        s.add_request(r)
    step(s)
    low = req("low", max_tokens=10)
    low.priority = 5  # larger: lower priority
    s.add_request(low)
    for _ in range(3):
        out = step(s)
        assert "low" not in out.num_scheduled_tokens
    assert running_of(s, "hi") == 4 and s.num_preemptions == 0
