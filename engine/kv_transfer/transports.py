"""Byte movers for KV blocks: NIXL (UCX) READs, or ZeroMQ frames.

Both read whole blocks of the remote engine into local blocks; the connector
decides which, and checks the producer's lease before and after. A transport
is used from the connector's transfer thread only.

Test hook: when ``$PDFLEET_KV_TEST_READ_DELAY_FILE`` names a file holding a
number of seconds, every READ started while it does is delayed by that much
(NIXL: the READ is posted late and cannot be cancelled meanwhile; ZMQ: the
bytes are written late). Tests use it to abort and time out requests mid-pull.
"""

from __future__ import annotations

import dataclasses
import fcntl
import logging
import os
import socket
import struct
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .layout import KVLayout
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


READ_DELAY_ENV = "PDFLEET_KV_TEST_READ_DELAY_FILE"


def read_delay() -> float:
    """Seconds to delay the next READ by (the test hook above); 0 normally."""
    path = os.environ.get(READ_DELAY_ENV)
    if not path:
        return 0.0
    try:
        with open(path) as f:
            return max(0.0, float(f.read().strip() or 0))
    except (OSError, ValueError):
        return 0.0


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

    def handshake_fields(self) -> dict[str, Any]:
        return {}

    def connect(self, remote: Remote, reply: dict[str, Any]) -> None:
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
    ) -> Any:
        """Start reading ``remote_ids`` (held under ``lease_id``) into ``local_ids``."""
        raise NotImplementedError

    def check(self, token: Any) -> str:
        """DONE, PROC or ERR."""
        raise NotImplementedError

    def release(self, token: Any) -> None:
        """Free a finished transfer's resources. Never called while it is PROC: a
        READ that may still write its target blocks is kept until it completes."""

    def serve_read(self, request: dict[str, Any], block_ids: list[int]) -> list[Any]:
        raise RuntimeError(f"{self.name} does not serve reads over the side channel")

    def shutdown(self) -> None:
        pass


# How long NIXL's UCX progress thread sleeps in poll() between wake-ups (µs; NIXL
# rounds it up to whole ms). The thread wakes at once on UCX events (its workers'
# event fds), so this is only the fallback for transports that need a periodic
# progress call. The Python binding hard-codes 0: a zero-timeout poll() loop that
# keeps one core busy (mostly in the kernel) in every engine, idle or not.
NIXL_PROGRESS_POLL_US = 10_000
_AGENT_LOCK = threading.Lock()


def nixl_agent_with_poll_timeout(
    nixl_agent: Any, name: str, config: Any, poll_us: int = NIXL_PROGRESS_POLL_US
) -> Any:
    """``nixl_agent(name, config)`` whose progress thread blocks in poll() for up to
    ``poll_us`` instead of spinning.

    The binding builds the native agent config inside ``nixl_agent.__init__`` and
    offers no argument for the delay, so the native constructor is wrapped for the
    duration of this call (under a lock; nothing else creates agents meanwhile)."""
    from nixl_cu12 import _api

    native = getattr(_api, "nixlBind", None)
    if native is None or not hasattr(native, "nixlAgent"):
        logger.warning("this NIXL has no nixlBind.nixlAgent: its progress poll is left as is")
        return nixl_agent(name, config)
    bind: Any = native

    class _WithDelay:
        def __getattr__(self, attr: str) -> Any:
            return getattr(bind, attr)

        @staticmethod
        def nixlAgent(agent_name: str, agent_config: Any) -> Any:
            agent_config.pthrDelay = poll_us
            return bind.nixlAgent(agent_name, agent_config)

    with _AGENT_LOCK:
        _api.nixlBind = _WithDelay()
        try:
            return nixl_agent(name, config)
        finally:
            _api.nixlBind = native


