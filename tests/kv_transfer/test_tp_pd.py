"""P/D between engines of different tensor-parallel sizes over real NIXL (host
memory, gloo ranks): every decode rank reads its own KV heads from the prefill
shards that hold them, and the output equals aggregated serving."""

from __future__ import annotations

import dataclasses
import os

import pytest
from helpers.tp_pd import (
    ENGINE,
    assert_quarantine_ends,
    check_pair_matches_aggregated,
    greedy,
    prompt_of,
    run,
    start_pull,
)

from pdfleet.engine.config import EngineArgs
from pdfleet.engine.contracts import kv_params
from pdfleet.engine.contracts.kv_connector import HandshakeReply, KVLayoutWire, ShardInfo
from pdfleet.engine.core.connector_side import QUARANTINE
from pdfleet.engine.kv_transfer.layout import HeadRun, IncompatibleKV, head_plan, rank_heads
from pdfleet.engine.kv_transfer.transports import NixlTransport, Remote
from pdfleet.engine.loop.llm_engine import LLMEngine
from pdfleet.engine.testing_hooks import READ_DELAY_ENV


def engine(path: str, tp: int, role: str | None, port: int = 0) -> LLMEngine:
    kv = None
    if role is not None:
        kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_port": port}
        kv["kv_connector_extra_config"] = {"transfer_timeout_seconds": 20.0}
    args = EngineArgs(model=path, tensor_parallel_size=tp, kv_transfer_config=kv, **ENGINE)
    return LLMEngine(args.create_engine_config())


@pytest.fixture(scope="module")
def engines(tiny_model_factory, tmp_path_factory):
    """Prefill and decode engines at TP1 and TP2 (2 KV heads: one per rank at TP2)."""
    from helpers.server import free_port

    path = tiny_model_factory("llama", num_key_value_heads=2)
    # The READ-delay test hook, off until a test writes seconds into the file; the
    # ranks inherit the variable when they start.
    delay = tmp_path_factory.mktemp("tp-pd") / "read-delay"
    delay.write_text("0")
    saved = os.environ.get(READ_DELAY_ENV)
    os.environ[READ_DELAY_ENV] = str(delay)
    made: dict[str, LLMEngine] = {"delay": delay}  # type: ignore[dict-item]
    try:
        for name, tp, role in (
            ("p1", 1, "kv_producer"),
            ("p2", 2, "kv_producer"),
            ("d1", 1, "kv_consumer"),
            ("d2", 2, "kv_consumer"),
        ):
            made[name] = engine(path, tp, role, free_port())
        yield made
    finally:
        for name, llm in made.items():
            if name != "delay":
                llm.shutdown()
        if saved is None:
            os.environ.pop(READ_DELAY_ENV, None)
        else:
            os.environ[READ_DELAY_ENV] = saved


PAIRS = ["p1-d2", "p2-d1", "p2-d2"]


@pytest.mark.parametrize("pair", PAIRS)
def test_decode_at_another_tp_size_pulls_its_heads_and_matches_aggregated_serving(engines, pair):
    prefill, decode = (engines[x] for x in pair.split("-"))
    check_pair_matches_aggregated(prefill, decode, engines["p1"], pair, 10 * PAIRS.index(pair))


def test_the_head_plan_reads_every_local_head_once_from_a_rank_that_holds_it():
    # Sharded both sides: TP1 -> TP2 reads half of the one shard; TP2 -> TP1 both.
    assert head_plan(1, 2, 1, 4) == [HeadRun(0, 2, 0, 2)]
    assert head_plan(0, 1, 2, 4) == [HeadRun(0, 0, 0, 2), HeadRun(1, 0, 2, 2)]
    assert head_plan(1, 4, 2, 8) == [HeadRun(0, 2, 0, 2)]
    # Replicated on the remote side (1 KV head at TP2): one replica, spread by rank.
    assert head_plan(0, 1, 2, 1) == [HeadRun(0, 0, 0, 1)]
    assert head_plan(1, 2, 4, 2) == [HeadRun(3, 0, 0, 1)]
    # Replicated on the local side: each rank reads its one head.
    assert head_plan(3, 4, 1, 2) == [HeadRun(0, 1, 0, 1)]
    for total in (1, 2, 4, 8):
        for local_tp in (1, 2, 4, 8):
            for remote_tp in (1, 2, 4, 8):
                if total % remote_tp and remote_tp % total:
                    continue
                for rank in range(local_tp):
                    first, count = rank_heads(rank, local_tp, total)
                    got = []
                    for hr in head_plan(rank, local_tp, remote_tp, total):
                        r_first, r_count = rank_heads(hr.remote_rank, remote_tp, total)
                        assert hr.remote_head + hr.num_heads <= r_count
                        got += [r_first + hr.remote_head + k for k in range(hr.num_heads)]
                    assert got == list(range(first, first + count))


