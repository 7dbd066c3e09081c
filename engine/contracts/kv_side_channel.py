"""The KV side channel's messages: its handshake and the envelope of every later
message (msgpack maps, never pickle; the transport is
``engine/kv_transfer/side_channel.py``, which says what each step proves).

Before authentication a message is one frame of at most
:data:`MAX_HELLO_BYTES`:

* :class:`Hello` (client -> server): ``{"op": "hello", "version", "nonce",
  "engine_id", "instance_id", "compat_hash", "identity"}``;
* :class:`HelloReply` (server -> client): ``{"ok": true, "session", "nonce",
  "cookie", "proof"}`` plus ``identity`` and ``identity_sig`` when the server
  has a fleet identity;
* :class:`Auth` (client -> server): ``{"op": "auth", "session",
  "client_nonce", "nonce", "hello", "cookie", "proof"}`` plus
  ``identity_sig``; ``hello`` is :meth:`HelloFields.packed`, the bytes every
  proof and signature covers;
* :class:`Refusal` (either way): ``{"ok": false, "error"}`` plus ``code`` (a
  kind of refusal the caller acts on) or ``compat`` (the producer's compat
  factors, when the hello's ``compat_hash`` differs).

After it, every request is ``[body, mac]``, and ``body`` a map whose
:class:`Envelope` (``session``, ``seq``) names the session and orders the
messages; its ``op`` and the rest are the connector's:

* (no message: the answer to a successful :class:`Auth` is the producer's
  ``HandshakeReply``, ``kv_connector.py``);
* :class:`LeaseUse` (consumer -> producer): ``{"op": "claim" | "read",
  "lease_id", "block_ids", "chain"}``: a claim binds the lease to the
  consumer before its one-sided NIXL READs, a read (ZMQ) answers the blocks'
  bytes as frames; ``chain`` is the consumer's hash chain of the blocks'
  tokens (``block_hash.py``), which the producer compares with the lease's;
* :class:`LeaseEnd` (consumer -> producer): ``{"op": "confirm" | "release",
  "lease_id"}``: confirm asks whether the lease held for the whole transfer
  and ends it, release (one way, no reply) gives it back unused.

Decoders raise :class:`ValueError` naming the field that is wrong, so the
server refuses a hostile message with that reason.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from typing import Any

import msgpack as _msgpack  # private: other modules use the carriers, never msgpack

from . import security

PROTOCOL_VERSION = 4
"""A hello of another version is refused (``version:``): both sides run one pdfleet."""
PURPOSE = "kv-side-channel"
"""The fleet-secret purpose the proofs and session keys derive from."""
MAX_MESSAGE_BYTES = 1 << 20
"""Bytes of any frame (ZeroMQ refuses a larger one before buffering it: a claim
naming the blocks of a 1M-token prompt is about 320 KiB)."""
MAX_HELLO_BYTES = 8 << 10
"""Bytes of a message before authentication (hello and auth are a few hundred)."""
MAX_FRAMES = 2
"""Frames of a request: one before authentication, body and MAC after."""
NONCE_BYTES = (16, 64)
"""The shortest and longest nonce either side accepts."""
SESSION_ID_BYTES = 16
"""A session id: 8 bytes of the server's clock (ms, big-endian), 8 random."""
MAX_ID_CHARS = 256
"""Longest engine or instance id a hello may state."""
MAX_COMPAT_HASH_CHARS = 128


def pack(obj: dict[str, Any]) -> bytes:
    packed: bytes = _msgpack.packb(obj, use_bin_type=True)  # msgpack ships no types
    return packed


