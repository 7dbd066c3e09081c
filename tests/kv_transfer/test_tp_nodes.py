"""P/D with engines that span nodes (``--nnodes 2``) over real NIXL in host memory.

Each multi-node engine is a leader (rank 0, in this process's engine) and a
``pdfleet serve --headless`` node 1 (rank 1, a subprocess) on localhost. Node
1's rank registers its KV shard with its own agent and publishes it through
the rendezvous store; the leader's handshake lists both shards; a consumer's
rank on node 1 reads its heads directly and its ended reads reach the leader
in the per-step gather.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from helpers.tp_pd import (
    BLOCK,
    ENGINE,
    assert_quarantine_ends,
    check_pair_matches_aggregated,
    greedy,
    prompt_of,
    run,
    start_pull,
)

from pdfleet.engine.config import EngineArgs
from pdfleet.engine.contracts.kv_connector import ShardReadEnded
from pdfleet.engine.core.connector_side import QUARANTINE
from pdfleet.engine.loop.llm_engine import LLMEngine
from pdfleet.engine.testing_hooks import READ_DELAY_ENV
from pdfleet.engine.worker.tp_executor import RankFailed
from pdfleet.engine.worker.tp_rank import KV_REPORT_SLOTS, ended_of, ended_tensor


def kv_config(role: str, port: int) -> dict:
    return {
        "kv_connector": "NixlConnector",
        "kv_role": role,
        "kv_port": port,
        "kv_connector_extra_config": {"transfer_timeout_seconds": 20.0},
    }


@pytest.fixture(scope="module")
def engines(tiny_model_factory, tmp_path_factory):
    """TP1 prefill and decode engines, and TP2 ones over two nodes (2 KV heads: one
    per rank). Node 1 of the decode engine delays its READs while the delay file
    says so (the leader's rank does not)."""
    from helpers.server import ServerProcess, free_port

    path = tiny_model_factory("llama", num_key_value_heads=2)
    logs = tmp_path_factory.mktemp("tp-nodes")
    delay = logs / "read-delay"
    delay.write_text("0")
    made: dict = {"delay": delay, "nodes": {}}
    flags = ["--device", "cpu", "--max-model-len", "256", "--block-size", str(BLOCK)]
    flags += ["--max-num-seqs", "4"]
    try:
        multi = {}
        for name, role in (("p2n", "kv_producer"), ("d2n", "kv_consumer")):
            # Both nodes 1 first: they load while the leaders start.
            master, kv = free_port(), kv_config(role, free_port())
            multi[name] = master, kv
            nodes = ["-tp", "2", "--nnodes", "2", "--master-port", str(master)]
            # Node 1 picks its own UCX interface, from its own KV address (127.0.0.1: lo).
            env = {"UCX_NET_DEVICES": ""}
            if name == "d2n":
                env[READ_DELAY_ENV] = str(delay)
            made["nodes"][name] = ServerProcess(
                ["serve", path, *flags, *nodes, "--node-rank", "1", "--headless",
                 "--kv-transfer-config", json.dumps(kv)],
                logs,
                f"{name}-node1",
                env=env,
            )  # fmt: skip
        for name, (master, kv) in multi.items():
            args = EngineArgs(
                model=path,
                tensor_parallel_size=2,
                nnodes=2,
                master_port=master,
                kv_transfer_config=kv,
                **ENGINE,
            )
            made[name] = LLMEngine(args.create_engine_config())
        for name, role in (("p1", "kv_producer"), ("d1", "kv_consumer")):
            args = EngineArgs(model=path, kv_transfer_config=kv_config(role, free_port()), **ENGINE)
            made[name] = LLMEngine(args.create_engine_config())
        yield made
    finally:
        for llm in made.values():
            if isinstance(llm, LLMEngine):
                llm.shutdown()
        for node in made["nodes"].values():
            node.stop()


PAIRS = ["p2n-d1", "p1-d2n", "p2n-d2n"]


@pytest.mark.parametrize("pair", PAIRS)
def test_pd_with_an_engine_over_two_nodes_pulls_each_ranks_heads_and_matches_aggregated(
    engines, pair
):
    # The rank on node 1 is checked like the leader's: its bytes and its metric.
    prefill, decode = (engines[x] for x in pair.split("-"))
    check_pair_matches_aggregated(prefill, decode, engines["p1"], pair, 10 * PAIRS.index(pair))


def test_the_leaders_handshake_lists_the_shard_of_every_node(engines):
    prefill = engines["p2n"]
    assert len(prefill.core.runner.procs) == 1  # rank 1 runs on node 1
    tp_size, shards = prefill.connector.worker.connector.transport.handshake_shards()
    assert tp_size == 2
    assert [s.rank for s in shards] == [0, 1]
    # Two agents, two registered buffers: node 1's shard is its own rank's memory.
    metadata = [s.agent_metadata for s in shards]
    assert metadata[0] != metadata[1] and all(metadata)
    # Node 1 bound its agents on its own KV address's interface.
    assert "KV shards on 127.0.0.1 (UCX_NET_DEVICES=lo)" in engines["nodes"]["p2n"].log()


def test_ended_reads_beyond_one_reports_slots_survive_the_wire():
    ended = [ShardReadEnded(t, "DONE" if t % 3 else "ERR", t * 10) for t in range(KV_REPORT_SLOTS)]
    assert ended_of(ended_tensor(ended)) == ended
    assert ended_of(ended_tensor([])) == []


def test_an_abort_mid_pull_quarantines_the_blocks_until_the_other_nodes_rank_is_done(engines):
    prefill, decode = engines["p1"], engines["d2n"]
    transport = decode.connector.worker.connector.transport
    prompt = prompt_of(70, 77)
    params = run(prefill, "abort-pre", prompt, greedy(1), {"do_remote_decode": True})
    engines["delay"].write_text("2")  # node 1's READs posted from now on wait 2 s
    try:
        token = start_pull(decode, "abort-dec", prompt, params.kv_transfer_params)
        # Rank 0 (the leader's node) finishes at once; rank 1 holds the pull open.
        deadline = time.monotonic() + 10
        while 0 not in transport.ended.get(token, {}):
            assert time.monotonic() < deadline, "rank 0's READ never ended"
            decode.step()
            time.sleep(0.005)
        assert 1 not in transport.ended[token]
        decode.abort_request("abort-dec")
        held = decode.core.scheduler.held_blocks.get(QUARANTINE + "abort-dec")
        assert held, "node 1 may still write the blocks: they must be quarantined"
    finally:
        engines["delay"].write_text("0")
    # Once node 1's READ completed (its report came back in the gather).
    assert_quarantine_ends(decode)


def test_a_dead_node_takes_its_engine_down_with_a_clear_error_not_a_hang(engines):
    # Last in the file: it ends the decode engine over two nodes.
    decode, node = engines["d2n"], engines["nodes"]["d2n"]
    os.killpg(node.proc.pid, signal.SIGKILL)
    node.proc.wait(10)
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank"):
        run(decode, "after-death", prompt_of(20, 5), greedy(2))
    assert time.monotonic() - start < 60


def test_a_node_whose_rank_cannot_set_up_its_kv_agent_fails_the_leaders_start_naming_it(
    tiny_model_factory, tmp_path
):
    from helpers.server import ServerProcess, free_port

    path = tiny_model_factory("llama", num_key_value_heads=2)
    master, kv = free_port(), kv_config("kv_consumer", free_port())
    flags = ["--device", "cpu", "--max-model-len", "256", "--block-size", str(BLOCK)]
    nodes = ["-tp", "2", "--nnodes", "2", "--master-port", str(master)]
    # UCX on an interface this host lacks: node 1's NIXL agent cannot start.
    node = ServerProcess(
        ["serve", path, *flags, *nodes, "--node-rank", "1", "--headless",
         "--kv-transfer-config", json.dumps(kv)],
        tmp_path,
        "node1",
        env={"UCX_NET_DEVICES": "no-such-nic0"},
    )  # fmt: skip
    try:
        args = EngineArgs(
            model=path,
            tensor_parallel_size=2,
            nnodes=2,
            master_port=master,
            kv_transfer_config=kv,
            **ENGINE,
        )
        start = time.monotonic()
        with pytest.raises(RankFailed, match=r"rank 1 \(node 1\) failed: .*NIXL"):
            LLMEngine(args.create_engine_config())
        assert time.monotonic() - start < 90
        assert node.proc.wait(30) == 1, node.log()  # the node exits, so its group restarts
    finally:
        node.stop()
