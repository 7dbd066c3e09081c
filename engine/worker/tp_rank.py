"""One tensor-parallel rank process: its model shard, its KV-cache shard, its steps.

Started by ``tp_executor.TPExecutor`` (multiprocessing spawn). It joins the
rendezvous, builds its ``ModelRunner`` (which loads only this rank's weight
slices and allocates this rank's KV heads), reports ready, then runs every
step the main process broadcasts until told to stop. It ignores SIGINT and
SIGTERM (the main process drains and then stops it) and exits by itself
within half a second of the main process's death.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..distributed import rendezvous
from ..distributed.parallel_state import set_tp_group

# Message tags on a rank's pipe to the main process.
READY, RESULT, ERROR, KV = b"Y", b"R", b"E", b"K"
# Kinds of control broadcasts.
STEP, STOP = 0, 1
# Test hook: the rank whose number this holds never joins the rendezvous.
TEST_HANG_ENV = "PDFLEET_TP_TEST_HANG_RANK"


@dataclass
class RankSpec:
    config: EngineConfig
    eos_token_ids: tuple[int, ...]
    rank: int
    size: int
    host: str
    port: int
    rendezvous_timeout: float
    num_threads: int
    parent_pid: int
    # The KV connector's shard agent for this rank (``KVConnectorWorker.rank_agents``).
    kv_agent: dict[str, Any] | None = None


def _watch_parent(parent_pid: int) -> None:
    """No orphans: exit once the main process is gone (whatever killed it)."""
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def rank_main(spec: RankSpec, conn: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(spec.parent_pid,), daemon=True).start()
    try:
        _serve(spec, conn)
    except BaseException as e:
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        with contextlib.suppress(OSError):
            conn.send_bytes(ERROR + detail.encode())
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _serve(spec: RankSpec, conn: Any) -> None:
    from .model_runner import ModelRunner
    from .step_wire import pack_result, unpack_step

    if os.environ.get(TEST_HANG_ENV, "") == str(spec.rank):
        time.sleep(3600)
    torch.set_num_threads(spec.num_threads)
    cuda = spec.config.device_config.device == "cuda"
    if cuda:
        torch.cuda.set_device(spec.rank % max(1, torch.cuda.device_count()))
    store = rendezvous.client_store(spec.host, spec.port, spec.size + 1, spec.rendezvous_timeout)
    ctl = rendezvous.control_group(store, spec.rank + 1, spec.size + 1, rendezvous.IDLE_TIMEOUT)
    group = rendezvous.join_tp_group(store, spec.rank, spec.size, "nccl" if cuda else "gloo")
    set_tp_group(group)
    runner = ModelRunner(spec.config, None, spec.eos_token_ids)
    shard, info, layout, report = None, None, None, False
    if spec.kv_agent is not None:
        from ..kv_transfer.layout import KVLayout
        from ..kv_transfer.nixl_shard import ShardAgent

        # This rank's KV shard, registered with its own agent (docs/kv_transfer.md).
        shard = ShardAgent(f"{spec.kv_agent['name']}-r{spec.rank}", spec.kv_agent["backends"])
        info = shard.register(runner.kv_buffer, spec.rank)
        layout = KVLayout.of(runner.kv_buffer).to_dict()
        report = bool(spec.kv_agent["report"])
    conn.send_bytes(
        READY
        + msgpack.packb(
            [runner.num_blocks, spec.config.scheduler_config.max_model_len, info, layout],
            use_bin_type=True,
        )
    )
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    header = torch.zeros(2, dtype=torch.int64)
    while True:
        ctl.broadcast([header], opts).wait()
        nbytes, kind = header.tolist()
        if kind == STOP:
            break
        payload = torch.empty(nbytes, dtype=torch.uint8)
        ctl.broadcast([payload], opts).wait()
        out, commands = unpack_step(payload.numpy().data)
        if shard is not None and commands:
            # Post this rank's READs before the forward: they move while it runs.
            shard.apply([c for rank, c in commands if rank == spec.rank])
        result = runner.execute_model(out)
        if report:
            assert shard is not None
            conn.send_bytes(KV + msgpack.packb(shard.poll()))
        if spec.rank == 0:
            conn.send_bytes(RESULT + pack_result(result))
    if shard is not None:
        shard.shutdown()
    dist.destroy_process_group()