def unpack(data: bytes | memoryview, limit: int = MAX_MESSAGE_BYTES) -> dict[str, Any]:
    """A message's map; ValueError for one over ``limit`` bytes, not msgpack, or not a map."""
    if len(data) > limit:
        raise ValueError(f"a side-channel message is at most {limit} bytes")
    try:
        obj = _msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several kinds for bad bytes
        raise ValueError(f"side-channel message is not msgpack: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("side-channel message is not a map")
    return obj


def mac(key: bytes, label: bytes, body: bytes) -> bytes:
    """The MAC of a body under a session key (``label``: ``req`` or ``rep``)."""
    return hmac.new(key, label + body, hashlib.sha256).digest()


def session_key(secret: bytes, client_nonce: bytes, server_nonce: bytes) -> bytes:
    return security.prove(secret, PURPOSE, b"session", client_nonce, server_nonce)


def transcript(label: bytes, *parts: bytes) -> bytes:
    """What an identity key signs in a handshake (``label``: ``client`` or
    ``server``): length-prefixed parts."""
    out = [b"pdfleet/kv-side-channel/identity/", label]
    for part in parts:
        out += [len(part).to_bytes(4, "big"), part]
    return b"".join(out)


def _bytes(data: dict[str, Any], name: str, size: tuple[int, int] | None = None) -> bytes:
    value = data.get(name)
    if not isinstance(value, bytes):
        raise ValueError(f"{name}: missing or not bytes")
    if size is not None and not size[0] <= len(value) <= size[1]:
        raise ValueError(f"{name}: {len(value)} bytes, not {size[0]} to {size[1]}")
    return value


def _text(data: dict[str, Any], name: str, limit: int) -> str:
    value = data.get(name)
    if not isinstance(value, str) or len(value) > limit:
        raise ValueError(f"{name}: missing, not a string, or over {limit} characters")
    return value


def _token(data: dict[str, Any]) -> str | None:
    value = data.get("identity")
    if value is not None and not isinstance(value, str):
        raise ValueError("identity: not a string")
    return value


def _op(data: dict[str, Any], op: str) -> None:
    if data.get("op") != op:
        raise ValueError(f"op: {data.get('op')!r} is not {op!r}")


@dataclass(frozen=True, slots=True)
class HelloFields:
    """Who the client says it is: what every proof and identity signature covers."""

    engine_id: str
    instance_id: str
    compat_hash: str
    identity: str | None = None
    """The client's identity token (fleets with identities; None without)."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "instance_id": self.instance_id,
            "compat_hash": self.compat_hash,
            "identity": self.identity,
        }

    def packed(self) -> bytes:
        """The canonical bytes (this key order) the proofs and signatures cover."""
        return pack(self.to_wire())

    @classmethod
    def from_wire(cls, data: dict[str, Any]) -> HelloFields:
        return cls(
            _text(data, "engine_id", MAX_ID_CHARS),
            _text(data, "instance_id", MAX_ID_CHARS),
            _text(data, "compat_hash", MAX_COMPAT_HASH_CHARS),
            _token(data),
        )

    @classmethod
    def unpacked(cls, data: bytes) -> HelloFields:
        """The fields of :meth:`packed` bytes (an auth's ``hello``)."""
        return cls.from_wire(unpack(data, MAX_HELLO_BYTES))


@dataclass(frozen=True, slots=True)
class Hello:
    """The client's first message: its protocol version, a nonce, who it is."""

    nonce: bytes
    fields: HelloFields
    version: int = PROTOCOL_VERSION

    def encode(self) -> bytes:
        wire = {"op": "hello", "version": self.version, "nonce": self.nonce}
        return pack({**wire, **self.fields.to_wire()})

    @classmethod
    def decode(cls, data: dict[str, Any]) -> Hello:
        """A hello's map; ValueError naming the field. The version is checked
        first (``version:``), so a peer of another pdfleet hears why whatever
        else it sent; the caller compares the compat hash."""
        _op(data, "hello")
        version = data.get("version")
        if version != PROTOCOL_VERSION:
            raise ValueError(
                f"version: side-channel protocol {version!r} is not this engine's "
                f"{PROTOCOL_VERSION}; run the same pdfleet version on prefill and decode"
            )
        return cls(_bytes(data, "nonce", NONCE_BYTES), HelloFields.from_wire(data), version)


@dataclass(frozen=True, slots=True)
class HelloReply:
    """The server's answer to a hello: its nonce, the session id and cookie that
    let it recognise the auth statelessly, and its proof over both nonces and
    the hello's fields (and, with fleet identities, its token and signature)."""

    session: bytes
    nonce: bytes
    cookie: bytes
    proof: bytes
    identity: str | None = None
    identity_sig: bytes | None = None

    def encode(self) -> bytes:
        reply: dict[str, Any] = {
            "ok": True,
            "session": self.session,
            "nonce": self.nonce,
            "cookie": self.cookie,
            "proof": self.proof,
        }
        if self.identity is not None:
            reply["identity"] = self.identity
            reply["identity_sig"] = self.identity_sig
        return pack(reply)

    @classmethod
    def decode(cls, data: dict[str, Any]) -> HelloReply:
        """An ``ok`` reply's map (read a refusal with :meth:`Refusal.of` first)."""
        sig = data.get("identity_sig")
        return cls(
            _bytes(data, "session", (SESSION_ID_BYTES, SESSION_ID_BYTES)),
            _bytes(data, "nonce", NONCE_BYTES),
            _bytes(data, "cookie", (32, 32)),
            _bytes(data, "proof", (32, 32)),
            _token(data),
            sig if isinstance(sig, bytes) else None,
        )


@dataclass(frozen=True, slots=True)
class Auth:
    """The client's second message: the hello's and the server's values back,
    and the client's proof (and identity signature) over them."""

    session: bytes
    client_nonce: bytes
    nonce: bytes
    hello: bytes
    """:meth:`HelloFields.packed` of the hello."""
    cookie: bytes
    proof: bytes
    identity_sig: bytes | None = None

    def encode(self) -> bytes:
        auth: dict[str, Any] = {
            "op": "auth",
            "session": self.session,
            "client_nonce": self.client_nonce,
            "nonce": self.nonce,
            "hello": self.hello,
            "cookie": self.cookie,
            "proof": self.proof,
        }
        if self.identity_sig is not None:
            auth["identity_sig"] = self.identity_sig
        return pack(auth)

    @classmethod
    def decode(cls, data: dict[str, Any]) -> Auth:
        _op(data, "auth")
        sig = data.get("identity_sig")
        return cls(
            _bytes(data, "session", (SESSION_ID_BYTES, SESSION_ID_BYTES)),
            _bytes(data, "client_nonce", NONCE_BYTES),
            _bytes(data, "nonce", NONCE_BYTES),
            _bytes(data, "hello", (0, MAX_HELLO_BYTES)),
            _bytes(data, "cookie"),
            _bytes(data, "proof"),
            sig if isinstance(sig, bytes) else None,
        )


@dataclass(frozen=True, slots=True)
class Accepted:
    """A message accepted with nothing to add (a claim, a read whose frames
    follow, a confirm; an auth whose handshake handler adds nothing)."""

    def to_wire(self) -> dict[str, Any]:
        return {"ok": True}

    def encode(self) -> bytes:
        return pack(self.to_wire())


@dataclass(frozen=True, slots=True)
class Refusal:
    """A refused message: ``error`` says why; ``code`` names a kind the caller
    acts on; ``compat``, the producer's compat factors (not secret), lets a
    consumer name the field that differs."""

    error: str
    code: str | None = None
    compat: dict[str, Any] | None = None

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": False, "error": self.error}
        if self.code is not None:
            out["code"] = self.code
        if self.compat is not None:
            out["compat"] = self.compat
        return out

    def encode(self) -> bytes:
        return pack(self.to_wire())

    @classmethod
    def of(cls, data: dict[str, Any], default: str = "refused") -> Refusal | None:
        """The refusal a reply's map carries; None when it says ``ok``."""
        if data.get("ok", False) is True:
            return None
        error, code, compat = data.get("error"), data.get("code"), data.get("compat")
        return cls(
            str(error) if error is not None else default,
            code if isinstance(code, str) else None,
            compat if isinstance(compat, dict) else None,
        )


@dataclass(frozen=True, slots=True)
class Envelope:
    """What every message after the handshake carries besides its op: the
    session it belongs to and its sequence number (strictly increasing per
    session; a reply echoes its request's)."""

    session: bytes
    seq: int

    @classmethod
    def of(cls, data: dict[str, Any]) -> Envelope:
        seq = data.get("seq")
        if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
            raise ValueError("seq: missing or not a positive integer")
        return cls(_bytes(data, "session", (SESSION_ID_BYTES, SESSION_ID_BYTES)), seq)

    def seal(self, request: dict[str, Any]) -> bytes:
        """``request`` with this envelope, packed: the body a session MAC covers."""
        return pack({**request, "session": self.session, "seq": self.seq})


CLAIM = "claim"
READ = "read"
CONFIRM = "confirm"
RELEASE = "release"
MAX_LEASE_ID_CHARS = 128
"""Longest lease id a message may name (the producer's are 24 characters)."""
MAX_CHAIN_CHARS = 256
"""Longest block hash chain (hex of a 32-byte digest is 64 characters)."""
_USE_FIELDS = frozenset({"op", "lease_id", "block_ids", "chain", "session", "seq"})
_END_FIELDS = frozenset({"op", "lease_id", "session", "seq"})


def _unknown(data: dict[str, Any], known: frozenset[str]) -> None:
    for name in data:
        if name not in known:
            raise ValueError(f"{name}: unknown field")


def _op_of(data: dict[str, Any], ops: tuple[str, ...]) -> str:
    op = data.get("op")
    if op not in ops:
        raise ValueError(f"op: {op!r} is not one of {ops}")
    return str(op)


def _lease_id(data: dict[str, Any]) -> str:
    value = data.get("lease_id")
    if not isinstance(value, str) or not value or len(value) > MAX_LEASE_ID_CHARS:
        raise ValueError(
            f"lease_id: missing, not a string, or over {MAX_LEASE_ID_CHARS} characters"
        )
    return value


@dataclass(frozen=True, slots=True)
class LeaseUse:
    """A claim or a read of blocks held under a lease (``op``: :data:`CLAIM` or
    :data:`READ`): the producer's block ids, and the hash chain of the
    consumer's prompt over them (None: the consumer has none, a lease of no
    full block; a lease with a chain then refuses it)."""

    op: str
    lease_id: str
    block_ids: tuple[int, ...]
    chain: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """The message's map (the envelope is added when it is sealed)."""
        return {
            "op": self.op,
            "lease_id": self.lease_id,
            "block_ids": list(self.block_ids),
            "chain": self.chain,
        }

    @classmethod
    def decode(cls, data: dict[str, Any]) -> LeaseUse:
        """The claim or read of a message's map; ValueError naming the field (an
        absent ``chain`` is None)."""
        _unknown(data, _USE_FIELDS)
        op = _op_of(data, (CLAIM, READ))
        lease_id = _lease_id(data)
        ids = data.get("block_ids")
        if not isinstance(ids, list) or not all(type(b) is int and b >= 0 for b in ids):
            raise ValueError("block_ids: missing or not a list of non-negative integers")
        chain = data.get("chain")
        if chain is not None and (not isinstance(chain, str) or len(chain) > MAX_CHAIN_CHARS):
            raise ValueError(f"chain: not a string of at most {MAX_CHAIN_CHARS} characters")
        return cls(op, lease_id, tuple(ids), chain)


@dataclass(frozen=True, slots=True)
class LeaseEnd:
    """The end of a lease (``op``: :data:`CONFIRM` after a transfer, or
    :data:`RELEASE` of a lease the consumer will not use)."""

    op: str
    lease_id: str

    def to_wire(self) -> dict[str, Any]:
        """The message's map (the envelope is added when it is sealed)."""
        return {"op": self.op, "lease_id": self.lease_id}

    @classmethod
    def decode(cls, data: dict[str, Any]) -> LeaseEnd:
        """The confirm or release of a message's map; ValueError naming the field."""
        _unknown(data, _END_FIELDS)
        return cls(_op_of(data, (CONFIRM, RELEASE)), _lease_id(data))
