"""Probes of band preemption under the priority policy: a waiting request of a
better band preempts running requests of worse bands only when that makes room
for it (with the free blocks and, when every slot is taken, a slot); otherwise it
preempts nobody, and the worse bands keep stepping. Scheduler-level, block size 8:
milliseconds each."""

from __future__ import annotations

import pytest
from engine.test_scheduler import FakeRemote, make, request, step
from engine.test_scheduler_pull_probes import loading, pulling, sample

from pdfleet.engine.contracts.priority import TAG_BITS
from pdfleet.engine.core.sched_output import ModelRunnerOutput
from pdfleet.engine.request import Request, RequestStatus
from pdfleet.engine.sampling_params import SamplingParams


def band(b: int) -> int:
    return b << TAG_BITS


def running(s, *rids: str) -> None:
    """Step until every request named runs past its prompt."""
    for _ in range(10):
        if all(
            s.requests[r].status == RequestStatus.RUNNING
            and s.requests[r].num_computed_tokens >= s.requests[r].num_prompt_tokens
            for r in rids
        ):
            return
        step(s)
    raise AssertionError("the requests did not start")


@pytest.mark.parametrize(
    ("r_prompt", "head_prompt", "makes_room"),
    [
        (38, 56, True),  # 1 free + 3 (band 7) + 3 (band 3): the 7 blocks it needs
        (38, 64, False),  # 8 blocks: all the worse bands' and the free one are 7
        (40, 56, False),  # r's decode takes the free block first (its 41st token)
    ],
)
def test_victims_in_several_worse_bands_are_preempted_only_together_with_enough(
    r_prompt, head_prompt, makes_room
):
    s = make(num_blocks=12, tokens=128, policy="priority")
    s.add_request(request("r", r_prompt, max_tokens=20, first=1000))  # 5 blocks
    s.add_request(request("a", 20, max_tokens=20, priority=band(3), arrival=1.0, first=2000))
    s.add_request(request("c", 20, max_tokens=20, priority=band(7), arrival=2.0, first=3000))
    running(s, "r", "a", "c")
    assert s.kv.num_free_blocks == 1
    s.add_request(request("head", head_prompt, first=4000, arrival=3.0))
    out = step(s)
    if makes_room:
        # Both worse bands' requests, the worst first: one alone would not do.
        assert s.requests["c"].num_preemptions == 1 and s.requests["a"].num_preemptions == 1
        assert set(out.num_scheduled_tokens) == {"r", "head"}
    else:
        assert s.num_preemptions == 0
        assert set(out.num_scheduled_tokens) == {"r", "a", "c"}  # none held out for head


def test_only_as_many_victims_as_make_room_worst_band_and_newest_first():
    s = make(num_blocks=12, tokens=128, policy="priority")
    s.add_request(request("a", 20, max_tokens=20, priority=band(3), arrival=0.0, first=1000))
    s.add_request(request("b", 20, max_tokens=20, priority=band(7), arrival=1.0, first=2000))
    s.add_request(request("c", 20, max_tokens=20, priority=band(7), arrival=2.0, first=3000))
    s.add_request(request("d", 20, max_tokens=20, priority=band(3), arrival=3.0, first=4000))
    running(s, "a", "b", "c", "d")  # 12 blocks: none free
    s.add_request(request("head", 40, first=5000, arrival=4.0))  # 5 blocks
    out = step(s)
    assert {r for r in "abcd" if s.requests[r].num_preemptions} == {"b", "c"}
    assert "head" in out.num_scheduled_tokens


