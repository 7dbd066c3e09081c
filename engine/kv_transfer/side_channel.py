"""The connector's side channel: msgpack over ZeroMQ, never pickle.

A producer runs a ROUTER socket on ``kv_port``. Requests are one msgpack map
(``{"op": ...}``); replies are a msgpack map, optionally followed by raw byte
frames (block bytes for the ZMQ connector). Ops:

* ``handshake`` -> engine id, instance id, compatibility factors, KV layout
  and, for NIXL, the agent metadata.
* ``read`` (ZMQ connector) -> the bytes of held blocks of one request.
* ``release`` -> the consumer is done with (or gave up on) a request's blocks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import msgpack
import zmq

logger = logging.getLogger(__name__)

# A handler returns (reply, extra frames), or None for one-way messages (no reply).
Handler = Callable[[dict[str, Any]], tuple[dict[str, Any], list[Any]] | None]


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes | memoryview) -> dict[str, Any]:
    obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
    if not isinstance(obj, dict):
        raise ValueError("side-channel message is not a map")
    return obj


class SideChannelServer:
    """Serves side-channel requests on a thread until ``close()``."""

    def __init__(self, host: str, port: int, handlers: dict[str, Handler]) -> None:
        self.handlers = handlers
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            self.sock.bind(f"tcp://{host}:{port}")
        except zmq.ZMQError as e:
            self.sock.close()
            raise ValueError(
                f"cannot bind the KV side channel on {host}:{port} ({e}); choose another "
                "kv_transfer_config.kv_port"
            ) from None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="kv-side-channel", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not dict(poller.poll(50)):
                continue
            try:
                ident, *frames = self.sock.recv_multipart(copy=False)
                request = unpack(frames[-1].buffer)
                handler = self.handlers.get(str(request.get("op")))
                if handler is None:
                    reply, extra = {"ok": False, "error": f"unknown op {request.get('op')!r}"}, []
                else:
                    answer = handler(request)
                    if answer is None:
                        continue
                    reply, extra = answer
            except Exception as e:  # a bad peer must never take the engine down
                logger.warning("bad side-channel request: %s", e)
                reply, extra = {"ok": False, "error": str(e)}, []
                if "ident" not in locals():
                    continue
            try:
                self.sock.send_multipart([ident, pack(reply), *extra], copy=False)
            except zmq.ZMQError as e:
                logger.warning("side-channel reply failed: %s", e)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2)
        self.sock.close(0)


class SideChannelClient:
    """Request/reply to producers' side channels with a deadline on every call.

    Not thread-safe: one client per thread. A peer that does not answer in
    time gets its socket dropped (queued requests discarded) and a fresh one
    next time, so a dead or restarted peer never wedges later calls.
    """

    def __init__(self) -> None:
        self.ctx = zmq.Context.instance()
        self.socks: dict[tuple[str, int], zmq.Socket] = {}

    def _sock(self, host: str, port: int) -> zmq.Socket:
        key = (host, port)
        if key not in self.socks:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://{host}:{port}")
            self.socks[key] = s
        return self.socks[key]

    def drop(self, host: str, port: int) -> None:
        sock = self.socks.pop((host, port), None)
        if sock is not None:
            sock.close(0)

    def call(
        self, host: str, port: int, request: dict[str, Any], timeout: float
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        sock = self._sock(host, port)
        try:
            sock.send_multipart([pack(request)])
            if not sock.poll(int(timeout * 1000), zmq.POLLIN):
                raise TimeoutError(f"no answer from {host}:{port} within {timeout:.1f}s")
            head, *extra = sock.recv_multipart(copy=False)
        except (TimeoutError, zmq.ZMQError):
            self.drop(host, port)
            raise
        reply = unpack(head.buffer)
        if not reply.get("ok", False):
            raise RuntimeError(str(reply.get("error", "request failed")))
        return reply, extra

    def send_nowait(self, host: str, port: int, request: dict[str, Any]) -> None:
        """One-way message (e.g. a release; the server does not reply); never blocks."""
        try:
            self._sock(host, port).send_multipart([pack(request)], zmq.NOBLOCK)
        except zmq.ZMQError:
            self.drop(host, port)

    def close(self) -> None:
        for key in list(self.socks):
            self.drop(*key)
