"""Publishing prefix-cache events (block stored / removed) over ZeroMQ.

External routers follow which prefixes each engine caches from these events
(as with vLLM's ``--kv-events-config``). Each message is multipart
``[topic, sequence (8 bytes, big-endian), payload]`` where the payload is a
msgpack array ``[timestamp, [event, ...], data_parallel_rank]`` and an event is
``["BlockStored", [hash], parent_hash | None, token_ids, block_size, None,
"GPU"]`` or ``["BlockRemoved", [hash], "GPU"]`` (hashes are raw bytes). A
replay socket (ROUTER) answers a sequence number with every buffered batch
from there on, then an empty payload. Publishing runs on its own thread
behind a bounded queue, so a slow subscriber never blocks the engine.
"""

from __future__ import annotations

import collections
import logging
import queue
import struct
import threading
import time

import msgpack
import zmq

from .config import KVEventsConfig
from .core.block_pool import KVCacheEvent

logger = logging.getLogger(__name__)


def encode_event(e: KVCacheEvent) -> list:
    if e.kind == "stored":
        return [
            "BlockStored",
            [e.block_hash],
            e.parent_hash,
            list(e.token_ids),
            e.block_size,
            None,
            "GPU",
        ]
    return ["BlockRemoved", [e.block_hash], "GPU"]


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig) -> None:
        self.config = config
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
        try:
            self.pub.bind(config.endpoint)
            if config.replay_endpoint:
                self.replay = ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.LINGER, 0)
                self.replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self.pub.close(0)
            raise ValueError(f"kv_events_config: cannot bind {config.endpoint}: {e}") from None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self.thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events (called on the engine thread; never blocks)."""
        if not events:
            return
        try:
            self.queue.put_nowait((time.time(), [encode_event(e) for e in events]))
        except queue.Full:
            self.dropped += 1

    def _run(self) -> None:
        poller = zmq.Poller()
        if self.replay is not None:
            poller.register(self.replay, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                ts, events = self.queue.get(timeout=0.02)
                payload = msgpack.packb([ts, events, 0], use_bin_type=True)
                seq = self.seq
                self.seq += 1
                self.buffer.append((seq, payload))
                try:
                    self.pub.send_multipart(
                        [self.topic, struct.pack(">q", seq), payload], zmq.NOBLOCK
                    )
                except zmq.Again:
                    self.dropped += 1
            except queue.Empty:
                pass
            if self.replay is not None and dict(poller.poll(0)):
                self._serve_replay()

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
        self.replay.send_multipart([ident, b"", struct.pack(">q", -1), b""])

    def shutdown(self) -> None:
        self._stop.set()
        self.thread.join(2)
        self.pub.close(0)
        if self.replay is not None:
            self.replay.close(0)
