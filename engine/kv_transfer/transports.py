"""Byte movers for KV blocks: NIXL (UCX) READs, or ZeroMQ frames.

Both read whole blocks of the remote engine into local blocks; the connector
decides which, and checks the producer's lease before and after. A transport
is used from the connector's transfer thread only.

Both honour the READ delay test hook (``testing_hooks.kv_read_delay``).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
import threading
import time
import uuid
from dataclasses import astuple, dataclass
from typing import Any

import torch

from ..contracts.kv_connector import (
    HandshakeReply,
    RankCommand,
    ShardCommand,
    ShardConnect,
    ShardForget,
    ShardInfo,
    ShardRead,
    ShardReadEnded,
    ShardRelease,
)
from ..contracts.kv_side_channel import READ, LeaseUse
from ..testing_hooks import kv_read_delay
from .layout import IncompatibleKV, KVLayout, head_plan, rank_heads, tp_layout_mismatch
from .side_channel import SideChannelClient

logger = logging.getLogger(__name__)


@dataclass
class Remote:
    """A producer this engine has shaken hands with."""

    engine_id: str
    instance_id: str
    host: str
    port: int
    layout: KVLayout
    handle: Any = None  # transport-specific (NIXL: agent name and prepped list)


def interface_of(ip: str) -> str:
    """The name of the network interface that has the IPv4 address ``ip``."""
    for _index, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                # SIOCGIFADDR: the interface's IPv4 address.
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
        if socket.inet_ntoa(raw[20:24]) == ip:
            return name
    raise ValueError(
        f"no network interface of this host has the KV address {ip}; set "
        "kv_transfer_config.kv_ip (or $PDFLEET_KV_BIND_IP behind NAT) to one of this host's "
        "IPv4 addresses"
    )


def restrict_ucx_to(ip: str) -> str:
    """Make UCX use only the interface of ``ip`` (before the first NIXL agent exists).

    ``UCX_NET_DEVICES`` set by the operator of the machine wins; otherwise it is
    set to the interface that holds ``ip``, so UCX listens and connects there only."""
    if os.environ.get("UCX_NET_DEVICES"):
        return os.environ["UCX_NET_DEVICES"]
    os.environ["UCX_NET_DEVICES"] = interface_of(ip)
    return os.environ["UCX_NET_DEVICES"]


class Transport:
    name = "base"

    def register(self, buffer: torch.Tensor, layout: KVLayout) -> None:
        self.buffer, self.layout = buffer, layout

    def handshake_shards(self) -> tuple[int, list[ShardInfo]] | None:
        """(tp_size, one ShardInfo per rank) for the handshake reply, when the
        consumer reads this engine's memory itself; None otherwise."""
        return None

    def connect(self, remote: Remote, reply: HandshakeReply) -> None:
        """Prepare reads from ``remote`` after its handshake reply."""

    def forget(self, remote: Remote) -> None:
        """Drop what ``connect`` set up (the remote restarted or failed)."""

    def start_read(
        self,
        remote: Remote,
        local_ids: list[int],
        remote_ids: list[int],
        lease_id: str,
        deadline: float,
        chain: str | None = None,
    ) -> Any:
        """Start reading ``remote_ids`` (held under ``lease_id``, whose blocks this
        engine's tokens hash to ``chain``) into ``local_ids``."""
        raise NotImplementedError

    def check(self, token: Any) -> str:
        """DONE, PROC or ERR."""
        raise NotImplementedError

    def release(self, token: Any) -> None:
        """Free a finished transfer's resources. Never called while it is PROC: a
        READ that may still write its target blocks is kept until it completes."""

    def serve_read(self, block_ids: list[int]) -> list[Any]:
        raise RuntimeError(f"{self.name} does not serve reads over the side channel")

    def shutdown(self) -> None:
        pass


