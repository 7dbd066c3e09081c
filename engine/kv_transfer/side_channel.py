"""The connector's side channel: authenticated msgpack over ZeroMQ, never pickle.

A producer runs a ROUTER socket on ``kv_port``, bound to one address (never
``0.0.0.0``). Nothing is served before a peer proves it holds the fleet secret:

1. ``hello`` (client -> server): protocol version, the client's compat hash,
   its engine and instance ids, its identity token (when the fleet has
   identities, ``engine/contracts/identity.py``) and a nonce. The server refuses
   a different ``version`` or ``compat_hash`` naming the field, else answers
   with its own nonce, a session id, a *cookie* and a proof (HMAC under the
   ``kv-side-channel`` key of the fleet secret over both nonces and the
   client's hello), plus its own token and a signature of the same parts
   under its identity key. The server keeps nothing: the cookie (an HMAC
   under a key only this server process knows, over the session id, which
   starts with a timestamp, both nonces and the hello) lets it recognise its
   own answer in step 2, as SYN cookies do. So no number of hellos can push a
   real peer's half-open handshake out of a table: there is none.
2. ``auth`` (client -> server): the hello again, the server's values, and the
   client's proof over the same parts (and its identity signature). The
   server checks the cookie (and that it is under ``COOKIE_SECONDS`` old),
   the proof and the identity; the session is now open; the reply is the
   ``handshake`` handler's answer (layout and, for NIXL, the agent
   metadata), so NIXL metadata is only ever sent to an authenticated peer.

The socket itself is a ZeroMQ CURVE server whose key pair derives from the
fleet secret (:func:`curve_keys`): a peer that does not hold the secret
cannot complete ZeroMQ's handshake, so it cannot send a single message (a
ZeroMQ multipart message is buffered whole before the application sees any
of it, so a size check in the application alone could not bound it), and
the traffic (lease ids, block bytes of the ZMQ transport) is encrypted.

Before authentication a message is one frame of at most ``MAX_HELLO_BYTES``;
every message is at most ``MAX_MESSAGE_BYTES`` per frame (refused by ZeroMQ
before it is buffered whole) and ``MAX_FRAMES`` frames, read frame by frame.
A peer without the fleet secret can make the server hold nothing. One with
it can still send a message of many ``MAX_MESSAGE_BYTES`` frames, which
ZeroMQ buffers whole before the first frame is read (ZeroMQ has no byte
bound per message or per connection): for that the fleet secret is the
boundary.

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

Handlers get the request and the authenticated :class:`Peer`. The messages
themselves (hello, its reply, auth, refusals, the envelope) and their bounds
are ``engine/contracts/kv_side_channel.py``.

Identity tokens are short-lived and renewed (``identity_client.py``). A
session lasts no longer than the tokens it was opened with: the server
refuses a request on a session whose client token has expired, and a client
re-authenticates (a new hello and auth, with its current token) before either
side's token from the session's handshake expires, so a renewal never fails a
transfer. Leases bind to the subject, which a renewal keeps.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import math
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

from ..contracts import identity as ident
from ..contracts import security
from ..contracts.kv_side_channel import (
    MAX_FRAMES,
    MAX_HELLO_BYTES,
    MAX_MESSAGE_BYTES,
    PURPOSE,
    Accepted,
    Auth,
    Envelope,
    Hello,
    HelloFields,
    HelloReply,
    Refusal,
    mac,
    pack,
    session_key,
    transcript,
    unpack,
)

logger = logging.getLogger(__name__)

# Bound on the server's session table (authenticated peers only).
MAX_SESSIONS = 1024
SESSION_IDLE_SECONDS = 600.0
# How long a hello's cookie stays good for its auth (seconds).
COOKIE_SECONDS = 30.0
# Messages ZeroMQ queues per peer before it stops reading that peer's socket.
RCVHWM = 16
# A client re-authenticates this long (seconds; at most half the time left at its
# handshake) before the soonest expiry of the identity tokens the session rests on.
RENEW_MARGIN_SECONDS = 60.0


class AuthError(RuntimeError):
    """A side-channel peer failed authentication (wrong secret or a forged reply)."""


class Refused(RuntimeError):
    """An authenticated refusal from the producer (e.g. an ended lease): the session
    itself is fine. ``code`` names the kind of refusal where the caller acts on it."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class IncompatibleHello(RuntimeError):
    """The producer refused the hello: another protocol version or compat hash."""

    def __init__(self, message: str, compat: Any = None) -> None:
        super().__init__(message)
        self.compat = compat if isinstance(compat, dict) else None


