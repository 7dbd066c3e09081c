"""One KV shard's NIXL agent: the data plane of a NIXL pull.

Every process that holds KV memory owns one: the engine process at TP=1, each
rank process at TP>1 (its own agent, its own registered shard). The control
plane (side channel, leases, handshakes) stays in the engine's main process
(``connector.py``), which drives the shard agents with the shard commands
of ``contracts/kv_connector.py`` (connect, read, release, forget).

A read whose runs cover whole blocks on both sides (equal shards) uses one
descriptor per (layer, K/V, block) from prepared lists. A head slice of a
block is not contiguous in the ``[block_size, kv_heads, head_dim]`` block
layout, so a sliced run uses one descriptor per token slot, for the blocks of
that read only. Either way a shard reads its own heads' bytes and no more;
``poll`` reports them per finished read. See docs/kv_transfer.md.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..contracts.kv_connector import (
    ShardCommand,
    ShardConnect,
    ShardForget,
    ShardInfo,
    ShardRead,
    ShardReadEnded,
    ShardRelease,
)
from ..testing_hooks import kv_read_delay
from .layout import HeadRun, KVLayout

logger = logging.getLogger(__name__)

PROC, DONE, ERR = "PROC", "DONE", "ERR"


@dataclass
class _RemoteShard:
    agent: str
    layout: KVLayout
    device_id: int
    blocks: Any = None  # prepared whole-block list, when a run reads whole blocks


@dataclass
class _Read:
    xfers: list[Any]
    nbytes: int
    start_at: float = 0.0  # the READ test hook: post no earlier than this
    posted: bool = False
    error: bool = False
    reported: bool = False
    # The READs NIXL accepted: only those may still write (one it refused, e.g. to
    # a peer that disconnected since the read was prepared, never started).
    live: list[Any] = field(default_factory=list)


@dataclass
class _Peer:
    shards: dict[int, _RemoteShard]
    runs: list[HeadRun]
    error: str = ""


def shard_info(layout: KVLayout, agent_metadata: bytes, device_id: int, rank: int) -> ShardInfo:
    """What a consumer's shard needs to read this shard (sent in the handshake)."""
    return ShardInfo(
        rank, agent_metadata, layout.base_address, device_id, layout.num_blocks, layout.num_kv_heads
    )


def row_descs(
    layout: KVLayout, block_ids: list[int], head: int, num_heads: int, dev: int
) -> np.ndarray:
    """Descriptors of ``num_heads`` heads from ``head`` in every token slot of the
    blocks, ordered (layer, K/V, block, slot): ``[n, 3]`` rows of (address, bytes, dev)."""
    ids = np.asarray(block_ids, dtype=np.uint64)
    layers = np.arange(layout.num_layers, dtype=np.uint64)[:, None, None]
    kinds = np.arange(2, dtype=np.uint64)[None, :, None]
    regions = (layers * 2 + kinds) * np.uint64(layout.num_blocks) + ids[None, None, :]
    row_bytes = layout.num_kv_heads * layout.head_dim * layout.element_size
    head_bytes = layout.head_dim * layout.element_size
    slots = np.arange(layout.block_size, dtype=np.uint64) * np.uint64(row_bytes)
    addr = (
        np.uint64(layout.base_address + head * head_bytes)
        + regions[..., None] * np.uint64(layout.block_bytes)
        + slots
    )
    descs = np.empty((addr.size, 3), dtype=np.uint64)
    descs[:, 0] = addr.reshape(-1)
    descs[:, 1] = num_heads * head_bytes
    descs[:, 2] = dev
    return descs


def block_descs(layout: KVLayout, dev: int) -> np.ndarray:
    """One descriptor per (layer, K/V, block) of the whole shard."""
    idx = np.arange(layout.num_regions, dtype=np.uint64)
    descs = np.empty((layout.num_regions, 3), dtype=np.uint64)
    descs[:, 0] = np.uint64(layout.base_address) + idx * np.uint64(layout.block_bytes)
    descs[:, 1] = layout.block_bytes
    descs[:, 2] = dev
    return descs


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


