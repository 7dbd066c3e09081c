"""Publishing prefix-cache events (block stored / removed / all cleared) over ZeroMQ.

External routers follow which prefixes each engine caches from these events,
as with vLLM's ``--kv-events-config``, in vLLM's current wire format
(docs/kv_events.md): each message is multipart ``[topic, sequence (8 bytes,
big-endian), payload]``, the payload vLLM's ``EventBatch`` (array-like in
msgpack: ``[ts, events, data_parallel_rank]``) whose events are maps tagged by
``type``::

    {"type": "BlockStored", "block_hashes": [id, ...], "parent_block_hash": id | None,
     "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU",
     "lora_name": None}
    {"type": "BlockRemoved", "block_hashes": [id, ...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

Block ids are the 64-bit integers of ``core.block_hash.external_block_hash``.
A chain of blocks stored in one step is one ``BlockStored`` (its token ids
concatenated, as vLLM sends them). The first batch of a publisher is an
``AllBlocksCleared``, so a subscriber that knew a previous instance of the
engine drops what it knew; an idle publisher sends an empty batch every
``heartbeat_interval`` seconds, so a subscriber can tell a quiet engine from a
lost stream. A replay socket (ROUTER) answers a sequence number with every
buffered batch from there on, then ``[-1, b""]``. Publishing runs on its own
thread behind a bounded queue, so a slow subscriber never blocks the engine.

By default ``token_ids`` are empty (the hashes say which prefixes are cached
without carrying the prompt); ``include_token_ids`` puts them back for vLLM's
router. With a fleet secret, both sockets are ZeroMQ CURVE servers whose key
pair derives from it (:func:`curve_server_keys`): a subscriber that does not
hold the secret cannot complete the handshake and receives nothing.
"""

from __future__ import annotations

import collections
import logging
import queue
import struct
import threading
import time
from typing import Any

import msgpack
import zmq
import zmq.utils.z85

from .config import KVEventsConfig, security
from .core.block_hash import external_block_hash
from .core.block_pool import KVCacheEvent

logger = logging.getLogger(__name__)

END_SEQ = struct.pack(">q", -1)


def curve_server_keys(secret: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys of a fleet's KV event publishers."""
    private = zmq.utils.z85.encode(security.kv_events_server_key(secret))
    return zmq.curve_public(private), private


def bind_endpoint(endpoint: str, kv_ip: str | None) -> str:
    """``endpoint`` with a ``*`` host replaced by the engine's KV address."""
    if kv_ip and endpoint.startswith("tcp://*:"):
        host = f"[{kv_ip}]" if ":" in kv_ip else kv_ip
        return f"tcp://{host}:{endpoint.removeprefix('tcp://*:')}"
    return endpoint


def encode_events(
    events: list[KVCacheEvent], include_token_ids: bool = True
) -> list[dict[str, Any]]:
    """vLLM's tagged-map events for one step; consecutive stores that chain
    (each block's parent is the previous block) on one tier become one
    ``BlockStored``, consecutive removals on one tier one ``BlockRemoved``.
    Without ``include_token_ids`` every ``token_ids`` is empty."""
    out: list[dict[str, Any]] = []
    last_hash: bytes | None = None
    for e in events:
        prev = out[-1] if out else None
        if e.kind == "stored":
            h = external_block_hash(e.block_hash)
            if (
                prev is not None
                and prev["type"] == "BlockStored"
                and prev["medium"] == e.medium
                and prev["block_size"] == e.block_size
                and e.parent_hash is not None
                and e.parent_hash == last_hash
            ):
                prev["block_hashes"].append(h)
                if include_token_ids:
                    prev["token_ids"].extend(e.token_ids)
            else:
                out.append(
                    {
                        "type": "BlockStored",
                        "block_hashes": [h],
                        "parent_block_hash": (
                            None if e.parent_hash is None else external_block_hash(e.parent_hash)
                        ),
                        "token_ids": list(e.token_ids) if include_token_ids else [],
                        "block_size": e.block_size,
                        "lora_id": None,
                        "medium": e.medium,
                        "lora_name": None,
                    }
                )
            last_hash = e.block_hash
            continue
        last_hash = None
        if e.kind == "removed":
            h = external_block_hash(e.block_hash)
            if prev is not None and prev["type"] == "BlockRemoved" and prev["medium"] == e.medium:
                prev["block_hashes"].append(h)
            else:
                out.append({"type": "BlockRemoved", "block_hashes": [h], "medium": e.medium})
        elif e.kind == "cleared":
            out.append({"type": "AllBlocksCleared"})
        else:
            raise AssertionError(f"unknown KV cache event kind {e.kind!r}")
    return out


def encode_batch(ts: float, events: list[dict[str, Any]], data_parallel_rank: int = 0) -> bytes:
    """One ``EventBatch`` payload: msgpack ``[ts, events, data_parallel_rank]``
    (vLLM's array-like batch; hashes are integers, never pickles)."""
    return msgpack.packb([ts, events, data_parallel_rank], use_bin_type=True)


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
        self.queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
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
        self.queue.put_nowait((time.time(), [{"type": "AllBlocksCleared"}]))
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.thread.start()

    def _secure(self, sock: zmq.Socket[bytes], secret: bytes | None) -> None:
        if self.auth == "fleet":
            assert secret is not None
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
                (time.time(), encode_events(events, self.config.include_token_ids))
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
            try:
                ts, events = self.queue.get(timeout=0.02)
            except queue.Empty:
                if time.monotonic() - last_sent < heartbeat:
                    events = None
                else:
                    ts, events = time.time(), []  # "still here, nothing changed"
            if events is not None:
                self._send(encode_batch(ts, events))
                last_sent = time.monotonic()
            if self.replay is not None and dict(poller.poll(0)):
                self._serve_replay()

    def _send(self, payload: bytes) -> None:
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        try:
            self.pub.send_multipart([self.topic, struct.pack(">q", seq), payload], zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1

    def _serve_replay(self) -> None:
        assert self.replay is not None  # only called when replay is configured
        ident, *frames = self.replay.recv_multipart()
        try:
            (start,) = struct.unpack(">q", frames[-1])
        except (struct.error, IndexError):
            start = 0
        for seq, payload in list(self.buffer):
            if seq >= start:
                self.replay.send_multipart([ident, b"", struct.pack(">q", seq), payload])
        self.replay.send_multipart([ident, b"", END_SEQ, b""])

    def shutdown(self) -> None:
        self._stop.set()
        self.thread.join(2)
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
