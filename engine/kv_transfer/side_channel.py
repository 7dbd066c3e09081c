"""The connector's side channel: authenticated msgpack over ZeroMQ, never pickle.

A producer runs a ROUTER socket on ``kv_port``, bound to one address (never
``0.0.0.0``). Nothing is served before a peer proves it holds the fleet secret:

1. ``hello`` (client -> server): protocol version, the client's compat hash,
   its engine and instance ids and a nonce. The server refuses a different
   ``version`` or ``compat_hash`` naming the field, else answers with its own
   nonce, a session id and a proof (HMAC under the ``kv-side-channel`` key of
   the fleet secret over both nonces and the client's hello).
2. ``auth`` (client -> server): the client's proof over the same parts. The
   session is now open; the reply is the ``handshake`` handler's answer
   (layout and, for NIXL, the agent metadata), so NIXL metadata is only ever
   sent to an authenticated peer.

Every later message is ``[body, mac]``: ``body`` carries the session id and a
strictly increasing ``seq`` (a replayed or reordered message is dropped), and
``mac`` is an HMAC of it under the session key (derived from the secret and
both nonces). Replies are MACed the same way, so neither side can be fed
forged answers. Ops after ``auth``:

* ``claim`` (NIXL) / ``read`` (ZMQ: the reply carries the block bytes) - a
  lease's blocks, checked against the lease;
* ``confirm`` - after a transfer: was the lease held for all of it? (it is
  released by the same answer);
* ``release`` - the consumer gave up on a lease (one-way).

Handlers get the request and the authenticated :class:`Peer`.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

from ..config import security

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 3
PURPOSE = "kv-side-channel"
# Bounds on the server's session table (authenticated) and on half-open hellos.
MAX_SESSIONS = 1024
MAX_PENDING = 256
SESSION_IDLE_SECONDS = 600.0


class AuthError(RuntimeError):
    """A side-channel peer failed authentication (wrong secret or a forged reply)."""


class Refused(RuntimeError):
    """An authenticated refusal from the producer (e.g. an ended lease): the session
    itself is fine."""


class IncompatibleHello(RuntimeError):
    """The producer refused the hello: another protocol version or compat hash."""

    def __init__(self, message: str, compat: Any = None) -> None:
        super().__init__(message)
        self.compat = compat if isinstance(compat, dict) else None


@dataclass
class Peer:
    """An authenticated client of the side channel (a consumer engine instance)."""

    engine_id: str
    instance_id: str

    @property
    def identity(self) -> str:
        return f"{self.engine_id}/{self.instance_id}"


@dataclass
class _Session:
    key: bytes
    peer: Peer
    seq: int = 0
    last_used: float = 0.0


# A handler returns (reply, extra frames), or None for one-way messages (no reply).
Handler = Callable[[dict[str, Any], Peer], tuple[dict[str, Any], list[Any]] | None]


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes | memoryview) -> dict[str, Any]:
    obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
    if not isinstance(obj, dict):
        raise ValueError("side-channel message is not a map")
    return obj


def _mac(key: bytes, label: bytes, body: bytes) -> bytes:
    return hmac.new(key, label + body, hashlib.sha256).digest()


def _session_key(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return security.prove(secret, PURPOSE, b"session", client_nonce, server_nonce)


class SideChannelServer:
    """Serves authenticated side-channel requests on a thread until ``close()``."""

    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        compat: dict[str, Any],
        compat_hash: str,
        handlers: dict[str, Handler],
    ) -> None:
        if host in ("0.0.0.0", "::", "*", ""):
            raise ValueError(
                "the KV side channel binds one address, never all of them; set "
                "kv_transfer_config.kv_ip (or $PDFLEET_KV_BIND_IP) to this host's address"
            )
        self.secret = secret
        self.compat = compat
        self.compat_hash = compat_hash
        self.handlers = handlers
        self.sessions: OrderedDict[bytes, _Session] = OrderedDict()
        self.pending: OrderedDict[bytes, tuple[bytes, bytes, bytes]] = OrderedDict()
        self.num_rejected = 0
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A predecessor's socket on this port may still be closing: retry briefly.
        deadline = time.monotonic() + 3.0
        while True:
            try:
                self.sock.bind(f"tcp://{host}:{port}")
                break
            except zmq.ZMQError as e:
                if e.errno == zmq.EADDRINUSE and time.monotonic() < deadline:
                    time.sleep(0.05)
                    continue
                error = e
            self.sock.close()
            raise ValueError(
                f"cannot bind the KV side channel on {host}:{port} ({error}); choose another "
                "kv_transfer_config.kv_port, or a kv_ip of this host"
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
                ident, *frames = self.sock.recv_multipart()
            except zmq.ZMQError as e:
                logger.warning("side-channel receive failed: %s", e)
                continue
            try:
                answer = self._handle(frames)
            except Exception as e:  # a bad peer must never take the engine down
                logger.warning("bad side-channel request: %s", e)
                self.num_rejected += 1
                answer = [pack({"ok": False, "error": "bad request"})]
            if answer is None:
                continue
            try:
                self.sock.send_multipart([ident, *answer], copy=False)
            except zmq.ZMQError as e:
                logger.warning("side-channel reply failed: %s", e)

    def _refuse(self, error: str) -> list[Any]:
        self.num_rejected += 1
        return [pack({"ok": False, "error": error})]

    def _handle(self, frames: list[bytes]) -> list[Any] | None:
        if len(frames) == 1:
            request = unpack(frames[0])
            op = request.get("op")
            if op == "hello":
                return self._hello(request)
            if op == "auth":
                return self._auth(request)
            return self._refuse("not authenticated: send hello and auth first")
        if len(frames) != 2:
            return self._refuse("malformed message")
        body, mac = frames
        request = unpack(body)
        sid = request.get("session")
        session = self.sessions.get(sid) if isinstance(sid, bytes) else None
        if session is None:
            return self._refuse("unknown session: authenticate again")
        if not hmac.compare_digest(mac, _mac(session.key, b"req", body)):
            return self._refuse("bad message authentication code")
        seq = request.get("seq")
        if not isinstance(seq, int) or seq <= session.seq:
            return self._refuse("replayed or reordered message")
        session.seq = seq
        session.last_used = time.monotonic()
        self.sessions.move_to_end(sid)
        handler = self.handlers.get(str(request.get("op")))
        if handler is None:
            head, extra = {"ok": False, "error": f"unknown op {request.get('op')!r}"}, []
        else:
            answer = handler(request, session.peer)
            if answer is None:
                return None
            head, extra = answer
        head["seq"] = seq
        packed = pack(head)
        return [packed, _mac(session.key, b"rep", packed), *extra]

    def _hello(self, request: dict[str, Any]) -> list[Any]:
        version = request.get("version")
        if version != PROTOCOL_VERSION:
            return self._refuse(
                f"version: side-channel protocol {version!r} is not this engine's "
                f"{PROTOCOL_VERSION}; run the same pdfleet version on prefill and decode"
            )
        theirs = request.get("compat_hash")
        if theirs != self.compat_hash:
            # The factors (not secret) let the consumer name the field that differs.
            self.num_rejected += 1
            error = (
                f"compat_hash: {theirs!r} differs from this prefill engine's "
                f"{self.compat_hash!r} (model, dtype, KV layout or pdfleet version differ)"
            )
            return [pack({"ok": False, "error": error, "compat": self.compat})]
        nonce = request.get("nonce")
        if not isinstance(nonce, bytes) or len(nonce) < 16:
            return self._refuse("nonce: missing or too short")
        sid = secrets.token_bytes(16)
        server_nonce = security.challenge()
        hello = pack({k: request.get(k) for k in ("engine_id", "instance_id", "compat_hash")})
        self.pending[sid] = (nonce, server_nonce, hello)
        while len(self.pending) > MAX_PENDING:
            self.pending.popitem(last=False)
        proof = security.prove(self.secret, PURPOSE, b"server", nonce, server_nonce, hello)
        return [pack({"ok": True, "session": sid, "nonce": server_nonce, "proof": proof})]

    def _auth(self, request: dict[str, Any]) -> list[Any]:
        sid = request.get("session")
        pending = self.pending.pop(sid, None) if isinstance(sid, bytes) else None
        if pending is None:
            return self._refuse("unknown session: send hello first")
        nonce, server_nonce, hello = pending
        proof = request.get("proof")
        if not isinstance(proof, bytes) or not security.proof_ok(
            self.secret, PURPOSE, proof, b"client", server_nonce, nonce, hello
        ):
            logger.warning("KV side channel: a peer failed authentication")
            return self._refuse("authentication failed: this peer does not hold the fleet secret")
        who = unpack(hello)
        peer = Peer(str(who.get("engine_id")), str(who.get("instance_id")))
        key = _session_key(self.secret, nonce, server_nonce)
        self.sessions[sid] = _Session(key, peer, last_used=time.monotonic())
        self._trim_sessions()
        handler = self.handlers.get("handshake")
        head, extra = handler(request, peer) if handler else ({"ok": True}, [])
        packed = pack(head)
        return [packed, _mac(key, b"rep", packed), *extra]

    def _trim_sessions(self) -> None:
        cutoff = time.monotonic() - SESSION_IDLE_SECONDS
        while self.sessions and (
            len(self.sessions) > MAX_SESSIONS
            or next(iter(self.sessions.values())).last_used < cutoff
        ):
            self.sessions.popitem(last=False)

    def close(self) -> None:
        self._stop.set()
        self.thread.join(2)
        self.sock.close(0)


@dataclass
class _ClientSession:
    sid: bytes
    key: bytes
    seq: int = 0


class SideChannelClient:
    """Authenticated request/reply to producers' side channels, a deadline on every call.

    Not thread-safe: one client per thread. A peer that does not answer in
    time gets its socket and session dropped (queued requests discarded) and a
    fresh one next time, so a dead or restarted peer never wedges later calls.
    """

    def __init__(self, secret: bytes, engine_id: str, instance_id: str, compat_hash: str) -> None:
        self.secret = secret
        self.hello = {
            "engine_id": engine_id,
            "instance_id": instance_id,
            "compat_hash": compat_hash,
        }
        self.ctx = zmq.Context.instance()
        self.socks: dict[tuple[str, int], zmq.Socket] = {}
        self.sessions: dict[tuple[str, int], _ClientSession] = {}

    def _sock(self, host: str, port: int) -> zmq.Socket:
        key = (host, port)
        if key not in self.socks:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(f"tcp://{host}:{port}")
            self.socks[key] = s
        return self.socks[key]

    def drop(self, host: str, port: int) -> None:
        self.sessions.pop((host, port), None)
        sock = self.socks.pop((host, port), None)
        if sock is not None:
            sock.close(0)

    def _exchange(
        self, host: str, port: int, frames: list[bytes], timeout: float
    ) -> list[zmq.Frame]:
        sock = self._sock(host, port)
        try:
            if frames:
                sock.send_multipart(frames)
            if not sock.poll(int(timeout * 1000), zmq.POLLIN):
                raise TimeoutError(f"no answer from {host}:{port} within {timeout:.1f}s")
            return sock.recv_multipart(copy=False)
        except (TimeoutError, zmq.ZMQError):
            self.drop(host, port)
            raise

    def connect(
        self, host: str, port: int, timeout: float
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        """Authenticate to ``host:port`` (mutually); the producer's handshake reply."""
        deadline = time.monotonic() + timeout
        self.drop(host, port)
        nonce = security.challenge()
        head, *_ = self._exchange(
            host,
            port,
            [pack({"op": "hello", "version": PROTOCOL_VERSION, "nonce": nonce, **self.hello})],
            timeout,
        )
        reply = unpack(head.buffer)
        if not reply.get("ok", False):
            error = str(reply.get("error", "hello refused"))
            if error.startswith(("version:", "compat_hash:")):
                raise IncompatibleHello(error, reply.get("compat"))
            raise RuntimeError(error)
        sid, server_nonce, proof = reply.get("session"), reply.get("nonce"), reply.get("proof")
        hello = pack(self.hello)
        if not (
            isinstance(sid, bytes)
            and isinstance(server_nonce, bytes)
            and isinstance(proof, bytes)
            and security.proof_ok(
                self.secret, PURPOSE, proof, b"server", nonce, server_nonce, hello
            )
        ):
            self.drop(host, port)
            raise AuthError(f"the peer at {host}:{port} does not hold the fleet secret")
        mine = security.prove(self.secret, PURPOSE, b"client", server_nonce, nonce, hello)
        frames = self._exchange(
            host,
            port,
            [pack({"op": "auth", "session": sid, "proof": mine})],
            max(0.05, deadline - time.monotonic()),
        )
        key = _session_key(self.secret, nonce, server_nonce)
        if len(frames) < 2:
            self.drop(host, port)
            raise RuntimeError(str(unpack(frames[0].buffer).get("error", "auth refused")))
        head, mac, *extra = frames
        if not hmac.compare_digest(mac.bytes, _mac(key, b"rep", head.bytes)):
            self.drop(host, port)
            raise AuthError(f"a forged handshake reply from {host}:{port}")
        self.sessions[(host, port)] = _ClientSession(sid, key)
        reply = unpack(head.buffer)
        if not reply.get("ok", False):
            raise RuntimeError(str(reply.get("error", "handshake refused")))
        return reply, extra

    def _signed(self, host: str, port: int, request: dict[str, Any]) -> tuple[list[bytes], int]:
        session = self.sessions.get((host, port))
        if session is None:
            raise RuntimeError(f"no authenticated session with {host}:{port}")
        session.seq += 1
        body = pack({**request, "session": session.sid, "seq": session.seq})
        return [body, _mac(session.key, b"req", body)], session.seq

    def call(
        self, host: str, port: int, request: dict[str, Any], timeout: float
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        frames, seq = self._signed(host, port, request)
        key = self.sessions[(host, port)].key
        deadline = time.monotonic() + timeout
        while True:
            got = self._exchange(host, port, frames, max(0.01, deadline - time.monotonic()))
            frames = []  # sent once; later rounds only receive
            if len(got) < 2:
                reply = unpack(got[0].buffer)
                self.drop(host, port)
                raise RuntimeError(str(reply.get("error", "request refused")))
            head, mac, *extra = got
            if not hmac.compare_digest(mac.bytes, _mac(key, b"rep", head.bytes)):
                self.drop(host, port)
                raise AuthError(f"a forged reply from {host}:{port}")
            reply = unpack(head.buffer)
            if reply.get("seq") == seq:
                break
            # A late answer to an earlier call that timed out: skip it.
        if not reply.get("ok", False):
            raise Refused(str(reply.get("error", "request failed")))
        return reply, extra

    def send_nowait(self, host: str, port: int, request: dict[str, Any]) -> None:
        """One-way message (e.g. a release; the server does not reply); never blocks."""
        try:
            frames, _ = self._signed(host, port, request)
            self._sock(host, port).send_multipart(frames, zmq.NOBLOCK)
        except (RuntimeError, zmq.ZMQError):
            self.drop(host, port)

    def close(self) -> None:
        for key in list(self.socks):
            self.drop(*key)
