"""The main process's side of tensor parallelism: N rank processes behind the
interface of one ``ModelRunner`` (``num_blocks``, ``execute_model``, ``shutdown``).

Each step is packed once (``step_wire``) and broadcast once over the control
group; rank 0 sends the result back on its pipe. With ``--nnodes > 1`` the
ranks of the other nodes report ready (with their KV shard's metadata)
through the rendezvous store; a consumer's ranks, on every node, report
their ended reads in one gather per step over the control group. Every wait
is bounded and watches the ranks: a rank that dies, fails or never joins raises
:class:`RankFailed`, which takes the engine down (it is not a per-request
failure). See docs/parallelism.md.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import logging
import multiprocessing
import multiprocessing.connection
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..contracts.tp_wire import (
    ERROR,
    KV_AGENT_KEY,
    LORA_DROP,
    LORA_LOAD,
    LORA_STATUS_BYTES,
    READY,
    READY_KEY,
    RESULT,
    STEP,
    STOP,
    KVAgentSpec,
    LoRALoad,
    RankFailure,
    RankReady,
    encode_lora_drop,
    error_text,
    lora_status_error,
    read_rank_message,
    ready_record,
)
from ..core.sched_output import ModelRunnerOutput, SchedulerOutput
from ..distributed import rendezvous
from ..kv_transfer.base import KVConnectorWorker
from ..kv_transfer.layout import KVLayout
from ..lora.adapter import LoRAAdapter, LoRAError, LoRARequest, load_adapter, module_shapes
from ..lora.manager import LoRAStats
from .main_guard import check_main_guard
from .step_wire import pack_step, unpack_result_lora
from .tp_rank import KV_REPORT_SLOTS, RankSpec, ended_of, rank_main

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_ENV = "PDFLEET_TP_LOAD_TIMEOUT"
STEP_TIMEOUT_ENV = "PDFLEET_TP_STEP_TIMEOUT"


class RankFailed(RuntimeError):
    """A tensor-parallel rank died, failed or stopped answering: the engine is down."""


def _seconds(env: str, default: float) -> float:
    raw = os.environ.get(env, "").strip()
    try:
        return float(raw) if raw else default
    except ValueError:
        raise ValueError(f"${env} must be seconds, got {raw!r}") from None


def check_devices(config: EngineConfig) -> None:
    """Refuse a TP size larger than the devices there are (before anything starts)."""
    tp = config.parallel_config.ranks_per_node
    if config.device_config.device == "cuda":
        have = torch.cuda.device_count()
        if tp > have:
            raise ValueError(
                f"--tensor-parallel-size / --nnodes = {tp} ranks per node need {tp} GPUs, this "
                f"host has {have}; lower --tensor-parallel-size (or make more GPUs visible: "
                "CUDA_VISIBLE_DEVICES)"
            )
    else:
        have = len(os.sched_getaffinity(0))
        if tp > have:
            raise ValueError(
                f"--tensor-parallel-size {tp} needs one CPU core per rank, this process may "
                f"use {have}; lower --tensor-parallel-size (per node: / --nnodes)"
            )


def spawn_ranks(
    config: EngineConfig,
    eos_token_ids: tuple[int, ...],
    host: str,
    port: int,
    timeout: float,
    kv_agent: KVAgentSpec | None = None,
    headless: bool = False,
) -> tuple[list[Any], list[Any]]:
    """Start this node's rank processes; returns (their pipes, the processes).
    ``headless``: the ranks of a node after the first (they learn ``kv_agent`` from
    the leader's store)."""
    pc = config.parallel_config
    local = pc.ranks_per_node
    threads = max(1, torch.get_num_threads() // local)
    ctx = multiprocessing.get_context("spawn")
    conns: list[Any] = []
    procs: list[Any] = []
    for rank in range(pc.node_rank * local, (pc.node_rank + 1) * local):
        parent, child = ctx.Pipe(duplex=False)
        spec = RankSpec(
            config,
            tuple(eos_token_ids),
            rank,
            pc.tensor_parallel_size,
            host,
            port,
            timeout,
            threads,
            os.getpid(),
            kv_agent,
            headless,
        )
        proc = ctx.Process(
            target=rank_main, args=(spec, child), name=f"pdfleet-tp{rank}", daemon=True
        )
        proc.start()
        child.close()
        conns.append(parent)
        procs.append(proc)
    return conns, procs


def _store_address(config: EngineConfig) -> tuple[str, int]:
    """One node: a free port on loopback. Several: the leader's --master-addr/--master-port."""
    pc = config.parallel_config
    if pc.nnodes == 1:
        return "127.0.0.1", 0
    return pc.master_addr, pc.master_port


class TPExecutor:
    def __init__(
        self,
        config: EngineConfig,
        eos_token_ids: tuple[int, ...] = (),
        connector: KVConnectorWorker | None = None,
    ) -> None:
        # A spawned rank imports the main file again: refuse an unguarded one now,
        # not after the rendezvous timeout.
        check_main_guard(f"tensor_parallel_size={config.parallel_config.tensor_parallel_size}")
        check_devices(config)
        self.config = config
        # The KV connector's worker side stays here; each rank reads into its own
        # shard with its own agent, driven by commands that travel with the step.
        self.connector = connector
        self.kv_agent = connector.rank_agents() if connector is not None else None
        self.kv_report = bool(self.kv_agent and self.kv_agent.report)
        self.size = size = config.parallel_config.tensor_parallel_size
        self.step_timeout = _seconds(STEP_TIMEOUT_ENV, 600.0)
        timeout = rendezvous.rendezvous_timeout()
        host, port = _store_address(config)
        self.store = rendezvous.master_store(host, port, size + 1, timeout)
        # The other nodes' ranks register their KV shards with agents named after ours.
        rendezvous.store_bytes(self.store, KV_AGENT_KEY, KVAgentSpec.encode(self.kv_agent))
        self.conns: list[Any] = []
        self.procs: list[Any] = []
        self.ctl: Any = None
        self.broadcast_seconds = 0.0
        self.num_steps = 0
        # Rank 0's LoRA caches as of its last step (None: LoRA off, or no step yet).
        self._lora_stats: LoRAStats | None = None
        # The scheduler's admitted requests' adapters (:meth:`pin_loras`), and
        # the unloaded adapters the ranks keep for them.
        self._lora_admitted: Callable[[], set[int]] = set
        self._lora_kept: set[int] = set()
        # Before the start: a failed start's shutdown broadcasts STOP with it.
        self.opts = dist.BroadcastOptions()
        self.opts.rootRank = 0
        try:
            self.conns, self.procs = spawn_ranks(
                config, eos_token_ids, host, self.store.port, timeout, self.kv_agent
            )
            self._rendezvous(timeout)
            self._wait_ready(_seconds(LOAD_TIMEOUT_ENV, 1800.0))
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "tensor parallelism: %d ranks (%d on this node: pids %s), %d KV blocks per shard",
            size,
            len(self.procs),
            ", ".join(str(p.pid) for p in self.procs),
            self.num_blocks - 1,
        )

    # -- start --------------------------------------------------------------------

    def _rendezvous(self, timeout: float) -> None:
        """Build the control group while watching the ranks (a failed one ends it early)."""
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tp-rendezvous")
        future = pool.submit(
            rendezvous.control_group,
            self.store,
            0,
            self.size + 1,
            # Also bounds each broadcast: the ranks are always waiting for the next one.
            datetime.timedelta(seconds=timeout),
        )
        deadline = time.monotonic() + timeout + 5.0
        try:
            while not future.done():
                self._check_ranks()
                if time.monotonic() > deadline:
                    break
                multiprocessing.connection.wait(self._watched(), timeout=0.2)
            try:
                self.ctl = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:
                self._check_ranks()
                raise RankFailed(
                    f"not every tensor-parallel rank joined within {timeout:.0f}s "
                    f"(${rendezvous.RENDEZVOUS_TIMEOUT_ENV}): {e}"
                ) from None
        finally:
            pool.shutdown(wait=False)

    def _wait_ready(self, timeout: float) -> None:
        """Every rank's READY: this node's on their pipes, the other nodes' in the store."""
        blocks: dict[int, tuple[int, int]] = {}
        shards: dict[int, tuple[Any, Any]] = {}
        remote = set(range(len(self.procs), self.size))
        deadline = time.monotonic() + timeout
        while len(blocks) < self.size:
            poll = 0.2 if remote else None
            for rank, tag, body in self._messages(deadline, "load the model", poll):
                if tag != READY:
                    raise RankFailed(f"tensor-parallel rank {rank} sent {tag!r} before ready")
                try:
                    ready = RankReady.decode(body)
                except ValueError as e:
                    raise RankFailed(f"tensor-parallel rank {rank}: {e}") from None
                blocks[rank] = (ready.num_blocks, ready.max_model_len)
                shards[rank] = (ready.shard_info, ready.layout)
            for rank in sorted(remote):
                key = READY_KEY.format(rank=rank)
                if not self.store.check([key]):
                    continue
                node = rank // self.config.parallel_config.ranks_per_node
                try:
                    record = ready_record(self.store.get(key))
                except ValueError as e:
                    raise RankFailed(f"tensor-parallel rank {rank} (node {node}): {e}") from None
                if isinstance(record, RankFailure):
                    raise RankFailed(
                        f"tensor-parallel rank {rank} (node {node}) failed: {record.error}"
                    )
                blocks[rank] = (record.num_blocks, record.max_model_len)
                shards[rank] = (record.shard_info, record.layout)
                remote.discard(rank)
            if remote and time.monotonic() > deadline:
                raise RankFailed(
                    f"tensor-parallel ranks {sorted(remote)} on the other nodes did not load "
                    f"the model in time (${LOAD_TIMEOUT_ENV})"
                )
        self.num_blocks = min(b for b, _ in blocks.values())
        max_len = min(m for _, m in blocks.values())
        if self.kv_agent is not None:
            if self.connector is None:
                raise RuntimeError("broken invariant: self.connector is not None")
            self.connector.register_shards(
                KVLayout(**shards[0][1]), [shards[r][0] for r in sorted(shards)]
            )
        cfg = self.config
        cfg.cache_config.num_gpu_blocks = self.num_blocks - 1
        cfg.model_config.max_model_len = max_len
        cfg.scheduler_config.max_model_len = max_len

    # -- watching -------------------------------------------------------------------

    def _watched(self) -> list[Any]:
        return [*self.conns, *(p.sentinel for p in self.procs)]

    def _dead(self) -> RankFailed | None:
        """The first rank that exited, if any (reported before the errors it causes
        on the other ranks)."""
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                proc.join(0.5)
                return RankFailed(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                    f"{proc.exitcode}; the engine cannot run without it"
                )
        return None

    def _failed(self, rank: int, detail: str) -> RankFailed:
        time.sleep(0.2)  # a peer's death shows within this
        return self._dead() or RankFailed(f"tensor-parallel rank {rank} failed: {detail}")

    def _check_ranks(self) -> None:
        dead = self._dead()
        for rank, conn in enumerate(self.conns):
            if dead is None and conn.poll():
                try:
                    msg = conn.recv_bytes()
                except EOFError:
                    dead = self._failed(rank, "its pipe closed")
                    break
                if msg[:1] == ERROR:
                    raise self._failed(rank, error_text(msg[1:]))
                raise RankFailed(f"tensor-parallel rank {rank} sent an unexpected message")
        if dead is not None:
            raise dead

    def _messages(
        self, deadline: float, what: str, poll: float | None = None
    ) -> list[tuple[int, bytes, bytes]]:
        """The next messages from the ranks (at least one; with ``poll``, maybe none
        after that many seconds); raises for errors and deaths."""
        until = time.monotonic() + poll if poll is not None else None
        while True:
            ready = multiprocessing.connection.wait(
                self._watched(), timeout=max(0.0, min(0.5, deadline - time.monotonic()))
            )
            got = []
            for rank, conn in enumerate(self.conns):
                if conn in ready:
                    try:
                        msg = conn.recv_bytes()
                    except EOFError:
                        raise self._failed(rank, "its pipe closed") from None
                    try:
                        tag, body = read_rank_message(msg)
                    except ValueError as e:
                        raise RankFailed(f"tensor-parallel rank {rank}: {e}") from None
                    if tag == ERROR:
                        raise self._failed(rank, error_text(body))
                    got.append((rank, tag, body))
            if got or (until is not None and time.monotonic() >= until):
                return got
            dead = self._dead()
            if dead is not None:
                raise dead
            if time.monotonic() > deadline:
                raise RankFailed(f"the tensor-parallel ranks did not {what} in time")

    # -- steps ----------------------------------------------------------------------

    def _broadcast(self, header: list[int], payload: bytes | None = None) -> None:
        try:
            self.ctl.broadcast([torch.tensor(header, dtype=torch.int64)], self.opts).wait()
            if payload is not None:
                data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
                self.ctl.broadcast([data], self.opts).wait()
        except RuntimeError as e:
            self._check_ranks()
            raise RankFailed(
                f"broadcasting the step to the tensor-parallel ranks failed: {e}"
            ) from e

    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        if self._lora_kept:
            self._release_loras()
        start = time.perf_counter()
        commands = None
        if self.connector is not None:
            self.connector.start_load_kv(out.kv_connector_metadata)
            commands = self.connector.shard_commands() or None
        payload = pack_step(out, commands)
        self._broadcast([len(payload), STEP], payload)
        # Packing and broadcasting the step (benchmarks/tp_overhead.py reports it).
        self.broadcast_seconds += time.perf_counter() - start
        self.num_steps += 1
        # A consumer's ranks, on every node, each report the reads that ended.
        reports = self._gather_reads() if self.kv_report else None
        deadline = time.monotonic() + self.step_timeout
        result: ModelRunnerOutput | None = None
        while result is None:
            for rank, tag, body in self._messages(deadline, "finish the step"):
                if rank == 0 and tag == RESULT:
                    try:
                        result, lora = unpack_result_lora(body)
                    except ValueError as e:
                        raise RankFailed(f"tensor-parallel rank 0: {e}") from None
                    if lora is not None:
                        self._lora_stats = lora
                else:
                    raise RankFailed(f"tensor-parallel rank {rank} sent {tag!r} during a step")
        if reports is not None:
            work, tensors = reports
            try:
                # The ranks gather before rank 0 sends the result: this is about done.
                work.wait()
            except RuntimeError as e:
                self._check_ranks()
                raise RankFailed(f"gathering the ranks' ended KV reads failed: {e}") from e
            if self.connector is None:
                raise RuntimeError("broken invariant: self.connector is not None")
            for rank in range(self.size):
                self.connector.shard_reads_ended(rank, ended_of(tensors[rank + 1]))
        if self.connector is not None:
            sending, recving, failed = self.connector.get_finished()
            result.finished_sending, result.finished_recving = sending, recving
            result.failed_recving = failed
        return result

    # The rest of the Executor protocol: a TP engine has no host KV tier and no
    # grammars (the configuration and the engine refuse both before a step).
    @property
    def num_host_blocks(self) -> int:
        return 0

    def unissued_stores(self, slots: list[int]) -> list[int]:
        return list(slots)

    def host_kv_bytes(self) -> tuple[int, int]:
        return 0, 0

    def attach_grammars(self, grammars: Any) -> None:
        raise TypeError("structured outputs need an in-process model runner (TP=1)")

    def read_lora(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check the whole adapter here (any thread): its digest is the
        engine's identity of it, and a bad adapter is refused before any rank
        is asked (:meth:`install_lora`)."""
        lc = self.config.lora_config
        if lc is None:
            raise ValueError("LoRA is not enabled on this engine (--enable-lora)")
        m = self.config.model_config
        return load_adapter(
            request, m.num_hidden_layers, module_shapes(m), lc.max_lora_rank, torch.float32
        )

    def install_lora(self, read: LoRAAdapter) -> None:
        """Every rank reads and checks its own shard into its host cache now
        (between two steps: the step loop waits for the slowest rank), from
        the bytes :meth:`read_lora` read; returns once all have it. When any
        rank refuses, those that took it drop it, and LoRAError names the
        adapter and the rank: nothing changed, the engine serves on. Steps
        then find the shards in memory (read again from the directory only
        after a host-cache eviction, checked against the same digest, as at
        TP = 1)."""
        payload = LoRALoad(read.name, read.int_id, read.path, read.digest).encode()
        self._broadcast([len(payload), LORA_LOAD], payload)
        errors = self._lora_statuses("LoRA shard loads")
        if errors:
            self._drop_lora(read.int_id, False)
            raise LoRAError(
                f"LoRA adapter {read.name!r} refused by tensor-parallel " + "; ".join(errors)
            )
        stats = self._lora_stats
        if stats is not None:  # in host memory on every rank now; the next step says more
            stats.loads += 1
            stats.load_seconds += read.read_seconds
            stats.cached = [*(n for n in stats.cached if n != read.name), read.name]
            stats.resident.setdefault(read.name, "host")

    def remove_lora(self, lora_int_id: int) -> str | None:
        """Every rank drops the adapter's shards, or, while admitted requests
        still need it, keeps them (read again now if evicted, while the
        directory is surely there) until :meth:`execute_model` sees the last
        of those requests gone and drops them then."""
        keep = lora_int_id in self._lora_admitted()
        if keep:
            self._lora_kept.add(lora_int_id)
        errors = self._drop_lora(lora_int_id, keep)
        for error in errors:
            logger.warning("unloaded LoRA adapter still in use is unreadable: %s", error)
        return "; ".join(errors) or None

    def pin_loras(self, admitted: Callable[[], set[int]]) -> None:
        self._lora_admitted = admitted

    def _release_loras(self) -> None:
        """Drop the kept shards of unloaded adapters no admitted request needs."""
        admitted = self._lora_admitted()
        for lora_int_id in [i for i in self._lora_kept if i not in admitted]:
            self._lora_kept.discard(lora_int_id)
            self._drop_lora(lora_int_id, False)

    def _drop_lora(self, lora_int_id: int, keep: bool) -> list[str]:
        """Every rank drops (or keeps) the adapter's shards; returns once all
        have, with each rank's error (``rank N: why``)."""
        drop = encode_lora_drop(lora_int_id, keep)
        self._broadcast([len(drop), LORA_DROP], drop)
        return self._lora_statuses("LoRA shard drops")

    def _lora_statuses(self, what: str) -> list[str]:
        """The ranks' answers to a LoRA load or drop (one gather): their errors."""
        statuses = [torch.zeros(LORA_STATUS_BYTES, dtype=torch.uint8) for _ in range(self.size + 1)]
        opts = dist.GatherOptions()
        opts.rootRank = 0
        try:
            self.ctl.gather([statuses], [statuses[0].clone()], opts).wait()
        except RuntimeError as e:
            self._check_ranks()
            raise RankFailed(f"the ranks' {what} did not answer: {e}") from e
        errors = []
        for rank in range(self.size):
            try:
                error = lora_status_error(statuses[rank + 1].numpy().tobytes())
            except ValueError as e:
                raise RankFailed(f"tensor-parallel rank {rank}: {e}") from None
            if error is not None:
                errors.append(f"rank {rank}: {error}")
        return errors

    def lora_stats(self) -> LoRAStats | None:
        """Rank 0's LoRA caches after the last step, and the loads since (every
        rank's caches evolve alike: the same steps and loads reach all)."""
        return self._lora_stats

    def _gather_reads(self) -> tuple[Any, list[torch.Tensor]]:
        """Post this step's gather of the ranks' ended reads (``tp_rank.ended_tensor``)."""
        tensors = [
            torch.zeros(1 + 3 * KV_REPORT_SLOTS, dtype=torch.int64) for _ in range(self.size + 1)
        ]
        opts = dist.GatherOptions()
        opts.rootRank = 0
        try:
            return self.ctl.gather([tensors], [tensors[0].clone()], opts), tensors
        except RuntimeError as e:
            self._check_ranks()
            raise RankFailed(f"gathering the ranks' ended KV reads failed: {e}") from e

    def shutdown(self) -> None:
        """Stop the ranks: ask, wait a little, then kill (bounded)."""
        if self.ctl is not None and all(p.is_alive() for p in self.procs):
            with contextlib.suppress(RankFailed):
                self._broadcast([0, STOP])
        self.ctl = None
        deadline = time.monotonic() + 5.0
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


def run_headless(config: EngineConfig) -> int:
    """A node after the first of a multi-node engine: its ranks only, no API server.

    The ranks meet the leader's store at --master-addr/--master-port and take
    their steps from the leader's broadcasts. This process exits (with a
    non-zero code) as soon as any of its ranks does, so the group restarts;
    SIGTERM stops the ranks and exits.
    """
    import signal

    check_devices(config)
    kv = config.kv_transfer_config
    if kv is not None and kv.kv_connector == "NixlConnector":
        from ..kv_transfer.connector import kv_addresses
        from ..kv_transfer.transports import restrict_ucx_to

        # This node's ranks read and serve KV on this node's own address: $PDFLEET_KV_IP
        # (the pod IP in Kubernetes) or kv_transfer_config.kv_ip; the ranks inherit it.
        _host, bind_ip = kv_addresses(kv)
        logger.info("KV shards on %s (UCX_NET_DEVICES=%s)", bind_ip, restrict_ucx_to(bind_ip))
    host, port = _store_address(config)
    conns, procs = spawn_ranks(
        config, (), host, port, rendezvous.rendezvous_timeout(), headless=True
    )

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    logger.info(
        "headless node %d: ranks %s (pids %s), leader %s:%d",
        config.parallel_config.node_rank,
        ", ".join(p.name for p in procs),
        ", ".join(str(p.pid) for p in procs),
        host,
        port,
    )
    first = config.parallel_config.node_rank * config.parallel_config.ranks_per_node
    # Ranks that reported (ready or failed) to the leader themselves.
    reported: set[int] = set()
    try:
        while True:
            ready = multiprocessing.connection.wait(
                [*conns, *(p.sentinel for p in procs)], timeout=1.0
            )
            for i, (conn, proc) in enumerate(zip(conns, procs, strict=True)):
                if conn in ready:
                    try:
                        msg = conn.recv_bytes()
                    except EOFError:
                        continue
                    if msg[:1] == ERROR:
                        reported.add(first + i)
                        logger.error("%s failed: %s", proc.name, error_text(msg[1:]))
                    elif msg[:1] == READY:
                        reported.add(first + i)
                        logger.info("%s ready", proc.name)
            for i, proc in enumerate(procs):
                if not proc.is_alive():
                    logger.error("%s exited with code %s", proc.name, proc.exitcode)
                    if proc.exitcode != 0 and first + i not in reported:
                        _report_death(host, port, config, first + i, proc.exitcode)
                    return 0 if proc.exitcode == 0 else 1  # 0: the leader said stop
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            proc.join(5.0)


def _report_death(host: str, port: int, config: EngineConfig, rank: int, code: Any) -> None:
    """A headless rank died before it reported: tell the leader, which waits for it."""
    try:
        store = rendezvous.client_store(
            host, port, config.parallel_config.tensor_parallel_size + 1, 10.0
        )
        rendezvous.store_bytes(
            store,
            READY_KEY.format(rank=rank),
            RankFailure(f"exited with code {code} while starting").encode(),
        )
    except Exception as e:  # the leader is gone too
        logger.debug("could not tell the leader about rank %d: %s", rank, e)
