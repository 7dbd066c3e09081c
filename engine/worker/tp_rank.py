"""One tensor-parallel rank process: its model shard, its KV-cache shard, its steps.

Started by ``tp_executor.TPExecutor`` (multiprocessing spawn). It joins the
rendezvous, builds its ``ModelRunner`` (which loads only this rank's weight
slices and allocates this rank's KV heads), reports ready, then runs every
step the main process broadcasts until told to stop. It ignores SIGINT and
SIGTERM (the main process drains and then stops it) and exits by itself
within half a second of the main process's death.

A rank on a headless node (``--nnodes > 1``) has no pipe to the leader's
main process: it learns the KV connector's agent from the rendezvous store
and publishes its readiness (with its KV shard's metadata) or its failure
there. Every rank of a consumer reports its ended reads after each step in a
gather over the control group, so the leader hears from every node.
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

import numpy as np
import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..contracts.kv_connector import ShardReadEnded
from ..contracts.tp_wire import (
    KV_AGENT_KEY,
    LORA_DROP,
    LORA_LOAD,
    READY,
    READY_KEY,
    RESULT,
    STOP,
    KVAgentSpec,
    LoRALoad,
    RankFailure,
    RankReady,
    decode_lora_drop,
    lora_status,
    rank_error,
    rank_message,
)
from ..distributed import rendezvous
from ..distributed.parallel_state import set_tp_group
from ..testing_hooks import tp_rank_hangs

# The messages on a rank's pipe, its broadcasts and its store records are
# ``contracts/tp_wire.py``.
# Ended reads a rank reports per step (the rest wait for the next step): the gather
# over the control group takes equal-sized tensors, [count, (token, state, bytes) * N].
KV_REPORT_SLOTS = 64
KV_STATES = {"DONE": 1, "ERR": 2}


def ended_tensor(ended: list[ShardReadEnded]) -> torch.Tensor:
    """Up to ``KV_REPORT_SLOTS`` ended reads as one int64 tensor."""
    if len(ended) > KV_REPORT_SLOTS:
        raise ValueError(f"{len(ended)} ended reads, more than the {KV_REPORT_SLOTS} report slots")
    out = torch.zeros(1 + 3 * KV_REPORT_SLOTS, dtype=torch.int64)
    out[0] = len(ended)
    for i, read in enumerate(ended):
        out[1 + 3 * i : 4 + 3 * i] = torch.tensor([read.token, KV_STATES[read.state], read.nbytes])
    return out


def ended_of(report: torch.Tensor) -> list[ShardReadEnded]:
    """The ended reads in a tensor of ``ended_tensor``."""
    names = {v: k for k, v in KV_STATES.items()}
    rows = report.numpy()
    count = int(rows[0])
    triples = np.asarray(rows[1 : 1 + 3 * count]).reshape(count, 3)
    return [ShardReadEnded(int(t), names.get(int(s), "ERR"), int(b)) for t, s, b in triples]


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
    kv_agent: KVAgentSpec | None = None
    # On a headless node: the agent spec comes from the store, readiness goes there.
    headless: bool = False


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
    stores: list[Any] = []
    try:
        _serve(spec, conn, stores)
    except BaseException as e:
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        with contextlib.suppress(OSError):
            conn.send_bytes(rank_error(detail))
        if spec.headless and stores:
            # The leader waits for this key while it loads; tell it why, not a timeout.
            with contextlib.suppress(Exception):
                rendezvous.store_bytes(
                    stores[0], READY_KEY.format(rank=spec.rank), RankFailure(detail).encode()
                )
        traceback.print_exc()
        os._exit(1)
    os._exit(0)


def _serve(spec: RankSpec, conn: Any, stores: list[Any]) -> None:
    from .model_runner import ModelRunner
    from .step_wire import pack_result, unpack_step

    if tp_rank_hangs(spec.rank):  # the test hook: never join the rendezvous
        time.sleep(3600)
    torch.set_num_threads(spec.num_threads)
    cuda = spec.config.device_config.device == "cuda"
    if cuda:
        torch.cuda.set_device(spec.rank % max(1, torch.cuda.device_count()))
    store = rendezvous.client_store(spec.host, spec.port, spec.size + 1, spec.rendezvous_timeout)
    stores.append(store)
    kv_agent = spec.kv_agent
    if spec.headless:
        # Set by the leader before its ranks start (bounded by the store's timeout).
        try:
            kv_agent = KVAgentSpec.decode(store.get(KV_AGENT_KEY))
        except RuntimeError as e:  # torch's store timeout
            raise RuntimeError(
                f"the leader at {spec.host}:{spec.port} published no KV agent spec within "
                f"{spec.rendezvous_timeout:.0f}s (${rendezvous.RENDEZVOUS_TIMEOUT_ENV}); run "
                f"the same pdfleet version on every node ({e})"
            ) from None
    ctl = rendezvous.control_group(store, spec.rank + 1, spec.size + 1, rendezvous.IDLE_TIMEOUT)
    group = rendezvous.join_tp_group(store, spec.rank, spec.size, "nccl" if cuda else "gloo")
    set_tp_group(group)
    runner = ModelRunner(spec.config, None, spec.eos_token_ids)
    shard, info, layout, report = None, None, None, False
    if kv_agent is not None:
        from ..kv_transfer.layout import KVLayout
        from ..kv_transfer.nixl_shard import ShardAgent

        # This rank's KV shard, registered with its own agent (docs/kv_transfer.md); on
        # a headless node the agent binds that node's address (run_headless set UCX).
        shard = ShardAgent(f"{kv_agent.name}-r{spec.rank}", kv_agent.backends)
        info = shard.register(runner.kv_buffer, spec.rank)
        layout = KVLayout.of(runner.kv_buffer).to_dict()
        report = kv_agent.report
    ready = RankReady(
        runner.num_blocks, spec.config.scheduler_config.max_model_len, info, layout
    ).encode()
    conn.send_bytes(rank_message(READY, ready))
    if spec.headless:
        rendezvous.store_bytes(store, READY_KEY.format(rank=spec.rank), ready)
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    gather = dist.GatherOptions()
    gather.rootRank = 0
    backlog: list[ShardReadEnded] = []  # ended reads not reported yet
    header = torch.zeros(2, dtype=torch.int64)
    # Unloaded adapters whose shards stay for requests the main process
    # admitted (waiting or preempted ones this rank has not seen yet).
    kept: set[int] = set()
    runner.pin_loras(lambda: kept)
    while True:
        ctl.broadcast([header], opts).wait()
        nbytes, kind = header.tolist()
        if kind == STOP:
            break
        payload = torch.empty(nbytes, dtype=torch.uint8)
        ctl.broadcast([payload], opts).wait()
        if kind == LORA_LOAD:
            error = _load_lora_shard(runner, LoRALoad.decode(payload.numpy().data))
            status = torch.frombuffer(bytearray(lora_status(error)), dtype=torch.uint8)
            ctl.gather([], [status], gather).wait()
            continue
        if kind == LORA_DROP:
            lora_id, keep = decode_lora_drop(payload.numpy().data)
            if keep:
                kept.add(lora_id)
            else:
                kept.discard(lora_id)
            error = _drop_lora_shard(runner, lora_id)
            # Answered only once done: the main process's unload returns after
            # every rank holds what it keeps, and the directory may go then.
            status = torch.frombuffer(bytearray(lora_status(error)), dtype=torch.uint8)
            ctl.gather([], [status], gather).wait()
            continue
        out, commands = unpack_step(payload.numpy().data)
        if shard is not None and commands:
            # Post this rank's READs before the forward: they move while it runs.
            shard.apply([c.command for c in commands if c.rank == spec.rank])
        result = runner.execute_model(out)
        if report:
            # Every rank, on every node, to the leader's main process (control rank 0).
            if shard is None:
                raise RuntimeError("broken invariant: shard is not None")
            backlog += shard.poll()
            sent, backlog = backlog[:KV_REPORT_SLOTS], backlog[KV_REPORT_SLOTS:]
            ctl.gather([], [ended_tensor(sent)], gather).wait()
        if spec.rank == 0:
            # Its LoRA caches too: the main process exports them (every rank's alike).
            conn.send_bytes(rank_message(RESULT, pack_result(result, runner.lora_stats())))
    if shard is not None:
        shard.shutdown()
    dist.destroy_process_group()


def _drop_lora_shard(runner: Any, lora_id: int) -> str | None:
    """Drop an adapter's shard, or keep it for admitted requests (its host copy
    read again now if evicted); None, or why a kept copy could not be read
    (its requests then fail when they run)."""
    try:
        error: str | None = runner.remove_lora(lora_id)
        return error
    except Exception as e:  # a bug or the host out of memory: keep serving
        return f"LoRA adapter {lora_id}: {type(e).__name__}: {e}"


def _load_lora_shard(runner: Any, load: LoRALoad) -> str | None:
    """Read and check this rank's shard of an adapter into its host cache
    (so no step needs its directory while the copy stays); None, or why not.
    The shard must come from the bytes the main process read and checked."""
    from ..lora.adapter import LoRAError, LoRARequest

    try:
        adapter = runner.read_lora(LoRARequest(load.lora_name, load.lora_id, load.lora_path))
    except LoRAError as e:
        return str(e)
    except Exception as e:  # a bug or the host out of memory: refuse the load, keep serving
        return f"LoRA adapter {load.lora_name!r}: {type(e).__name__}: {e}"
    if adapter.digest != load.digest:
        return (
            f"LoRA adapter {load.lora_name!r}: its files at {load.lora_path!r} changed "
            "while it was loaded; load it again"
        )
    runner.install_lora(adapter)
    return None
