"""Byte movers for KV blocks: NIXL (UCX) READs, or ZeroMQ frames.

Both read whole blocks of the remote engine into local blocks; the connector
decides which. A transport is used from the connector's transfer thread
(reads) and the engine thread (producer notifications).
"""

from __future__ import annotations

import logging
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
        request_id: str,
        deadline: float,
    ) -> Any:
        raise NotImplementedError

    def check(self, token: Any) -> str:
        """DONE, PROC or ERR."""
        raise NotImplementedError

    def release(self, token: Any) -> None:
        """Free a transfer's resources (cancels it if still running)."""

    def poll_released(self) -> list[str]:
        """Producer: request ids whose blocks consumers finished reading."""
        return []

    def serve_read(self, request: dict[str, Any], block_ids: list[int]) -> list[Any]:
        raise RuntimeError(f"{self.name} does not serve reads over the side channel")

    def shutdown(self) -> None:
        pass


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
        config = nixl_agent_config(
            backends=backends, sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        )
        self.agent = nixl_agent(self.agent_name, config)
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
        return {"agent_metadata": self.agent.get_agent_metadata(), "device_id": self.dev}

    def connect(self, remote: Remote, reply: dict[str, Any]) -> None:
        name = self.agent.add_remote_agent(reply["agent_metadata"])
        name = name.decode() if isinstance(name, bytes) else name
        remote_list = self.agent.prep_xfer_dlist(
            name, self._descs(remote.layout, int(reply.get("device_id", 0))), self.mem_type
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

    def start_read(self, remote, local_ids, remote_ids, request_id, deadline):
        _name, remote_list = remote.handle
        local_idx = self.layout.indices(local_ids)
        remote_idx = remote.layout.indices(remote_ids)
        xfer = self.agent.make_prepped_xfer(
            "READ",
            self.local_list,
            local_idx,
            remote_list,
            remote_idx,
            notif_msg=request_id.encode(),
        )
        state = self.agent.transfer(xfer)
        if state == "ERR":
            self.release(xfer)
            raise RuntimeError("NIXL refused the READ")
        return xfer

    def check(self, token: Any) -> str:
        return self.agent.check_xfer_state(token)

    def release(self, token: Any) -> None:
        try:
            self.agent.release_xfer_handle(token)
        except Exception:
            # A transfer that cannot be cancelled stays referenced, never freed twice.
            self.leaked.append(token)

    def poll_released(self) -> list[str]:
        out = []
        for messages in self.agent.get_new_notifs().values():
            out.extend(bytes(m).decode(errors="replace") for m in messages)
        return out

    def shutdown(self) -> None:
        try:
            self.agent.deregister_memory(self.reg)
        except Exception as e:
            logger.debug("deregister: %s", e)


class ZmqTransport(Transport):
    """Block bytes as ZeroMQ frames over the side channel, sent from tensor memory."""

    name = "zmq"

    def __init__(self, client_factory: Any = SideChannelClient) -> None:
        self.client = client_factory()

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

    def start_read(self, remote, local_ids, remote_ids, request_id, deadline):
        timeout = max(0.05, deadline - time.monotonic())
        _reply, frames = self.client.call(
            remote.host,
            remote.port,
            {"op": "read", "request_id": request_id, "block_ids": list(remote_ids)},
            timeout,
        )
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
        self.client.send_nowait(
            remote.host, remote.port, {"op": "release", "request_id": request_id}
        )
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
        self.client.close()


def new_instance_id() -> str:
    return uuid.uuid4().hex[:12]
