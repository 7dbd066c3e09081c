"""The tensor-parallel wire: the step, its result, the ranks' READY and store
records keep their msgpack shapes, round-trip, and refuse malformed bytes."""

from dataclasses import fields

import msgpack
import pytest

from pdfleet.engine.contracts import tp_wire as w
from pdfleet.engine.contracts.kv_connector import RankCommand, ShardInfo, ShardRead, ShardRelease
from pdfleet.engine.core.sched_output import (
    CachedRequestData,
    Logprobs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pdfleet.engine.sampling_params import SamplingParams
from pdfleet.engine.worker.step_wire import pack_result, pack_step, unpack_result, unpack_step


def packed(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


SAMPLING = w.StepSampling(
    **{f.name: getattr(SamplingParams(temperature=0.5), f.name) for f in fields(w.StepSampling)}
)
NEW = w.StepRequest("a", [1, 2, 3], [4], SAMPLING, [0, 1], 2, "lora", "/p", 3)
STEP = w.Step(
    [NEW],
    [w.StepCached("b", [5], 9)],
    {"a": 3, "b": 1},
    4,
    ["c", "z"],
    [RankCommand(0, ShardRead(3, "k", [1], [2])), RankCommand(1, ShardRelease(3))],
)


def test_the_step_keeps_its_array_shape_and_round_trips():
    assert STEP.encode() == packed(
        [
            [["a", [1, 2, 3], [4], SAMPLING.to_wire(), [0, 1], 2, "lora", "/p", 3]],
            [["b", [5], 9]],
            {"a": 3, "b": 1},
            4,
            ["c", "z"],
            [[0, ["read", 3, "k", [1], [2]]], [1, ["release", 3]]],
        ]
    )
    assert w.Step.decode(STEP.encode()) == STEP
    # No commands travel as nil.
    bare = w.Step([], [], {}, 0, [], [])
    assert msgpack.unpackb(bare.encode())[5] is None
    assert w.Step.decode(bare.encode()) == bare


def test_the_engine_s_step_and_result_map_onto_the_wire_and_back():
    out = SchedulerOutput(
        [NewRequestData("a", [1, 2], [], SamplingParams(temperature=0.5), [0], 0, None, None, 0)],
        [CachedRequestData("b", [5], 9)],
        {"a": 2, "b": 1},
        3,
        {"z", "c"},
    )
    back, commands = unpack_step(pack_step(out, STEP.commands))
    assert back == out and commands == STEP.commands
    result = ModelRunnerOutput(
        {"a": 5},
        {"a": Logprobs([1, 2], [-0.1, -0.2], 1)},
        {"a": [None, Logprobs([3], [-1.0], 2)]},
        {"x"},
        {"y", "w"},
        set(),
        failed_requests={"c": "LoRA adapter 'f': gone"},
        forward_seconds=0.25,
    )
    assert unpack_result(pack_result(result)) == result
    from pdfleet.engine.lora.manager import LoRAStats
    from pdfleet.engine.worker.step_wire import unpack_result_lora

    stats = LoRAStats(3, 0.5, 1, 2, 4, ["a"], ["a", "b"], {"a": "device", "b": "host"})
    assert unpack_result_lora(pack_result(result, stats)) == (result, stats)
    assert unpack_result_lora(pack_result(result)) == (result, None)
    with pytest.raises(ValueError, match="malformed step LoRA resident"):
        w.StepResult.decode(
            packed([{}, {}, {}, [], [], [], 0.0, {}, [0, 0.0, 0, 0, 0, [], [], {1: 2}]])
        )
    assert msgpack.unpackb(pack_result(result))[4] == ["w", "y"]  # sets travel sorted


@pytest.mark.parametrize(
    ("wire", "why"),
    [
        (b"\xc1", "malformed step: not msgpack"),
        (packed({"new": []}), "malformed step: not a list of 6 items"),
        (packed([[], [], {}, 0, []]), "not a list of 6 items"),
        (packed([[["a"]], [], {}, 0, [], None]), "malformed step request: not a list of 9 items"),
        (packed([[], [["b", [5], "9"]], {}, 0, [], None]), "malformed cached request"),
        (packed([[], [], [], 0, [], None]), "num_scheduled_tokens: not a map"),
        (packed([[], [], {}, True, [], None]), "total_num_scheduled_tokens: not an integer"),
        (packed([[], [], {}, 0, [], [[0, ["explode"]]]]), "unknown shard command"),
        (packed([[], [], {}, 0, [], [7]]), "malformed rank commands"),
        (packed([[], [], {}, 0, [], [[0, 7]]]), "malformed shard command"),
    ],
)
def test_a_malformed_step_is_refused_naming_what(wire, why):
    with pytest.raises(ValueError, match=why):
        w.Step.decode(wire)


def test_the_sampling_carrier_is_sampling_params_fields_as_they_were_sent():
    # The same names in the same order: the map's bytes are what the engine's
    # SamplingParams fields by name always were.
    names = [f.name for f in fields(SamplingParams) if f.init]
    assert [f.name for f in fields(w.StepSampling)] == names
    params = SamplingParams(temperature=0, stop=["x"], logit_bias={5: 2.0}, seed=3)
    out = SchedulerOutput(
        [NewRequestData("a", [1], [], params, [0], 0, None, None, 0)], [], {"a": 1}, 1, set()
    )
    wire = msgpack.unpackb(pack_step(out))[0][0][3]
    assert wire == {n: getattr(params, n) for n in names} | {"logit_bias": [[5, 2.0]]}
    assert type(wire["temperature"]) is int  # kept as given, not coerced
    back, _ = unpack_step(pack_step(out))
    assert back.scheduled_new_reqs[0].sampling_params == params


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"nope": 1}, r"unknown fields \['nope'\], missing fields \[\]"),
        ({"temperature": "hot"}, "temperature is str"),
        ({"ignore_eos": 1}, "ignore_eos is int"),
        ({"n": True}, "n is bool"),
        ({"structured_outputs": {"regex": "a"}}, "structured_outputs is dict"),
        ({"top_p": 7.0}, "top_p must be"),  # what SamplingParams itself refuses
    ],
)
def test_a_step_with_a_malformed_sampling_map_is_refused(change, why):
    row = ["a", [1], [], SAMPLING.to_wire() | change, [0], 0, None, None, 0]
    with pytest.raises(ValueError, match=f"malformed step sampling: .*{why}"):
        unpack_step(packed([[row], [], {}, 1, [], None]))
    missing = SAMPLING.to_wire()
    del missing["seed"]
    with pytest.raises(ValueError, match=r"missing fields \['seed'\]"):
        w.Step.decode(
            packed([[["a", [1], [], missing, [0], 0, None, None, 0]], [], {}, 1, [], None])
        )


