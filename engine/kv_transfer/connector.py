"""The P/D connector: vLLM's NixlConnector protocol over NIXL or ZeroMQ.

Producer (``do_remote_decode``): after the prefill, the request's blocks are
held under a lease and the response carries ``kv_transfer_params``
(``do_remote_prefill``, ``remote_engine_id``, ``remote_host``,
``remote_port``, ``remote_block_ids``, ``remote_request_id``, plus
``remote_instance_id`` and the compatibility factors). Blocks are freed when
the consumer reports it has read them, or when the lease expires.

Consumer (``do_remote_prefill``): matches its own prefix cache first, then
pulls only the missing full blocks (the trailing partial block and the last
prompt token are recomputed), off the batch, on the connector's transfer
thread, within a deadline. Handshakes are cached per remote engine instance;
a restarted producer has a new instance id (and a failure drops the cached
handshake), so a stale agent never wedges later transfers.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import tracing
from ..config import EngineConfig
from .base import KVConnectorScheduler, KVConnectorWorker
from .layout import IncompatibleKV, KVLayout, compat_mismatch
from .side_channel import SideChannelClient, SideChannelServer
from .transports import NixlTransport, Remote, Transport, ZmqTransport, new_instance_id

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
# Failures that no policy may paper over (incompatible engines) carry this prefix.
FATAL = "fatal: "


@dataclass
class Load:
    """Blocks to pull for one consumer request."""

    request_id: str
    params: dict[str, Any]
    local_ids: list[int]
    remote_ids: list[int]
    deadline: float
    started: float = 0.0
    token: Any = None
    remote: Remote | None = None
    # Nothing to pull (all blocks local): only tell the producer to free its blocks.
    release_only: bool = False


@dataclass
class Held:
    block_ids: list[int]
    expires: float


@dataclass
class ConnectorStats:
    """Cumulative counters (read by the metrics exporter)."""

    bytes_transferred: int = 0
    blocks_pulled: int = 0
    transfers: int = 0
    failed_transfers: int = 0
    expired_leases: int = 0
    handshakes: int = 0
    failed_handshakes: int = 0
    transfer_seconds: list[float] = field(default_factory=list)  # drained by the exporter


class PDConnector:
    """State shared by the scheduler side and the worker side of one engine."""

    def __init__(self, config: EngineConfig) -> None:
        kv = config.kv_transfer_config
        assert kv is not None and kv.kv_connector is not None
        self.config = config
        self.kv = kv
        self.engine_id = str(kv.engine_id)
        self.instance_id = new_instance_id()
        self.block_size = config.cache_config.block_size
        extra = kv.kv_connector_extra_config
        self.lease_seconds = kv.lease_seconds
        self.handshake_timeout = float(extra.get("handshake_timeout_seconds", 2.0))
        self.transfer_timeout = float(extra.get("transfer_timeout_seconds", 3.0))
        self.fail_policy = kv.kv_load_failure_policy
        self.compat = config.compat_factors()
        self.compat_hash = config.compat_hash()
        # The address consumers use; PDFLEET_KV_IP (the pod IP in Kubernetes) wins over kv_ip.
        self.host = os.environ.get("PDFLEET_KV_IP") or kv.kv_ip
        self.port = kv.kv_port
        self.stats = ConnectorStats()
        self.lock = threading.Lock()
        self.held: dict[str, Held] = {}
        self.released: set[str] = set()
        self.new_loads: queue.Queue[Load] = queue.Queue()
        self.cancel: queue.Queue[str] = queue.Queue()
        self.done: queue.Queue[tuple[str, bool, str]] = queue.Queue()
        self.errors: dict[str, str] = {}
        self.remotes: dict[tuple[str, str, str, int], Remote] = {}
        self.transport: Transport = (
            NixlTransport(self.engine_id, self.instance_id, list(extra.get("backends", ["UCX"])))
            if kv.kv_connector == "NixlConnector"
            else ZmqTransport()
        )
        self.layout: KVLayout | None = None
        self.server: SideChannelServer | None = None
        self._stop = threading.Event()
        self.thread: threading.Thread | None = None

    # -- setup --------------------------------------------------------------------

    def register(self, buffer: torch.Tensor) -> None:
        self.layout = KVLayout.of(buffer)
        self.transport.register(buffer, self.layout)
        if self.kv.is_kv_producer:
            self.server = SideChannelServer(
                "0.0.0.0",
                self.port,
                {
                    "handshake": self._on_handshake,
                    "read": self._on_read,
                    "release": self._on_release,
                },
            )
        if self.kv.is_kv_consumer:
            self.thread = threading.Thread(
                target=self._transfer_loop, name="kv-transfer", daemon=True
            )
            self.thread.start()
        logger.info(
            "KV connector %s (%s) engine %s instance %s, side channel %s:%d, lease %.0fs",
            self.kv.kv_connector,
            self.kv.kv_role,
            self.engine_id,
            self.instance_id,
            self.host,
            self.port,
            self.lease_seconds,
        )

    def shutdown(self) -> None:
        self._stop.set()
        if self.thread is not None:
            self.thread.join(5)
        if self.server is not None:
            self.server.close()
        self.transport.shutdown()

    # -- producer: side-channel handlers (side-channel thread) -----------------------

    def _on_handshake(self, request: dict[str, Any]):
        assert self.layout is not None
        return {
            "ok": True,
            "version": PROTOCOL_VERSION,
            "engine_id": self.engine_id,
            "instance_id": self.instance_id,
            "compat": self.compat,
            "compat_hash": self.compat_hash,
            "layout": self.layout.to_dict(),
            "transport": self.transport.name,
            **self.transport.handshake_fields(),
        }, []

    def _on_read(self, request: dict[str, Any]):
        rid = str(request.get("request_id"))
        wanted = [int(b) for b in request.get("block_ids", [])]
        with self.lock:
            held = self.held.get(rid)
            if held is None:
                return {"ok": False, "error": f"no blocks held for request {rid}"}, []
            if not set(wanted) <= set(held.block_ids):
                return {"ok": False, "error": "requested blocks are not held for this request"}, []
            frames = self.transport.serve_read(request, wanted)
        with self.lock:
            self.stats.bytes_transferred += sum(len(f) for f in frames)
        return {"ok": True}, frames

    def _on_release(self, request: dict[str, Any]):
        with self.lock:
            self.released.add(str(request.get("request_id")))
        return None

    # -- consumer: transfer thread --------------------------------------------------

    def _remote_key(self, p: dict[str, Any]) -> tuple[str, str, str, int]:
        return (
            str(p.get("remote_engine_id")),
            str(p.get("remote_instance_id", "")),
            str(p["remote_host"]),
            int(p["remote_port"]),
        )

    def _handshake(self, client: SideChannelClient, p: dict[str, Any], deadline: float) -> Remote:
        key = self._remote_key(p)
        remote = self.remotes.get(key)
        if remote is not None:
            return remote
        host, port = key[2], key[3]
        timeout = max(0.05, min(self.handshake_timeout, deadline - time.monotonic()))
        try:
            reply, _ = client.call(
                host, port, {"op": "handshake", "version": PROTOCOL_VERSION}, timeout
            )
        except Exception:
            with self.lock:
                self.stats.failed_handshakes += 1
            raise
        why = compat_mismatch(self.compat, reply.get("compat"))
        if why is not None:
            raise IncompatibleKV(why)
        wanted = p.get("remote_instance_id")
        if wanted and reply.get("instance_id") != wanted:
            # The producer restarted on the same address: the blocks named are gone.
            raise RuntimeError(
                f"the prefill engine at {host}:{port} restarted (instance "
                f"{reply.get('instance_id')}, params from {wanted})"
            )
        assert self.layout is not None
        layout = KVLayout(**reply["layout"])
        shape = self.layout.shape_mismatch(layout)
        if shape is not None:
            raise IncompatibleKV(f"KV layout mismatch with the prefill engine: {shape}")
        if reply.get("transport") != self.transport.name:
            raise IncompatibleKV(
                f"the prefill engine uses the {reply.get('transport')} transport, this engine "
                f"{self.transport.name}: use the same kv_connector on both"
            )
        remote = Remote(str(reply["engine_id"]), str(reply["instance_id"]), host, port, layout)
        self.transport.connect(remote, reply)
        # Cache under the key from the request and the instance actually reached.
        self.remotes[key] = remote
        with self.lock:
            self.stats.handshakes += 1
        return remote

    def _forget(self, load: Load) -> None:
        key = self._remote_key(load.params)
        remote = self.remotes.pop(key, None)
        if remote is not None:
            self.transport.forget(remote)

    def _transfer_loop(self) -> None:
        client = SideChannelClient()
        if isinstance(self.transport, ZmqTransport):
            self.transport.client = client
        inflight: list[Load] = []
        cancelled: set[str] = set()
        while not self._stop.is_set():
            try:
                load = self.new_loads.get(timeout=0.0005 if inflight else 0.05)
                self._begin(client, load, inflight)
            except queue.Empty:
                pass
            while True:
                try:
                    cancelled.add(self.cancel.get_nowait())
                except queue.Empty:
                    break
            now = time.monotonic()
            still = []
            for load in inflight:
                state = "ERR" if load.request_id in cancelled else self.transport.check(load.token)
                if state == "PROC" and now > load.deadline:
                    state = "TIMEOUT"
                if state == "PROC":
                    still.append(load)
                    continue
                self.transport.release(load.token)
                self._finish(
                    load,
                    state == "DONE",
                    client,
                    "cancelled" if load.request_id in cancelled else state.lower(),
                )
            inflight = still
        client.close()

    def _begin(self, client: SideChannelClient, load: Load, inflight: list[Load]) -> None:
        p = load.params
        if load.release_only:
            client.send_nowait(
                str(p["remote_host"]),
                int(p["remote_port"]),
                {"op": "release", "request_id": str(p["remote_request_id"])},
            )
            return
        try:
            if time.monotonic() > load.deadline:
                raise TimeoutError("the transfer deadline passed before it started")
            remote = self._handshake(client, p, load.deadline)
            load.remote = remote
            load.started = time.monotonic()
            load.token = self.transport.start_read(
                remote,
                load.local_ids,
                load.remote_ids,
                str(p["remote_request_id"]),
                load.deadline,
            )
            inflight.append(load)
        except Exception as e:
            logger.warning(
                "KV pull for %s from %s:%s failed: %s",
                load.request_id,
                p.get("remote_host"),
                p.get("remote_port"),
                e,
            )
            self._forget(load)
            self._finish(
                load, False, client, (FATAL if isinstance(e, IncompatibleKV) else "") + str(e)
            )

    def _finish(self, load: Load, ok: bool, client: SideChannelClient, why: str) -> None:
        nbytes = (
            len(load.local_ids)
            * (self.layout.block_bytes if self.layout else 0)
            * 2
            * (self.layout.num_layers if self.layout else 0)
        )
        with self.lock:
            if ok:
                self.stats.transfers += 1
                self.stats.blocks_pulled += len(load.local_ids)
                self.stats.bytes_transferred += nbytes
                self.stats.transfer_seconds.append(time.monotonic() - load.started)
            else:
                self.stats.failed_transfers += 1
        tracing.kv_pull(
            load.request_id, load.started, nbytes, len(load.local_ids), load.params, ok, why
        )
        if not ok:
            self._forget(load)
            # Tell the producer it may free the blocks now (best effort).
            p = load.params
            if p.get("remote_host") and p.get("remote_port") is not None:
                client.send_nowait(
                    str(p["remote_host"]),
                    int(p["remote_port"]),
                    {"op": "release", "request_id": str(p["remote_request_id"])},
                )
        self.done.put((load.request_id, ok, why))


class PDConnectorScheduler(KVConnectorScheduler):
    def __init__(self, c: PDConnector) -> None:
        self.c = c
        self.pending: list[Load] = []

    def validate(self, params: dict[str, Any] | None) -> None:
        """Reject unusable kv_transfer_params before a request is queued (HTTP 400)."""
        if not params:
            return
        if params.get("do_remote_prefill"):
            if not self.c.kv.is_kv_consumer:
                raise ValueError(
                    "kv_transfer_params: this engine is not a KV consumer "
                    f"(kv_role {self.c.kv.kv_role}) and cannot pull remote KV"
                )
            for name in ("remote_host", "remote_port", "remote_block_ids", "remote_request_id"):
                if params.get(name) is None:
                    raise ValueError(f"kv_transfer_params: {name} is missing")
            why = compat_mismatch(self.c.compat, params.get("pdfleet_compat"))
            if why is not None:
                raise ValueError(f"kv_transfer_params: {why}")
        if params.get("do_remote_decode") and not self.c.kv.is_kv_producer:
            raise ValueError(
                "kv_transfer_params: this engine is not a KV producer "
                f"(kv_role {self.c.kv.kv_role})"
            )

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        p = request.kv_transfer_params or {}
        if not p.get("do_remote_prefill") or not self.c.kv.is_kv_consumer:
            return 0, False
        bs = self.c.block_size
        remote_ids = p.get("remote_block_ids") or []
        usable = min(len(remote_ids), (request.num_tokens - 1) // bs)
        num_external = max(0, usable * bs - num_computed_tokens)
        if num_external == 0 and remote_ids:
            # Our own prefix cache covers it: the producer may free its blocks now.
            self.c.new_loads.put(Load(request.request_id, dict(p), [], [], 0.0, release_only=True))
        return num_external, True

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        p = request.kv_transfer_params or {}
        bs = self.c.block_size
        first = request.num_computed_tokens // bs
        count = num_external_tokens // bs
        remote_ids = [int(b) for b in p["remote_block_ids"]][first : first + count]
        self.pending.append(
            Load(
                request.request_id,
                dict(p),
                list(block_ids[first : first + count]),
                remote_ids,
                deadline=time.monotonic() + self.c.handshake_timeout + self.c.transfer_timeout,
            )
        )

    def build_connector_meta(self, scheduler_output):
        loads, self.pending = self.pending, []
        return loads

    def request_finished(self, request, block_ids):
        p = request.kv_transfer_params or {}
        if not p.get("do_remote_decode") or not self.c.kv.is_kv_producer:
            return False, None
        bs = self.c.block_size
        # Full blocks before the last prompt token: the consumer recomputes that token
        # (it needs its logits), so a block holding it is never pulled.
        full = block_ids[: (request.num_prompt_tokens - 1) // bs]
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.c.engine_id,
            "remote_instance_id": self.c.instance_id,
            "remote_host": self.c.host,
            "remote_port": self.c.port,
            "remote_block_ids": list(full),
            "remote_request_id": request.request_id,
            "tp_size": self.c.config.parallel_config.tensor_parallel_size,
            "pdfleet_compat": self.c.compat,
            "pdfleet_compat_hash": self.c.compat_hash,
        }
        if not full:
            return False, params
        with self.c.lock:
            self.c.held[request.request_id] = Held(
                list(full), time.monotonic() + self.c.lease_seconds
            )
        return True, params

    def request_aborted(self, request):
        self.pending = [x for x in self.pending if x.request_id != request.request_id]
        self.c.cancel.put(request.request_id)

    def load_failed(self, request):
        why = self.c.errors.pop(request.request_id, "the transfer failed")
        if why.startswith(FATAL):
            return why[len(FATAL) :]
        if self.c.fail_policy == "fail":
            return (
                f"pulling the prompt's KV from the prefill engine failed ({why}); "
                "kv_load_failure_policy is fail"
            )
        return None


class PDConnectorWorker(KVConnectorWorker):
    def __init__(self, c: PDConnector) -> None:
        self.c = c

    def register_kv_caches(self, kv_caches, buffer=None) -> None:
        assert buffer is not None, "the connector needs the contiguous KV buffer"
        self.c.register(buffer)

    def start_load_kv(self, metadata) -> None:
        for load in metadata or ():
            self.c.new_loads.put(load)

    def get_finished(self):
        c = self.c
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        if c.kv.is_kv_producer:
            released = c.transport.poll_released()
            now = time.monotonic()
            with c.lock:
                released.extend(c.released)
                c.released.clear()
                for rid in released:
                    if c.held.pop(rid, None) is not None:
                        sending.add(rid)
                for rid, held in list(c.held.items()):
                    if held.expires < now:
                        del c.held[rid]
                        sending.add(rid)
                        c.stats.expired_leases += 1
                        logger.info("lease of %s expired unclaimed; blocks freed", rid)
        while True:
            try:
                rid, ok, why = c.done.get_nowait()
            except queue.Empty:
                break
            if ok:
                recving.add(rid)
            else:
                failed.add(rid)
                c.errors[rid] = why
        return sending, recving, failed

    def shutdown(self) -> None:
        self.c.shutdown()


def create_connector(config: EngineConfig) -> tuple[PDConnectorScheduler, PDConnectorWorker]:
    c = PDConnector(config)
    return PDConnectorScheduler(c), PDConnectorWorker(c)
