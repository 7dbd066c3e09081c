"""P/D between engines of different tensor-parallel sizes over real NIXL (host
memory, gloo ranks): every decode rank reads its own KV heads from the prefill
shards that hold them, and the output equals aggregated serving."""

from __future__ import annotations

import os
import time

import pytest
from prometheus_client import generate_latest

from pdfleet.engine.config import EngineArgs, security
from pdfleet.engine.config.metrics import ENGINE_KV_TRANSFER_SHARD_BYTES, parse_metrics
from pdfleet.engine.kv_transfer.base import QUARANTINE
from pdfleet.engine.kv_transfer.layout import HeadRun, IncompatibleKV, head_plan, rank_heads
from pdfleet.engine.kv_transfer.transports import READ_DELAY_ENV, NixlTransport, Remote
from pdfleet.engine.llm_engine import LLMEngine
from pdfleet.engine.metrics import EngineMetrics
from pdfleet.engine.sampling_params import SamplingParams

BLOCK = 16
ENGINE = dict(device="cpu", max_model_len=256, block_size=BLOCK, max_num_seqs=4)
# Prompt lengths: whole blocks plus one token, and several blocks plus a partial one.
LENGTHS = [33, 70]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def engine(path: str, tp: int, role: str | None, port: int = 0) -> LLMEngine:
    kv = None
    if role is not None:
        kv = {"kv_connector": "NixlConnector", "kv_role": role, "kv_port": port}
        kv["kv_connector_extra_config"] = {"transfer_timeout_seconds": 20.0}
    args = EngineArgs(model=path, tensor_parallel_size=tp, kv_transfer_config=kv, **ENGINE)
    return LLMEngine(args.create_engine_config())


def run(llm: LLMEngine, rid: str, prompt: list[int], sp: SamplingParams, params=None):
    """Step one request to its end (bounded); its last output."""
    llm.add_request(rid, {"prompt_token_ids": prompt}, sp, kv_transfer_params=params)
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, f"{rid} did not finish"
        for out in llm.step():
            if out.request_id == rid and out.finished:
                return out  # a producer still holds the blocks: leave them leased
        if llm.stats.num_scheduled_tokens == 0:
            time.sleep(0.002)  # waiting for the pull: poll gently


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


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 900 + 20 for i in range(n)]


PAIRS = ["p1-d2", "p2-d1", "p2-d2"]


@pytest.mark.parametrize("pair", PAIRS)
def test_decode_at_another_tp_size_pulls_its_heads_and_matches_aggregated_serving(engines, pair):
    prefill, decode = (engines[x] for x in pair.split("-"))
    transport = decode.connector.worker.connector.transport
    cfg = decode.config.model_config
    tp = decode.config.parallel_config.tensor_parallel_size
    before = list(transport.rank_bytes)
    pulled_blocks = 0
    for i, n in enumerate(LENGTHS):
        # Prompts no decode engine has seen: none of it is in its prefix cache.
        prompt = prompt_of(n, 10 * PAIRS.index(pair) + i)
        # Aggregated serving: the prefill engine alone, no transfer.
        expected = run(engines["p1"], f"{pair}-agg-{i}", prompt, greedy(8))
        first = run(
            prefill, f"{pair}-pre-{i}", prompt, greedy(1), params={"do_remote_decode": True}
        )
        params = first.kv_transfer_params
        assert params["tp_size"] == prefill.config.parallel_config.tensor_parallel_size
        assert len(params["remote_block_ids"]) == (n - 1) // BLOCK
        got = run(decode, f"{pair}-dec-{i}", prompt, greedy(8), params=params)
        assert got.outputs[0].token_ids == expected.outputs[0].token_ids, f"prompt of {n}"
        pulled_blocks += len(params["remote_block_ids"])
    assert pulled_blocks > 0
    # Each decode rank moved exactly its own heads' share of every pulled block.
    heads = rank_heads(0, tp, cfg.num_key_value_heads)[1]
    per_block = 2 * cfg.num_hidden_layers * BLOCK * heads * cfg.head_dim * 4  # float32
    moved = [a - b for a, b in zip(transport.rank_bytes, before, strict=True)]
    assert moved == [pulled_blocks * per_block] * tp
    # ... and the engine exports it per rank.
    metrics = EngineMetrics(decode.config)
    metrics.update(decode)
    samples = parse_metrics(generate_latest(metrics.registry).decode()).samples
    exported = {
        labels["rank"]: value for labels, value in samples[ENGINE_KV_TRANSFER_SHARD_BYTES.name]
    }
    assert exported == {str(r): float(b) for r, b in enumerate(transport.rank_bytes)}
    stats = decode.connector.worker.connector.stats
    assert stats.failed_transfers == 0
    assert stats.bytes_transferred >= pulled_blocks * per_block * tp
    # Every lease was claimed and confirmed: the producer frees its blocks.
    deadline = time.monotonic() + 10
    while prefill.core.scheduler.held_blocks and time.monotonic() < deadline:
        prefill.step()
        time.sleep(0.01)
    assert not prefill.core.scheduler.held_blocks


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
                    for run in head_plan(rank, local_tp, remote_tp, total):
                        r_first, r_count = rank_heads(run.remote_rank, remote_tp, total)
                        assert run.remote_head + run.num_heads <= r_count
                        got += [r_first + run.remote_head + k for k in range(run.num_heads)]
                    assert got == list(range(first, first + count))