class ShardAgent:
    """A NIXL agent (UCX) with this process's KV shard registered once.

    Used from one thread at a time (the connector's transfer thread at TP=1, the
    rank's step loop at TP>1). Nothing here blocks."""

    def __init__(self, name: str, backends: list[str]) -> None:
        try:
            from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
        except ImportError as e:
            raise ValueError(
                "NixlConnector needs the nixl-cu12 package (`pip install nixl-cu12`); use "
                "ZmqConnector on machines without NIXL"
            ) from e
        self.name = name
        # No listen thread: the agent's metadata goes out only through the
        # authenticated side channel.
        config = nixl_agent_config(
            enable_listen_thread=False,
            backends=backends,
            sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        self.agent = nixl_agent_with_poll_timeout(nixl_agent, name, config)
        self.peers: dict[str, _Peer] = {}
        self.reads: dict[int, _Read] = {}
        self.leaked: list[Any] = []
        self.layout: KVLayout | None = None

    # -- setup ----------------------------------------------------------------------

    def register(self, buffer: torch.Tensor, rank: int = 0) -> ShardInfo:
        """Register the shard; returns its ``shard_info``."""
        self.layout = layout = KVLayout.of(buffer)
        self.mem_type = "DRAM" if buffer.device.type == "cpu" else "VRAM"
        self.dev = 0 if buffer.device.type == "cpu" else buffer.device.index or 0
        self.reg = self.agent.register_memory(buffer)
        self.blocks = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", block_descs(layout, self.dev), self.mem_type
        )
        return shard_info(layout, self.agent.get_agent_metadata(), self.dev, rank)

    def apply(self, commands: list[ShardCommand]) -> None:
        """Run the control plane's commands (in order). A failing one marks what it
        concerns as failed; it never raises."""
        for command in commands:
            try:
                match command:
                    case ShardConnect():
                        self._connect(command.key, command.remote_shards, command.runs)
                    case ShardRead():
                        self._read(
                            command.token, command.key, command.local_ids, command.remote_ids
                        )
                    case ShardRelease():
                        self._release(command.token)
                    case ShardForget():
                        self._forget(command.key)
            except Exception as e:
                logger.warning("KV shard %s: %s failed: %s", self.name, type(command).__name__, e)
                if isinstance(command, ShardRead):
                    self._release(command.token)  # nothing of it was posted
                    self.reads[command.token] = _Read([], 0, posted=True, error=True)
                elif isinstance(command, ShardConnect):
                    self.peers[command.key] = _Peer({}, [], error=str(e))

    def _connect(self, key: str, remotes: list[ShardInfo], runs: list[list[int]]) -> None:
        if self.layout is None:
            raise RuntimeError("broken invariant: self.layout is not None")
        self._forget(key)
        peer = _Peer({}, [HeadRun(*r) for r in runs])
        self.peers[key] = peer
        for info in remotes:
            name = self.agent.add_remote_agent(info.agent_metadata)
            name = name.decode() if isinstance(name, bytes) else name
            layout = dataclasses.replace(
                self.layout,
                num_blocks=info.num_blocks,
                num_kv_heads=info.num_kv_heads,
                base_address=info.base_address,
                device="remote",
            )
            shard = _RemoteShard(name, layout, info.device_id)
            peer.shards[info.rank] = shard
        for run in peer.runs:
            shard = peer.shards[run.remote_rank]
            if self._whole(run, shard) and shard.blocks is None:
                shard.blocks = self.agent.prep_xfer_dlist(
                    shard.agent, block_descs(shard.layout, shard.device_id), self.mem_type
                )

    def _whole(self, run: HeadRun, shard: _RemoteShard) -> bool:
        if self.layout is None:
            raise RuntimeError("broken invariant: self.layout is not None")
        return run.num_heads == self.layout.num_kv_heads == shard.layout.num_kv_heads

    def _read(self, token: int, key: str, local_ids: list[int], remote_ids: list[int]) -> None:
        if self.layout is None:
            raise RuntimeError("broken invariant: self.layout is not None")
        peer = self.peers.get(key)
        if peer is None or peer.error:
            raise RuntimeError(f"no connection to {key}: {peer.error if peer else 'unknown'}")
        read = _Read([], 0)
        self.reads[token] = read
        for run in peer.runs:
            shard = peer.shards[run.remote_rank]
            if self._whole(run, shard):
                xfer = self.agent.make_prepped_xfer(
                    "READ",
                    self.blocks,
                    self.layout.indices(local_ids),
                    shard.blocks,
                    shard.layout.indices(remote_ids),
                )
            else:
                local = row_descs(self.layout, local_ids, run.local_head, run.num_heads, self.dev)
                remote = row_descs(
                    shard.layout, remote_ids, run.remote_head, run.num_heads, shard.device_id
                )
                xfer = self.agent.initialize_xfer(
                    "READ",
                    self.agent.get_xfer_descs(local, self.mem_type),
                    self.agent.get_xfer_descs(remote, self.mem_type),
                    shard.agent,
                )
            read.xfers.append(xfer)
            read.nbytes += (
                2
                * self.layout.num_layers
                * len(local_ids)
                * self.layout.block_size
                * run.num_heads
                * self.layout.head_dim
                * self.layout.element_size
            )
        delay = kv_read_delay()
        if delay > 0:
            read.start_at = time.monotonic() + delay
        else:
            self._post(read)

    def _post(self, read: _Read) -> None:
        read.posted = True
        for xfer in read.xfers:
            try:
                status = self.agent.transfer(xfer)
            except Exception as e:  # the peer went away: NIXL raises, not "ERR"
                logger.warning("a KV READ could not be posted: %s", e)
                read.error = True
                continue
            read.live.append(xfer)
            if status == "ERR":
                read.error = True

    def _release(self, token: int) -> None:
        read = self.reads.pop(int(token), None)
        for xfer in read.xfers if read else ():
            try:
                self.agent.release_xfer_handle(xfer)
            except Exception:
                # NIXL still owns it: keep a reference, never free it twice.
                self.leaked.append(xfer)

    def _forget(self, key: str) -> None:
        peer = self.peers.pop(key, None)
        for shard in peer.shards.values() if peer else ():
            try:
                if shard.blocks is not None:
                    self.agent.release_dlist_handle(shard.blocks)
                self.agent.remove_remote_agent(shard.agent)
            except Exception as e:  # already gone
                logger.debug("forgetting %s: %s", shard.agent, e)

    # -- progress -------------------------------------------------------------------

    def state(self, token: int) -> str:
        """PROC while any of the read's READs may still write; then ERR if one failed,
        else DONE. Unknown tokens are ERR."""
        read = self.reads.get(token)
        if read is None:
            return ERR
        if not read.posted:
            if time.monotonic() < read.start_at:
                return PROC
            self._post(read)
        states = [self._xfer_state(x) for x in read.live]
        if any(s == "PROC" for s in states):
            return PROC
        return ERR if read.error or any(s != DONE for s in states) else DONE

    def _xfer_state(self, xfer: Any) -> str:
        try:
            state: str = self.agent.check_xfer_state(xfer)
            return state
        except Exception as e:  # a disconnected peer: the READ ended in error
            logger.warning("a KV READ failed: %s", e)
            return ERR

    def poll(self) -> list[ShardReadEnded]:
        """Each read that ended since the last poll."""
        ended = []
        for token, read in self.reads.items():
            if read.reported:
                continue
            s = self.state(token)
            if s != PROC:
                read.reported = True
                ended.append(ShardReadEnded(token, s, read.nbytes if s == DONE else 0))
        return ended

    def shutdown(self) -> None:
        try:
            self.agent.deregister_memory(self.reg)
        except Exception as e:
            logger.debug("deregister: %s", e)