class NixlTransport(Transport):
    """One NIXL agent (UCX backend) per engine; the whole KV buffer registered once."""

    name = "nixl"

    def __init__(self, engine_id: str, instance_id: str, backends: list[str]) -> None:
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as e:
            raise ValueError(
                "NixlConnector needs the nixl-cu12 package (`pip install nixl-cu12`); use "
                "ZmqConnector on machines without NIXL"
            ) from e
        self.agent_name = f"{engine_id}-{instance_id}"
        # No listen thread: the agent's metadata goes out only through the
        # authenticated side channel.
        config = nixl_agent_config(
            enable_listen_thread=False,
            backends=backends,
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.agent = nixl_agent_with_poll_timeout(nixl_agent, self.agent_name, config)
        self.leaked: list[Any] = []

    def register(self, buffer: torch.Tensor, layout: KVLayout) -> None:
        super().register(buffer, layout)
        self.mem_type = "DRAM" if buffer.device.type == "cpu" else "VRAM"
        self.dev = 0 if buffer.device.type == "cpu" else buffer.device.index or 0
        self.reg = self.agent.register_memory(buffer)
        self.local_list = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", self._descs(layout, self.dev), self.mem_type
        )

    @staticmethod
    def _descs(layout: KVLayout, dev: int) -> np.ndarray:
        idx = np.arange(layout.num_regions, dtype=np.uint64)
        descs = np.empty((layout.num_regions, 3), dtype=np.uint64)
        descs[:, 0] = np.uint64(layout.base_address) + idx * np.uint64(layout.block_bytes)
        descs[:, 1] = layout.block_bytes
        descs[:, 2] = dev
        return descs

    def handshake_fields(self) -> dict[str, Any]:
        # What a one-sided READ needs and nothing more: the agent (its UCX address
        # and memory keys) and where the registered buffer starts.
        return {
            "agent_metadata": self.agent.get_agent_metadata(),
            "device_id": self.dev,
            "base_address": self.layout.base_address,
        }

    def connect(self, remote: Remote, reply: dict[str, Any]) -> None:
        name = self.agent.add_remote_agent(reply["agent_metadata"])
        name = name.decode() if isinstance(name, bytes) else name
        layout = dataclasses.replace(remote.layout, base_address=int(reply["base_address"]))
        remote.layout = layout
        remote_list = self.agent.prep_xfer_dlist(
            name, self._descs(layout, int(reply.get("device_id", 0))), self.mem_type
        )
        remote.handle = (name, remote_list)

    def forget(self, remote: Remote) -> None:
        if remote.handle is not None:
            name, remote_list = remote.handle
            try:
                self.agent.release_dlist_handle(remote_list)
                self.agent.remove_remote_agent(name)
            except Exception as e:  # already gone
                logger.debug("forgetting %s: %s", name, e)
            remote.handle = None

    def start_read(self, remote, local_ids, remote_ids, lease_id, deadline):
        _name, remote_list = remote.handle
        local_idx = self.layout.indices(local_ids)
        remote_idx = remote.layout.indices(remote_ids)
        # No notification: the consumer confirms over the side channel instead.
        xfer = self.agent.make_prepped_xfer(
            "READ", self.local_list, local_idx, remote_list, remote_idx
        )
        delay = read_delay()
        if delay > 0:
            return _Delayed(xfer, time.monotonic() + delay)
        if self.agent.transfer(xfer) == "ERR":
            self.release(xfer)
            raise RuntimeError("NIXL refused the READ")
        return xfer

    def check(self, token: Any) -> str:
        if isinstance(token, _Delayed):
            if not token.posted:
                if time.monotonic() < token.start_at:
                    return "PROC"
                token.posted = True
                if self.agent.transfer(token.xfer) == "ERR":
                    return "ERR"
            return self.agent.check_xfer_state(token.xfer)
        return self.agent.check_xfer_state(token)

    def release(self, token: Any) -> None:
        xfer = token.xfer if isinstance(token, _Delayed) else token
        try:
            self.agent.release_xfer_handle(xfer)
        except Exception:
            # NIXL still owns it: keep a reference, never free it twice.
            self.leaked.append(xfer)

    def shutdown(self) -> None:
        try:
            self.agent.deregister_memory(self.reg)
        except Exception as e:
            logger.debug("deregister: %s", e)


@dataclass
class _Delayed:
    """A NIXL READ posted only at ``start_at`` (the test hook): until then and
    while it runs it cannot be cancelled, like a READ stuck in the fabric."""

    xfer: Any
    start_at: float
    posted: bool = False


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

    def serve_read(self, request: dict[str, Any], block_ids: list[int]) -> list[Any]:
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
                    frames.append(memoryview(view.contiguous().view(torch.uint8).numpy()))
        return frames

    def start_read(self, remote, local_ids, remote_ids, lease_id, deadline):
        """Synchronous: the bytes are in the local blocks when it returns."""
        assert self.client is not None
        timeout = max(0.05, deadline - time.monotonic())
        _reply, frames = self.client.call(
            remote.host,
            remote.port,
            {"op": "read", "lease_id": lease_id, "block_ids": list(remote_ids)},
            timeout,
        )
        delay = read_delay()
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
        return token

    def shutdown(self) -> None:
        pass


def new_instance_id() -> str:
    return uuid.uuid4().hex[:12]