def test_params_whose_tp_size_cannot_hold_the_kv_heads_are_refused_naming_tp_size(engines):
    prefill, decode = engines["p1"], engines["d2"]
    first = run(prefill, "bad-tp-pre", prompt_of(40, 99), greedy(1), {"do_remote_decode": True})
    secret = decode.connector.worker.connector.secret
    params = kv_params.verify(secret, first.kv_transfer_params)
    forged = kv_params.sign(secret, dataclasses.replace(params, tp_size=3), ttl=60).to_wire()
    with pytest.raises(ValueError, match="kv_transfer_params: tp_size 3 cannot hold"):
        decode.add_request("bad-tp-dec", {"prompt_token_ids": prompt_of(40, 99)}, greedy(2),
                           kv_transfer_params=forged)  # fmt: skip
    assert "bad-tp-dec" not in decode.core.scheduler.requests  # nothing was queued


def test_a_handshake_whose_shards_do_not_fit_its_tp_size_is_refused_naming_tp_size():
    # The control plane of a TP2 consumer (no agent in this process: the ranks hold them).
    transport = NixlTransport("d", "i", ["UCX"], tp_size=2, num_kv_heads=2)
    remote = Remote("p", "j", "127.0.0.1", 1, layout=None)  # type: ignore[arg-type]
    layout = KVLayoutWire(2, 4, 16, 2, 8, "float32", 4, "cpu")

    def reply(tp_size: int, heads: int) -> HandshakeReply:
        wire = HandshakeReply(
            4, "p", "j", {}, "h", layout, "nixl", tp_size,
            [ShardInfo(r, b"m", 0, 0, 4, heads) for r in range(tp_size)],
        ).to_wire()  # fmt: skip
        return HandshakeReply.from_wire(wire)  # what the consumer decodes

    with pytest.raises(IncompatibleKV, match="tp_size 3 cannot hold the model's 2 KV heads"):
        transport.connect(remote, reply(3, 1))
    with pytest.raises(IncompatibleKV, match="shard 0 holds 2 KV heads, but tp_size 2 .* 1"):
        transport.connect(remote, reply(2, 2))
    assert not transport.drain()  # nothing reached the ranks
    # A TP1 producer: each rank connects to its one shard and reads its own head.
    transport.connect(remote, reply(1, 2))
    commands = transport.drain()
    assert [(c.rank, c.command.to_wire()[0], c.command.to_wire()[3]) for c in commands] == [
        (0, "connect", [[0, 0, 0, 1]]),
        (1, "connect", [[0, 1, 0, 1]]),
    ]


def test_zmq_connector_at_tp2_is_refused_before_any_rank_starts(tiny_model):
    kv = {"kv_connector": "ZmqConnector", "kv_role": "kv_consumer", "kv_port": 1}
    args = EngineArgs(model=tiny_model, tensor_parallel_size=2, kv_transfer_config=kv, **ENGINE)
    with pytest.raises(ValueError, match="kv_connector ZmqConnector .* use NixlConnector"):
        LLMEngine(args.create_engine_config())


def test_an_abort_mid_pull_quarantines_the_blocks_until_every_rank_is_done(engines):
    prefill, decode = engines["p1"], engines["d2"]
    prompt = prompt_of(70, 77)
    params = run(prefill, "abort-pre", prompt, greedy(1), {"do_remote_decode": True})
    engines["delay"].write_text("1.5")  # every READ posted from now on waits 1.5 s
    try:
        start_pull(decode, "abort-dec", prompt, params.kv_transfer_params)
        decode.abort_request("abort-dec")
        held = decode.core.scheduler.held_blocks.get(QUARANTINE + "abort-dec")
        assert held, "a READ may still write the blocks: they must be quarantined"
    finally:
        engines["delay"].write_text("0")
    assert_quarantine_ends(decode)