@dataclass
class Peer:
    """An authenticated client of the side channel (a consumer engine instance).

    With fleet identities, ``claims`` are what the operator vouched for (the
    peer proved it holds the key the token names); without, only the fleet
    secret was proven and the ids are the peer's own word."""

    engine_id: str
    instance_id: str
    claims: ident.IdentityClaims | None = None
    address: str = ""  # the TCP peer address the session was opened from

    @property
    def identity(self) -> str:
        """What a lease binds to: the vouched subject when there is one; else the
        stated ids and the address they were stated from (another holder of the
        fleet secret may state the same ids, but not from the same address)."""
        if self.claims is not None:
            return f"{self.claims.subject}#{self.instance_id}"
        return f"{self.engine_id}/{self.instance_id}@{self.address}"

    @property
    def may_consume(self) -> bool:
        """Whether this peer may claim, read, confirm or release leases."""
        return self.claims is None or self.claims.consumes


@dataclass
class _Session:
    key: bytes
    peer: Peer
    seq: int = 0
    last_used: float = 0.0


# A handler returns (reply, extra frames), or None for one-way messages (no reply).
Handler = Callable[[dict[str, Any], Peer], tuple[dict[str, Any], list[Any]] | None]


def curve_keys(secret: bytes) -> tuple[bytes, bytes]:
    """(public, secret) Z85 CURVE keys of every side-channel server of a fleet."""
    private = z85.encode(security.derive_key(secret, "kv-side-channel-curve"))
    return zmq.curve_public(private), private