class NixlTransport(Transport):
    """NIXL READs into the engine's KV shards, each with its own agent (``nixl_shard``).

    At TP=1 the one shard agent lives in this process and commands run at once.
    At TP>1 each rank process owns its shard's agent: commands wait in an outbox
    that the tensor-parallel executor ships with the next step (``drain``), and
    the ranks' finished reads come back with the step's result (``deliver``). A
    read is DONE when every shard's part is; it is PROC while any part may
    still write (so the connector's quarantine holds across ranks)."""

    name = "nixl"

    def __init__(
        self, engine_id: str, instance_id: str, backends: list[str], tp_size: int, num_kv_heads: int
    ) -> None:
        from .nixl_shard import ShardAgent

        self.agent_name = f"{engine_id}-{instance_id}"
        self.backends = backends
        self.tp_size = tp_size
        self.num_kv_heads = num_kv_heads
        # TP=1: this process's shard. TP>1: none here, the ranks hold them.
        self.local = ShardAgent(self.agent_name, backends) if tp_size == 1 else None
        self.shards: list[ShardInfo] = []
        self.lock = threading.Lock()
        self.outbox: list[RankCommand] = []  # for the rank processes
        self.ended: dict[int, dict[int, str]] = {}  # token -> rank -> DONE / ERR
        self.rank_bytes = [0] * tp_size  # bytes each shard pulled (finished reads)
        self.next_token = 0

    def register(self, buffer: torch.Tensor, layout: KVLayout) -> None:
        super().register(buffer, layout)
        if self.local is None:
            raise RuntimeError("broken invariant: self.local is not None")
        self.shards = [self.local.register(buffer, 0)]

    def register_shards(self, layout: KVLayout, shards: list[ShardInfo]) -> None:
        """TP>1: the ranks registered their shards (``shard_info``, rank order)."""
        self.layout, self.shards = layout, shards

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over every shard, every layer, K and V."""
        heads = sum(s.num_kv_heads for s in self.shards)
        per_head = self.layout.block_size * self.layout.head_dim * self.layout.element_size
        return 2 * self.layout.num_layers * heads * per_head

    def handshake_shards(self) -> tuple[int, list[ShardInfo]]:
        # What a one-sided READ needs and nothing more: each shard's agent (its UCX
        # address and memory keys), where its buffer starts, and its KV heads.
        return self.tp_size, self.shards

    def _send(self, rank: int, command: ShardCommand) -> None:
        if self.local is not None:
            self.local.apply([command])
        else:
            with self.lock:
                self.outbox.append(RankCommand(rank, command))

    def drain(self) -> list[RankCommand]:
        """TP>1: the commands for the ranks since the last step (engine thread)."""
        with self.lock:
            out, self.outbox = self.outbox, []
        return out

    def deliver(self, rank: int, ended: list[ShardReadEnded]) -> None:
        """TP>1: rank ``rank``'s reads that ended during the last step (engine thread)."""
        with self.lock:
            self._ended(rank, ended)

    def _ended(self, rank: int, ended: list[ShardReadEnded]) -> None:
        for read in ended:
            if read.token in self.ended:
                self.ended[read.token][rank] = read.state
                self.rank_bytes[rank] += read.nbytes

    def connect(self, remote: Remote, reply: HandshakeReply) -> None:
        remote_tp, shards = reply.tp_size, reply.shards
        why = tp_layout_mismatch(remote_tp, self.num_kv_heads)
        if why is None and (shards is None or len(shards) != remote_tp):
            why = f"tp_size {remote_tp} but {len(shards or [])} KV shards in the handshake"
        if why is not None:
            raise IncompatibleKV(f"the prefill engine's {why}")
        # Both checks above passed: tp_size is a rank count and shards a list of that length.
        if remote_tp is None or shards is None:
            raise TypeError("broken invariant: remote_tp is not None and shards is not None")
        for rank, info in enumerate(shards):
            want = rank_heads(rank, remote_tp, self.num_kv_heads)[1]
            if info.rank != rank or info.num_kv_heads != want:
                why = (
                    f"shard {rank} holds {info.num_kv_heads} KV heads, but tp_size "
                    f"{remote_tp} of {self.num_kv_heads} heads means {want}"
                )
                break
        if why is not None:
            raise IncompatibleKV(f"the prefill engine's {why}")
        key = f"{remote.engine_id}-{remote.instance_id}@{remote.host}:{remote.port}"
        for rank in range(self.tp_size):
            runs = head_plan(rank, self.tp_size, remote_tp, self.num_kv_heads)
            needed = sorted({run.remote_rank for run in runs})
            self._send(
                rank,
                ShardConnect(key, [shards[i] for i in needed], [list(astuple(r)) for r in runs]),
            )
        remote.handle = key

    def forget(self, remote: Remote) -> None:
        if remote.handle is not None:
            for rank in range(self.tp_size):
                self._send(rank, ShardForget(remote.handle))
            remote.handle = None

    def start_read(
        self,
        remote: Remote,
        local_ids: list[int],
        remote_ids: list[int],
        lease_id: str,
        deadline: float,
        chain: str | None = None,
    ) -> int:
        # The claim (on the side channel, before any READ) named the chain.
        with self.lock:
            token = self.next_token
            self.next_token += 1
            self.ended[token] = {}
        for rank in range(self.tp_size):
            self._send(rank, ShardRead(token, remote.handle, list(local_ids), list(remote_ids)))
        return token

    def check(self, token: Any) -> str:
        if self.local is not None:
            ended = self.local.poll()
            with self.lock:
                self._ended(0, ended)
        with self.lock:
            states = self.ended.get(token)
            if states is None:
                return "ERR"
            if len(states) < self.tp_size:
                return "PROC"
            return "DONE" if all(s == "DONE" for s in states.values()) else "ERR"

    def release(self, token: Any) -> None:
        with self.lock:
            self.ended.pop(token, None)
        for rank in range(self.tp_size):
            self._send(rank, ShardRelease(token))

    def shutdown(self) -> None:
        if self.local is not None:
            self.local.shutdown()


