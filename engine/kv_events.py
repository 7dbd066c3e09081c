"""Publishing prefix-cache events (block stored / removed / all cleared) over ZeroMQ.

External routers follow which prefixes each engine caches from these events,
as with vLLM's ``--kv-events-config``, in vLLM's current wire format
(``contracts/kv_events.py``, docs/kv_events.md). A chain of blocks stored in
one step is one ``BlockStored`` (its token ids concatenated, as vLLM sends
them). The first batch of a publisher is an ``AllBlocksCleared``, so a
subscriber that knew a previous instance of the engine drops what it knew; an
idle publisher sends an empty batch every ``heartbeat_interval`` seconds, so a
subscriber can tell a quiet engine from a lost stream. A replay socket
(ROUTER) answers a sequence number with every buffered batch from there on,
then the end marker. Publishing runs on its own thread behind a bounded
queue, so a slow subscriber never blocks the engine.

By default ``token_ids`` are empty (the hashes say which prefixes are cached
without carrying the prompt); ``include_token_ids`` puts them back for vLLM's
router. With a fleet secret, both sockets are ZeroMQ CURVE servers whose key
pair derives from it: a subscriber that does not hold the secret cannot
complete the handshake and receives nothing.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time

import zmq

from .config import KVEventsConfig
from .contracts.block_hash import external_block_hash
from .contracts.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    curve_server_keys,
    pack_seq,
    unpack_seq,
)
from .core.block_pool import KVCacheEvent

logger = logging.getLogger(__name__)


def bind_endpoint(endpoint: str, kv_ip: str | None) -> str:
    """``endpoint`` with a ``*`` host replaced by the engine's KV address."""
    if kv_ip and endpoint.startswith("tcp://*:"):
        host = f"[{kv_ip}]" if ":" in kv_ip else kv_ip
        return f"tcp://{host}:{endpoint.removeprefix('tcp://*:')}"
    return endpoint


def kv_events_of(events: list[KVCacheEvent], include_token_ids: bool = True) -> list[KVEvent]:
    """The published events of one step's prefix-cache changes: consecutive
    stores that chain (each block's parent is the previous block) on one tier
    become one ``BlockStored``, consecutive removals on one tier one
    ``BlockRemoved``. Without ``include_token_ids`` every ``token_ids`` is empty."""
    out: list[KVEvent] = []
    last_hash: bytes | None = None
    for e in events:
        prev = out[-1] if out else None
        if e.kind == "stored":
            h = external_block_hash(e.block_hash)
            if (
                isinstance(prev, BlockStored)
                and prev.medium == e.medium
                and prev.block_size == e.block_size
                and e.parent_hash is not None
                and e.parent_hash == last_hash
            ):
                prev.block_hashes.append(h)
                if include_token_ids:
                    prev.token_ids.extend(e.token_ids)
            else:
                out.append(
                    BlockStored(
                        [h],
                        None if e.parent_hash is None else external_block_hash(e.parent_hash),
                        list(e.token_ids) if include_token_ids else [],
                        e.block_size,
                        e.medium,
                    )
                )
            last_hash = e.block_hash
            continue
        last_hash = None
        if e.kind == "removed":
            h = external_block_hash(e.block_hash)
            if isinstance(prev, BlockRemoved) and prev.medium == e.medium:
                prev.block_hashes.append(h)
            else:
                out.append(BlockRemoved([h], e.medium))
        elif e.kind == "cleared":
            out.append(AllBlocksCleared())
        else:
            raise AssertionError(f"unknown KV cache event kind {e.kind!r}")
    return out


class KVEventPublisher:
    def __init__(
        self, config: KVEventsConfig, kv_ip: str | None = None, secret: bytes | None = None
    ) -> None:
        """``kv_ip``: what a ``*`` host binds (the engine's KV address); ``secret``:
        the fleet secret (CURVE keys, unless ``config.auth`` is ``none``)."""
        self.config = config
        auth = config.auth or ("fleet" if secret is not None else "none")
        if auth == "fleet" and secret is None:
            raise ValueError(
                "kv_events_config.auth fleet needs the fleet secret ($PDFLEET_FLEET_SECRET "
                "or $PDFLEET_FLEET_SECRET_FILE)"
            )
        self.auth = auth
        self.topic = config.topic.encode()
        self.queue: queue.Queue[EventBatch] = queue.Queue(maxsize=config.max_queue_size)
        self.buffer: collections.deque[tuple[int, bytes]] = collections.deque(
            maxlen=config.buffer_steps
        )
        self.seq = 0
        self.dropped = 0
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.SNDHWM, config.hwm)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay: zmq.Socket[bytes] | None = None
        self.endpoint = bind_endpoint(config.endpoint, kv_ip)
        self.replay_endpoint = (
            bind_endpoint(config.replay_endpoint, kv_ip) if config.replay_endpoint else None
        )
        try:
            self._secure(self.pub, secret)
            self.pub.bind(self.endpoint)
            if self.replay_endpoint:
                self.replay = ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self._secure(self.replay, secret)
                self.replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self.pub.close(0)
            if self.replay is not None:
                self.replay.close(0)
            raise ValueError(f"kv_events_config: cannot bind {self.endpoint}: {e}") from None
        logger.info(
            "KV events on %s (replay %s), subscribers: %s, token ids %s",
            self.endpoint,
            self.replay_endpoint,
            "fleet members only (CURVE)" if auth == "fleet" else "anyone who reaches the port",
            "included" if config.include_token_ids else "left out",
        )
        self._stop = threading.Event()
        # A new instance: subscribers drop what an earlier one published.
        self.queue.put_nowait(EventBatch(time.time(), [AllBlocksCleared()]))
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.thread.start()

    def _secure(self, sock: zmq.Socket[bytes], secret: bytes | None) -> None:
        if self.auth == "fleet":
            if secret is None:
                raise RuntimeError("broken invariant: secret is not None")
            public, private = curve_server_keys(secret)
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, private)

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events (called on the engine thread; never blocks)."""
        if not events:
            return
        try:
            self.queue.put_nowait(
                EventBatch(time.time(), kv_events_of(events, self.config.include_token_ids))
            )
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        poller = zmq.Poller()
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        heartbeat = self.config.heartbeat_interval
        last_sent = time.monotonic()
        while not self._stop.is_set():
            batch: EventBatch | None
            try:
                batch = self.queue.get(timeout=0.02)
            except queue.Empty:
                if time.monotonic() - last_sent < heartbeat:
                    batch = None
                else:
                    batch = EventBatch(time.time())  # "still here, nothing changed"
            if batch is not None:
                self._send(batch.encode())
                last_sent = time.monotonic()
            if self.replay is not None and dict(poller.poll(0)):
                self._serve_replay()

    def _send(self, payload: bytes) -> None:
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        try:
            self.pub.send_multipart([self.topic, pack_seq(seq), payload], zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def _serve_replay(self) -> None:
        if self.replay is None:  # only called when replay is configured
            raise RuntimeError("broken invariant: self.replay is not None")
        ident, *frames = self.replay.recv_multipart()
        try:
            start = unpack_seq(frames[-1])
        except (ValueError, IndexError):
            start = 0
        for seq, payload in list(self.buffer):
            if seq >= start:
                self.replay.send_multipart([ident, b"", pack_seq(seq), payload])
        self.replay.send_multipart([ident, b"", END_SEQ, b""])

    def shutdown(self) -> None:
        self._stop.set()
        self.thread.join(2)
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