def secure_client(sock: zmq.Socket[bytes], secret: bytes) -> None:
    """Make ``sock`` a CURVE client of the fleet's side channels (a throwaway key
    pair of its own: knowing the server's public key is what takes the secret)."""
    public, private = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, curve_keys(secret)[0])
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, private)


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
        identity: ident.FleetIdentity | None = None,
    ) -> None:
        if host in ("0.0.0.0", "::", "*", ""):  # noqa: S104 (the address refused here)
            raise ValueError(
                "the KV side channel binds one address, never all of them; set "
                "kv_transfer_config.kv_ip (or $PDFLEET_KV_BIND_IP) to this host's address"
            )
        self.secret = secret
        self.compat = compat
        self.compat_hash = compat_hash
        self.handlers = handlers
        self.identity = identity or ident.FleetIdentity()
        self.sessions: OrderedDict[bytes, _Session] = OrderedDict()
        # Keys the hello cookies; known to this process only, so a restarted
        # server (or another one) never takes an old cookie.
        self._cookie_key = secrets.token_bytes(32)
        self.num_rejected = 0
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.RCVHWM, RCVHWM)
        public, private = curve_keys(secret)
        self.sock.setsockopt(zmq.CURVE_SERVER, 1)
        self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        self.sock.setsockopt(zmq.CURVE_SECRETKEY, private)
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
                peer_id, frames, address = self._receive()
            except zmq.ZMQError as e:
                logger.warning("side-channel receive failed: %s", e)
                continue
            if frames is None:
                self.num_rejected += 1
                continue  # oversized: dropped unread, never answered
            try:
                answer = self._handle(frames, address)
            except Exception as e:  # a bad peer must never take the engine down
                logger.warning("bad side-channel request: %s", e)
                self.num_rejected += 1
                answer = [Refusal("bad request").encode()]
            if answer is None:
                continue
            try:
                self.sock.send_multipart([peer_id, *answer], copy=False)
            except zmq.ZMQError as e:
                logger.warning("side-channel reply failed: %s", e)

    def _receive(self) -> tuple[bytes, list[bytes] | None, str]:
        """One message, frame by frame: (the peer's routing id, its frames, the peer's
        TCP address); frames is None when there are more than MAX_FRAMES (the rest
        are read and dropped, so they are never held together)."""
        head = self.sock.recv(copy=False)
        address = str(head.get("Peer-Address") or "")
        frames: list[bytes] | None = []
        while self.sock.getsockopt(zmq.RCVMORE):
            frame = self.sock.recv()
            if frames is not None and len(frames) < MAX_FRAMES:
                frames.append(frame)
            else:
                frames = None
        return head.bytes, frames, address

    def _refuse(self, error: str) -> list[Any]:
        self.num_rejected += 1
        return [Refusal(error).encode()]

    def _handle(self, frames: list[bytes], address: str = "") -> list[Any] | None:
        if len(frames) == 1:
            if len(frames[0]) > MAX_HELLO_BYTES:
                return self._refuse(
                    f"not authenticated: a message before auth is at most {MAX_HELLO_BYTES} bytes"
                )
            try:
                request = unpack(frames[0], MAX_HELLO_BYTES)
            except ValueError as e:
                return self._refuse(f"not authenticated: {e}")
            op = request.get("op")
            try:
                if op == "hello":
                    # Its refusal names the field (``version:`` first), unprefixed:
                    # the client tells an incompatible peer by it.
                    return self._hello(Hello.decode(request))
                if op == "auth":
                    return self._auth(Auth.decode(request), address)
            except ValueError as e:
                return self._refuse(str(e) if op == "hello" else f"not authenticated: auth: {e}")
            return self._refuse("not authenticated: send hello and auth first")
        if len(frames) != 2:
            return self._refuse("malformed message")
        body, code = frames
        try:
            request = unpack(body)
            envelope = Envelope.of(request)
        except ValueError as e:
            return self._refuse(f"malformed message: {e}")
        sid = envelope.session
        if sid not in self.sessions:
            return self._refuse("unknown session: authenticate again")
        session = self.sessions[sid]
        if session.peer.address != address:
            return self._refuse("the session was opened from another address")
        if not hmac.compare_digest(code, mac(session.key, b"req", body)):
            return self._refuse("bad message authentication code")
        claims = session.peer.claims
        if claims is not None and time.time() > claims.expires:
            # The session rested on that token: the peer authenticates again with
            # its renewed one (an expired identity may do nothing more).
            del self.sessions[sid]
            return self._refuse(
                "identity: the peer's identity token has expired: authenticate again"
            )
        seq = envelope.seq
        if seq <= session.seq:
            return self._refuse("replayed or reordered message")
        session.seq = seq
        session.last_used = time.monotonic()
        self.sessions.move_to_end(sid)
        handler = self.handlers.get(str(request.get("op")))
        head: dict[str, Any]
        extra: list[Any]
        if handler is None:
            head, extra = Refusal(f"unknown op {request.get('op')!r}").to_wire(), []
        else:
            answer = handler(request, session.peer)
            if answer is None:
                return None
            head, extra = answer
        head["seq"] = seq
        packed = pack(head)
        return [packed, mac(session.key, b"rep", packed), *extra]

    def _hello(self, request: Hello) -> list[Any]:
        theirs = request.fields.compat_hash
        if theirs != self.compat_hash:
            # The factors (not secret) let the consumer name the field that differs.
            self.num_rejected += 1
            error = (
                f"compat_hash: {theirs!r} differs from this prefill engine's "
                f"{self.compat_hash!r} (model, dtype, KV layout or pdfleet version differ)"
            )
            return [Refusal(error, compat=self.compat).encode()]
        nonce = request.nonce
        # Stateless: the session id starts with the time; the cookie lets auth
        # prove these values came from this server (nothing is stored).
        sid = int(time.time() * 1000).to_bytes(8, "big") + secrets.token_bytes(8)
        server_nonce = security.challenge()
        hello = request.fields.packed()
        cookie = self._cookie(sid, nonce, server_nonce, hello)
        proof = security.prove(self.secret, PURPOSE, b"server", nonce, server_nonce, hello)
        own = self.identity.own
        reply = HelloReply(sid, server_nonce, cookie, proof)
        if own is not None:
            sig = own.sign(transcript(b"server", nonce, server_nonce, hello))
            reply = HelloReply(sid, server_nonce, cookie, proof, own.token, sig)
        return [reply.encode()]

    def _cookie(self, sid: bytes, nonce: bytes, server_nonce: bytes, hello: bytes) -> bytes:
        mac = hmac.new(self._cookie_key, digestmod=hashlib.sha256)
        for part in (sid, nonce, server_nonce, hello):
            mac.update(len(part).to_bytes(4, "big"))
            mac.update(part)
        return mac.digest()

    def _auth(self, request: Auth, address: str = "") -> list[Any]:
        sid, nonce, server_nonce = request.session, request.client_nonce, request.nonce
        hello, cookie = request.hello, request.cookie
        age = time.time() - int.from_bytes(sid[:8], "big") / 1000
        if not hmac.compare_digest(cookie, self._cookie(sid, nonce, server_nonce, hello)):
            return self._refuse("unknown session: send hello first")
        if not 0 <= age <= COOKIE_SECONDS:
            return self._refuse("the hello is too old: send hello again")
        if sid in self.sessions:
            return self._refuse("replayed auth")
        if not security.proof_ok(
            self.secret, PURPOSE, request.proof, b"client", server_nonce, nonce, hello
        ):
            logger.warning("KV side channel: a peer failed authentication")
            return self._refuse("authentication failed: this peer does not hold the fleet secret")
        try:
            who = HelloFields.unpacked(hello)
        except ValueError as e:  # the cookie covers it, so this server made it: never
            return self._refuse(f"malformed hello: {e}")
        claims = None
        if self.identity.required:
            if self.identity.authority is None:
                raise RuntimeError("broken invariant: self.identity.authority is not None")
            try:
                claims = ident.verify_token(self.identity.authority, who.identity)
            except ident.InvalidIdentity as e:
                logger.warning("KV side channel: a peer's identity was refused: %s", e)
                return self._refuse(f"identity: {e}")
            if not ident.signature_ok(
                claims.public_key,
                request.identity_sig,
                transcript(b"client", server_nonce, nonce, hello),
            ):
                logger.warning(
                    "KV side channel: a peer presented %s's identity without its key",
                    claims.subject,
                )
                return self._refuse("identity: the peer does not hold the identity's key")
        peer = Peer(who.engine_id, who.instance_id, claims, address)
        key = session_key(self.secret, nonce, server_nonce)
        self.sessions[sid] = _Session(key, peer, last_used=time.monotonic())
        self._trim_sessions()
        handler = self.handlers.get("handshake")
        # auth always answers: a missing handshake handler, or one with nothing
        # to add (None), confirms the session with a bare ok.
        # (It reads nothing of the request: the auth's fields are the channel's.)
        answer = handler({"op": "handshake"}, peer) if handler else None
        head, extra = answer if answer is not None else (Accepted().to_wire(), [])
        packed = pack(head)
        return [packed, mac(key, b"rep", packed), *extra]

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
    renew_at: float = math.inf  # Unix seconds: re-authenticate from then on