def test_params_whose_tp_size_cannot_hold_the_kv_heads_are_refused_naming_tp_size(engines):
    prefill, decode = engines["p1"], engines["d2"]
    first = run(prefill, "bad-tp-pre", prompt_of(40, 99), greedy(1), {"do_remote_decode": True})
    secret = decode.connector.worker.connector.secret
    params = security.verify_params(secret, first.kv_transfer_params)
    forged = security.sign_params(secret, {**params, "tp_size": 3}, ttl=60)
    with pytest.raises(ValueError, match="kv_transfer_params: tp_size 3 cannot hold"):
        decode.add_request("bad-tp-dec", {"prompt_token_ids": prompt_of(40, 99)}, greedy(2),
                           kv_transfer_params=forged)  # fmt: skip
    assert "bad-tp-dec" not in decode.core.scheduler.requests  # nothing was queued


def test_a_handshake_whose_shards_do_not_fit_its_tp_size_is_refused_naming_tp_size():
    # The control plane of a TP2 consumer (no agent in this process: the ranks hold them).
    transport = NixlTransport("d", "i", ["UCX"], tp_size=2, num_kv_heads=2)
    remote = Remote("p", "j", "127.0.0.1", 1, layout=None)  # type: ignore[arg-type]
    shard = {"rank": 0, "agent_metadata": b"m", "base_address": 0, "num_blocks": 4}
    with pytest.raises(IncompatibleKV, match="tp_size 3 cannot hold the model's 2 KV heads"):
        transport.connect(remote, {"tp_size": 3, "shards": [shard] * 3})
    with pytest.raises(IncompatibleKV, match="shard 0 holds 2 KV heads, but tp_size 2 .* 1"):
        transport.connect(remote, {"tp_size": 2, "shards": [{**shard, "num_kv_heads": 2}] * 2})
    assert not transport.drain()  # nothing reached the ranks
    # A TP1 producer: each rank connects to its one shard and reads its own head.
    transport.connect(remote, {"tp_size": 1, "shards": [{**shard, "num_kv_heads": 2}]})
    commands = transport.drain()
    assert [(rank, c[0], c[3]) for rank, c in commands] == [
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
    connector = decode.connector.worker.connector
    transport, sched = connector.transport, decode.core.scheduler
    prompt = prompt_of(70, 77)
    params = run(prefill, "abort-pre", prompt, greedy(1), {"do_remote_decode": True})
    engines["delay"].write_text("1.5")  # every READ posted from now on waits 1.5 s
    try:
        tokens = transport.next_token
        decode.add_request("abort-dec", {"prompt_token_ids": prompt}, greedy(4),
                           kv_transfer_params=params.kv_transfer_params)  # fmt: skip
        deadline = time.monotonic() + 20
        while transport.next_token == tokens or transport.outbox:  # READs shipped to ranks
            assert time.monotonic() < deadline, "the pull never started"
            decode.step()
            time.sleep(0.002)
        decode.abort_request("abort-dec")
        held = sched.held_blocks.get(QUARANTINE + "abort-dec")
        assert held, "a READ may still write the blocks: they must be quarantined"
    finally:
        engines["delay"].write_text("0")
    # Once every rank's READ has completed the blocks go back to the pool.
    deadline = time.monotonic() + 20
    while sched.held_blocks and time.monotonic() < deadline:
        decode.step()
        time.sleep(0.005)
    assert not sched.held_blocks
    assert sched.kv.num_free_blocks == sched.kv.num_usable_blocks