class ZmqTransport(Transport):
    """Block bytes as ZeroMQ frames over the side channel, sent from tensor memory."""

    name = "zmq"

    def __init__(self) -> None:
        # The transfer thread's authenticated client (set by the connector).
        self.client: SideChannelClient | None = None

    def _runs(self, block_ids: list[int]) -> list[tuple[int, int]]:
        """Consecutive block ids merged into (start, count) runs."""
        runs: list[tuple[int, int]] = []
        for b in block_ids:
            if runs and runs[-1][0] + runs[-1][1] == b:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((b, 1))
        return runs

    def serve_read(self, block_ids: list[int]) -> list[Any]:
        buf = self.buffer
        frames = []
        host = buf if buf.device.type == "cpu" else None
        for layer in range(self.layout.num_layers):
            for kind in (0, 1):
                for start, count in self._runs(block_ids):
                    view = buf[layer, kind, start : start + count]
                    if host is None:
                        view = view.to("cpu")
                    # Zero-copy on CPU: the frame wraps the cache memory itself.
                    frames.append(view.contiguous().view(torch.uint8).numpy().data)
        return frames

    def start_read(
        self,
        remote: Remote,
        local_ids: list[int],
        remote_ids: list[int],
        lease_id: str,
        deadline: float,
        chain: str | None = None,
    ) -> str:
        """Synchronous: the bytes are in the local blocks when it returns."""
        if self.client is None:
            raise RuntimeError("broken invariant: self.client is not None")
        timeout = max(0.05, deadline - time.monotonic())
        _reply, frames = self.client.call(
            remote.host,
            remote.port,
            LeaseUse(READ, lease_id, tuple(remote_ids), chain).to_wire(),
            timeout,
        )
        delay = kv_read_delay()
        if delay > 0:
            time.sleep(delay)  # the test hook: the bytes land late
        layout = self.layout
        expected = layout.num_layers * 2 * len(self._runs(list(remote_ids)))
        if len(frames) != expected:
            raise RuntimeError(f"expected {expected} frames, got {len(frames)}")
        dest_runs = self._split(local_ids, [c for _, c in self._runs(list(remote_ids))])
        i = 0
        with torch.inference_mode():
            for layer in range(layout.num_layers):
                for kind in (0, 1):
                    for dest in dest_runs:
                        data = torch.frombuffer(frames[i].buffer, dtype=torch.uint8)
                        src = data.view(self.buffer.dtype).view(
                            len(dest), layout.block_size, layout.num_kv_heads, layout.head_dim
                        )
                        index = torch.tensor(dest, device=self.buffer.device)
                        self.buffer[layer, kind].index_copy_(0, index, src.to(self.buffer.device))
                        i += 1
        if self.buffer.device.type == "cuda":
            torch.cuda.current_stream(self.buffer.device).synchronize()
        return "DONE"

    @staticmethod
    def _split(ids: list[int], counts: list[int]) -> list[list[int]]:
        out, pos = [], 0
        for c in counts:
            out.append(list(ids[pos : pos + c]))
            pos += c
        return out

    def check(self, token: Any) -> str:
        state: str = token  # start_read's answer: always DONE
        return state

    def shutdown(self) -> None:
        pass


def new_instance_id() -> str:
    return uuid.uuid4().hex[:12]