class SideChannelClient:
    """Authenticated request/reply to producers' side channels, a deadline on every call.

    Not thread-safe: one client per thread. A peer that does not answer in
    time gets its socket and session dropped (queued requests discarded) and a
    fresh one next time, so a dead or restarted peer never wedges later calls.
    """

    def __init__(
        self,
        secret: bytes,
        engine_id: str,
        instance_id: str,
        compat_hash: str,
        identity: ident.FleetIdentity | None = None,
    ) -> None:
        self.secret = secret
        self.identity = identity or ident.FleetIdentity()
        # Who this engine says it is; ``identity``, its current token, is set at
        # each connect.
        self.hello = HelloFields(engine_id, instance_id, compat_hash)
        # The vouched identity of each authenticated producer (fleets with identities).
        self.peers: dict[tuple[str, int], ident.IdentityClaims] = {}
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.socks: dict[tuple[str, int], zmq.Socket[bytes]] = {}
        self.sessions: dict[tuple[str, int], _ClientSession] = {}

    def _sock(self, host: str, port: int) -> zmq.Socket[bytes]:
        key = (host, port)
        if key not in self.socks:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            secure_client(s, self.secret)
            s.connect(f"tcp://{host}:{port}")
            self.socks[key] = s
        return self.socks[key]

    def drop(self, host: str, port: int) -> None:
        self.sessions.pop((host, port), None)
        self.peers.pop((host, port), None)
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
        own = self.identity.own
        # The current token and its claims, read once: a renewal may swap them.
        own_token, own_claims = (own.token, own.claims) if own is not None else (None, None)
        self.hello = dataclasses.replace(self.hello, identity=own_token)
        nonce = security.challenge()
        head, *_ = self._exchange(host, port, [Hello(nonce, self.hello).encode()], timeout)
        reply = self._unpack(host, port, head.buffer)
        refusal = Refusal.of(reply, "hello refused")
        if refusal is not None:
            if refusal.error.startswith(("version:", "compat_hash:")):
                raise IncompatibleHello(refusal.error, refusal.compat)
            raise RuntimeError(refusal.error)
        hello = self.hello.packed()
        try:
            answer = HelloReply.decode(reply)
        except ValueError as e:
            self.drop(host, port)
            raise AuthError(f"a malformed hello reply from {host}:{port}: {e}") from None
        sid, server_nonce, cookie = answer.session, answer.nonce, answer.cookie
        if not security.proof_ok(
            self.secret, PURPOSE, answer.proof, b"server", nonce, server_nonce, hello
        ):
            self.drop(host, port)
            raise AuthError(f"the peer at {host}:{port} does not hold the fleet secret")
        claims = None
        if self.identity.required:
            if self.identity.authority is None:
                raise RuntimeError("broken invariant: self.identity.authority is not None")
            try:
                claims = ident.verify_token(self.identity.authority, answer.identity)
            except ident.InvalidIdentity as e:
                self.drop(host, port)
                raise AuthError(f"the peer at {host}:{port}: identity: {e}") from None
            if not ident.signature_ok(
                claims.public_key,
                answer.identity_sig,
                transcript(b"server", nonce, server_nonce, hello),
            ):
                self.drop(host, port)
                raise AuthError(
                    f"the peer at {host}:{port} presented {claims.subject}'s identity "
                    "without its key"
                )
        mine = security.prove(self.secret, PURPOSE, b"client", server_nonce, nonce, hello)
        sig = own.sign(transcript(b"client", server_nonce, nonce, hello)) if own else None
        auth = Auth(sid, nonce, server_nonce, hello, cookie, mine, sig)
        frames = self._exchange(host, port, [auth.encode()], max(0.05, deadline - time.monotonic()))
        key = session_key(self.secret, nonce, server_nonce)
        if len(frames) < 2:
            self.drop(host, port)
            refused = Refusal.of(self._unpack(host, port, frames[0].buffer), "auth refused")
            raise RuntimeError(refused.error if refused else "auth refused")
        head, code, *extra = frames
        if not hmac.compare_digest(code.bytes, mac(key, b"rep", head.bytes)):
            self.drop(host, port)
            raise AuthError(f"a forged handshake reply from {host}:{port}")
        self.sessions[(host, port)] = _ClientSession(
            sid, key, renew_at=_renew_at(own_claims, claims)
        )
        if claims is not None:
            self.peers[(host, port)] = claims
        reply = self._unpack(host, port, head.buffer)
        refusal = Refusal.of(reply, "handshake refused")
        if refusal is not None:
            raise RuntimeError(refusal.error)
        return reply, extra

    def _unpack(self, host: str, port: int, data: bytes | memoryview) -> dict[str, Any]:
        """A reply's map; a malformed one drops the session (AuthError: the peer
        is not speaking this protocol)."""
        try:
            return unpack(data)
        except ValueError as e:
            self.drop(host, port)
            raise AuthError(f"a malformed reply from {host}:{port}: {e}") from None

    def _signed(self, host: str, port: int, request: dict[str, Any]) -> tuple[list[bytes], int]:
        session = self.sessions.get((host, port))
        if session is None:
            raise RuntimeError(f"no authenticated session with {host}:{port}")
        session.seq += 1
        body = Envelope(session.sid, session.seq).seal(request)
        return [body, mac(session.key, b"req", body)], session.seq

    def _reauthenticate(self, host: str, port: int, timeout: float) -> None:
        """A new session with the same producer, on this engine's current token."""
        before = self.peers.get((host, port))
        self.connect(host, port, timeout)
        after = self.peers.get((host, port))
        if before is not None and (after is None or after.subject != before.subject):
            self.drop(host, port)
            raise AuthError(
                f"the peer at {host}:{port} was {before.subject}, now "
                f"{after.subject if after else 'unidentified'}"
            )

    def call(
        self, host: str, port: int, request: dict[str, Any], timeout: float
    ) -> tuple[dict[str, Any], list[zmq.Frame]]:
        session = self.sessions.get((host, port))
        if session is not None and time.time() >= session.renew_at:
            deadline = time.monotonic() + timeout
            self._reauthenticate(host, port, timeout)
            timeout = max(0.05, deadline - time.monotonic())
        frames, seq = self._signed(host, port, request)
        key = self.sessions[(host, port)].key
        deadline = time.monotonic() + timeout
        while True:
            got = self._exchange(host, port, frames, max(0.01, deadline - time.monotonic()))
            frames = []  # sent once; later rounds only receive
            if len(got) < 2:
                refused = Refusal.of(self._unpack(host, port, got[0].buffer), "request refused")
                self.drop(host, port)
                raise RuntimeError(refused.error if refused else "request refused")
            head, code, *extra = got
            if not hmac.compare_digest(code.bytes, mac(key, b"rep", head.bytes)):
                self.drop(host, port)
                raise AuthError(f"a forged reply from {host}:{port}")
            reply = self._unpack(host, port, head.buffer)
            if reply.get("seq") == seq:
                break
            # A late answer to an earlier call that timed out: skip it.
        refusal = Refusal.of(reply, "request failed")
        if refusal is not None:
            raise Refused(refusal.error, refusal.code)
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


def _renew_at(*tokens: ident.IdentityClaims | None) -> float:
    """When a session resting on ``tokens`` (the client's and the server's claims)
    should be renewed: ``RENEW_MARGIN_SECONDS`` (at most half the time left)
    before the soonest expiry; never, without identities."""
    expiries = [t.expires for t in tokens if t is not None]
    if not expiries:
        return math.inf
    soonest = min(expiries)
    return soonest - min(RENEW_MARGIN_SECONDS, max(0.0, soonest - time.time()) / 2)