@pytest.mark.parametrize(("pull", "makes_room"), [(False, True), (True, False)])
def test_a_chunk_finds_room_where_a_pull_of_the_whole_prompt_would_not(pull, makes_room):
    """4 free blocks and a worse band's 3: a plain head's first chunk (40 tokens, 5
    blocks) fits once that band gives its blocks up; a pull takes blocks for the
    whole prompt it loads (64 tokens, 8 blocks), which even that would not make."""
    s = make(num_blocks=12, tokens=64, threshold=40, connector=FakeRemote(), policy="priority")
    s.add_request(request("r", 38, max_tokens=20, first=1000))  # 5 blocks
    s.add_request(request("a", 20, max_tokens=20, priority=band(7), arrival=1.0, first=2000))
    running(s, "r", "a")
    assert s.kv.num_free_blocks == 4
    head = pulling("head", 64, first=3000) if pull else request("head", 64, first=3000)
    head.arrival_time = 2.0
    s.add_request(head)
    out = step(s)
    if makes_room:
        assert s.requests["a"].num_preemptions == 1
        assert out.num_scheduled_tokens["head"] == 40
    else:
        assert s.num_preemptions == 0
        assert s.requests["head"].status == RequestStatus.WAITING  # not loading
        assert set(out.num_scheduled_tokens) == {"r", "a"}


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize(("head_prompt", "makes_room"), [(56, True), (64, False)])
def test_blocks_of_a_victim_that_stay_taken_or_that_the_head_hits_are_no_room(
    shared, head_prompt, makes_room
):
    """``a`` holds 5 blocks: 4 cached ones the head's prompt starts with (shared with
    a running request of band 0, or not), and 1 of its own. Preempting it makes one
    block of room for the head: a shared block stays taken, and a hit freed leaves
    the free list again when the head takes it. With 2 free blocks, a head that
    needs 3 new ones preempts it, one that needs 4 does not."""
    s = make(num_blocks=13 if shared else 12, tokens=128, policy="priority")
    if shared:
        s.add_request(request("r", 33, max_tokens=20, first=0))  # 5 blocks, 4 full
        running(s, "r")
    s.add_request(request("a", 33, max_tokens=20, priority=band(7), arrival=1.0, first=0))
    s.add_request(request("q", 38, max_tokens=20, arrival=2.0, first=1000))  # 5 blocks
    running(s, "a", "q")
    assert s.kv.num_free_blocks == 2
    tokens = list(range(32)) + list(range(5000, 5000 + head_prompt - 32))
    s.add_request(Request("head", tokens, SamplingParams(max_tokens=4), arrival_time=3.0))
    out = step(s)
    if makes_room:
        assert s.requests["a"].num_preemptions == 1 and "head" in out.num_scheduled_tokens
    else:
        assert s.num_preemptions == 0
        assert "a" in out.num_scheduled_tokens and "head" not in out.num_scheduled_tokens


@pytest.mark.parametrize(("head_prompt", "makes_room"), [(56, True), (64, False)])
def test_a_worse_band_gives_its_slot_up_only_with_the_blocks_the_head_needs(
    head_prompt, makes_room
):
    s = make(num_blocks=12, tokens=128, seqs=2, policy="priority")
    s.add_request(request("r", 38, max_tokens=20, first=1000))  # 5 blocks
    s.add_request(request("a", 20, max_tokens=20, priority=band(7), arrival=1.0, first=2000))
    running(s, "r", "a")  # every slot; 4 blocks free, a's 3: 7
    s.add_request(request("head", head_prompt, first=3000, arrival=2.0))
    out = step(s)
    if makes_room:
        assert s.requests["a"].num_preemptions == 1
        assert set(out.num_scheduled_tokens) == {"r", "head"}
    else:
        assert s.num_preemptions == 0
        assert set(out.num_scheduled_tokens) == {"r", "a"}


@pytest.mark.parametrize(("head_prompt", "makes_room"), [(56, True), (64, False)])
def test_a_landed_pull_gives_its_pulled_blocks_up_only_when_that_makes_room(
    head_prompt, makes_room
):
    s = make(num_blocks=12, tokens=128, connector=FakeRemote(), policy="priority")
    pull = pulling("l", 20, first=2000, max_tokens=20)  # 16 pulled + 4 here: 3 blocks
    pull.priority, pull.arrival_time = band(7), 1.0
    s.add_request(pull)
    s.add_request(request("r", 38, max_tokens=20, first=1000))  # 5 blocks
    for _ in range(10):
        if "l" in s.requests and s.requests["l"].num_output_tokens:
            break
        out = s.schedule()
        s.update_from_output(
            out, ModelRunnerOutput(sampled_token_ids=sample(s, out), finished_recving=loading(s))
        )
    assert s.kv.num_free_blocks == 4  # the pull landed and computed its tail
    s.add_request(request("head", head_prompt, first=3000, arrival=2.0))
    out = step(s)
    if makes_room:
        assert s.requests["l"].num_preemptions == 1
        assert set(out.num_scheduled_tokens) == {"r", "head"}
    else:
        assert s.num_preemptions == 0
        assert set(out.num_scheduled_tokens) == {"r", "l"}