def test_a_malformed_result_is_refused():
    with pytest.raises(ValueError, match="not a list of 8 items"):
        w.StepResult.decode(packed([{}, {}, {}, [], [], [], 0.0]))
    with pytest.raises(ValueError, match="forward_seconds is not a number"):
        w.StepResult.decode(packed([{}, {}, {}, [], [], [], "0", {}]))
    with pytest.raises(ValueError, match="malformed logprobs: not a list of 3 items"):
        w.StepResult.decode(packed([{}, {"a": [1]}, {}, [], [], [], 0.0, {}]))
    with pytest.raises(ValueError, match="malformed failed_requests"):
        w.StepResult.decode(packed([{}, {}, {}, [], [], [], 0.0, {"a": 1}]))


def test_ready_records_agent_specs_and_pipe_messages():
    info = ShardInfo(1, b"md", 4096, 0, 17, 2)
    ready = w.RankReady(17, 256, info, {"num_layers": 2})
    assert ready.encode() == packed([17, 256, info.to_wire(), {"num_layers": 2}])
    assert w.RankReady.decode(ready.encode()) == ready
    assert w.ready_record(ready.encode()) == ready
    assert w.ready_record(w.RankFailure("boom").encode()) == w.RankFailure("boom")
    assert w.RankFailure("boom").encode() == packed({"error": "boom"})
    with pytest.raises(ValueError, match="ready num_blocks: not an integer"):
        w.RankReady.decode(packed(["17", 256, None, None]))
    with pytest.raises(ValueError, match="not a list of 4 items"):
        w.ready_record(packed([1, 2]))

    spec = w.KVAgentSpec("agent", ["UCX"], True)
    assert spec.encode(spec) == packed({"name": "agent", "backends": ["UCX"], "report": True})
    assert w.KVAgentSpec.decode(spec.encode(spec)) == spec
    assert w.KVAgentSpec.decode(w.KVAgentSpec.encode(None)) is None
    with pytest.raises(ValueError, match="KV agent report: not a boolean"):
        w.KVAgentSpec.decode(packed({"name": "a", "backends": [], "report": 1}))
    with pytest.raises(ValueError, match="KV agent backends: not strings"):
        w.KVAgentSpec.decode(packed({"name": "a", "backends": [7], "report": False}))

    assert w.read_rank_message(w.rank_message(w.READY, b"x")) == (w.READY, b"x")
    assert w.read_rank_message(w.rank_error("x" * 70000)) == (w.ERROR, b"x" * w.MAX_ERROR_CHARS)
    with pytest.raises(ValueError, match="unknown rank message tag b'Q'"):
        w.read_rank_message(b"Qhello")
    assert w.error_text(b"bad \xff") == "bad \ufffd"


def test_lora_loads_drops_and_statuses_round_trip_and_bad_ones_are_refused():
    load = w.LoRALoad("sql", 7, "/adapters/sql", "ab" * 32)
    assert w.LoRALoad.decode(load.encode()) == load
    assert msgpack.unpackb(load.encode()) == ["sql", 7, "/adapters/sql", "ab" * 32]
    with pytest.raises(ValueError, match="malformed LoRA load lora_id"):
        w.LoRALoad.decode(msgpack.packb(["sql", "7", "/a", "d"]))
    with pytest.raises(ValueError, match="malformed LoRA load: not a list of 4"):
        w.LoRALoad.decode(msgpack.packb(["sql", 7, "/a"]))
    assert w.decode_lora_drop(w.encode_lora_drop(7)) == (7, False)
    assert w.decode_lora_drop(w.encode_lora_drop(7, True)) == (7, True)
    with pytest.raises(ValueError, match="malformed LoRA drop: keep is not a bool"):
        w.decode_lora_drop(msgpack.packb([7, 1]))
    with pytest.raises(ValueError, match="malformed LoRA drop: not a list of 2"):
        w.decode_lora_drop(msgpack.packb(7))
    ok = w.lora_status(None)
    assert len(ok) == w.LORA_STATUS_BYTES and w.lora_status_error(ok) is None
    long = "é" * w.LORA_STATUS_BYTES  # cut to fit, mid-character: still text
    assert w.lora_status_error(w.lora_status(long)).startswith("é" * 100)
    assert w.lora_status_error(w.lora_status("no such file")) == "no such file"
    with pytest.raises(ValueError, match="malformed LoRA status"):
        w.lora_status_error(b"short")
