"""``kv_transfer_params``: what a prefill engine lends a decode engine, and how it is signed.

The two-leg protocol (docs/kv_transfer.md) carries one JSON object in a
request's and a response's ``kv_transfer_params``, under vLLM's names so that
either project's engines and routers can drive the other's:

* the prefill leg asks a producer to hold the prompt's blocks:
  ``{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id":
  null, "remote_block_ids": null, "remote_host": null, "remote_port": null}``
  (:data:`REMOTE_DECODE`);
* the producer answers with the params of a decode leg: ``do_remote_prefill``,
  where its side channel listens (``remote_host``, ``remote_port``), which
  blocks it holds (``remote_block_ids``) for which request, its TP size, and
  pdfleet's own fields: the lease, the compatibility factors, the content the
  lease lends (the chained hash of the last leased block and its algorithm),
  the producer's vouched identity, an expiry and an HMAC over all of it;
* a prefill leg that pulls a peer's cached prefix first (peer pulls in P/D):
  the peer's signed params plus ``pdfleet_produce: true``, which the signature
  does not cover (the gateway asks it of the consumer).

:class:`KVTransferParams` is the typed carrier: :meth:`~KVTransferParams.from_wire`
decodes a JSON object (a ``ValueError`` names the field of a wrong type, the
HTTP server answers 400), :meth:`~KVTransferParams.to_wire` encodes one. The
producer :func:`sign`\\ s the params it answers with; a consumer
:func:`verify`\\ es what it receives, on the exact object that arrived, before
anything is dialled. The HMAC key derives from the fleet secret
(``security.derive_key(secret, "kv-params")``), so only an engine of the same
fleet can sign or verify.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from .security import derive_key

LEASE_FIELD = "pdfleet_lease_id"
COMPAT_FIELD = "pdfleet_compat"
COMPAT_HASH_FIELD = "pdfleet_compat_hash"
# The content a lease lends, signed with it: the chained hash of the last leased
# block (hex), which covers every block before it and their token ids, and the
# algorithm that produced it (docs/kv_events.md, "Block hashes").
CHAIN_FIELD = "pdfleet_block_chain"
CHAIN_ALGO_FIELD = "pdfleet_block_hash_algo"
# The producer's vouched identity (fleets with identities): the consumer pulls only
# from a side channel that proves it.
PRODUCER_FIELD = "pdfleet_producer"
# A lend request (an engine that holds a cached prefix lends it to a peer): how many
# leading full blocks of the prompt to lease. The lending engine leases them only if
# its prefix cache (device or host tier) holds every one, and refuses otherwise; it
# computes only the one token after them (the lease is a prefill leg's).
LEND_FIELD = "pdfleet_lend_blocks"
# With a decode leg's (signed) params: after the verified pull and the tail, finish as
# a prefill leg does (lease every full block of the prompt for a remote decode and
# answer with this engine's own signed params). A prefill engine that pulls a cached
# prefix from a peer. Not covered by the producer's signature (it is the gateway's
# request to the consumer, not part of what the producer lends, as
# ``do_remote_decode`` on a plain prefill leg is not signed either).
PRODUCE_FIELD = "pdfleet_produce"
# The fields a signature adds.
SIG_FIELD = "pdfleet_sig"
EXPIRES_FIELD = "pdfleet_expires"

# vLLM's fields of a request, always written (null when unset), as its router sends them.
_VLLM_REQUEST_FIELDS = (
    "do_remote_decode",
    "do_remote_prefill",
    "remote_engine_id",
    "remote_block_ids",
    "remote_host",
    "remote_port",
)
# Written together once a lease exists (a null chain included: a lease of no full block).
_LEASE_FIELDS = (LEASE_FIELD, COMPAT_FIELD, COMPAT_HASH_FIELD, CHAIN_FIELD, CHAIN_ALGO_FIELD)


FIELD = "kv_transfer_params"
"""The request and response field the params travel in."""


class RefusedParams(ValueError):
    """kv_transfer_params an engine refuses (malformed, unusable here, or
    failing verification). The engine answers 400 with ``param`` :data:`FIELD`
    (the message starts with the field), which is how the gateway tells a
    refusal of the producer's params, worth a decode-only leg, from any other
    400."""

    param = FIELD


class InvalidParams(RefusedParams):
    """kv_transfer_params that are unsigned, forged, altered or expired."""


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    """One ``kv_transfer_params`` object (wire names in the field docs)."""

    do_remote_decode: bool = False
    """A prefill leg: hold the prompt's blocks for a decode engine to pull."""
    do_remote_prefill: bool = False
    """A decode leg: pull the prompt's blocks from the producer named below."""
    remote_engine_id: str | None = None
    remote_instance_id: str | None = None
    """The producer process; a restarted producer has another one."""
    remote_host: str | None = None
    """The producer's KV side channel."""
    remote_port: int | None = None
    remote_block_ids: tuple[int, ...] | None = None
    """The producer's leased blocks, in prompt order (full blocks only)."""
    remote_request_id: str | None = None
    tp_size: int | None = None
    """The producer's tensor-parallel size (how its KV heads are sharded)."""
    lease_id: str | None = None
    """``pdfleet_lease_id``: random, unguessable; names the lease on the side channel."""
    compat: Mapping[str, Any] | None = None
    """``pdfleet_compat``: the factors two engines must share to exchange KV."""
    compat_hash: str | None = None
    """``pdfleet_compat_hash``."""
    block_chain: str | None = None
    """``pdfleet_block_chain``: hex of the last leased block's chained hash (None:
    no full block is leased)."""
    block_hash_algo: str | None = None
    """``pdfleet_block_hash_algo``: the algorithm of ``block_chain``."""
    producer: str | None = None
    """``pdfleet_producer``: the producer's vouched identity subject."""
    expires: float | None = None
    """``pdfleet_expires``: wall-clock seconds after which the signature is refused."""
    signature: str | None = None
    """``pdfleet_sig``: HMAC-SHA256 (hex) over every other field."""
    lend_blocks: int | None = None
    """``pdfleet_lend_blocks`` (with ``do_remote_decode``): lease this many leading
    full blocks of the prompt from the prefix cache, or refuse if it lacks one."""
    produce: bool = False
    """``pdfleet_produce`` (with ``do_remote_prefill``): a prefill leg that pulls
    first; unsigned (see :data:`PRODUCE_FIELD`)."""

    @classmethod
    def from_wire(cls, raw: Mapping[str, Any]) -> KVTransferParams:
        """The params a JSON object carries; ValueError naming a field of the wrong
        type. Fields it does not know are left out (vLLM's own are ignored too)."""
        if not isinstance(raw, Mapping):
            raise RefusedParams("kv_transfer_params must be an object")
        ids = raw.get("remote_block_ids")
        if ids is not None:
            if not isinstance(ids, list | tuple) or not all(
                isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in ids
            ):
                raise RefusedParams("kv_transfer_params: remote_block_ids must be block ids")
            ids = tuple(ids)
        port = raw.get("remote_port")
        if port is not None and (
            isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536
        ):
            raise RefusedParams("kv_transfer_params: remote_port is not a port")
        compat = raw.get(COMPAT_FIELD)
        if compat is not None and not isinstance(compat, Mapping):
            raise RefusedParams(f"kv_transfer_params: {COMPAT_FIELD} must be an object")
        expires = raw.get(EXPIRES_FIELD)
        if expires is not None and (
            isinstance(expires, bool) or not isinstance(expires, int | float)
        ):
            raise RefusedParams(f"kv_transfer_params: {EXPIRES_FIELD} must be a number")
        return cls(
            do_remote_decode=bool(raw.get("do_remote_decode")),
            do_remote_prefill=bool(raw.get("do_remote_prefill")),
            remote_engine_id=_text(raw, "remote_engine_id"),
            remote_instance_id=_text(raw, "remote_instance_id"),
            remote_host=_text(raw, "remote_host"),
            remote_port=port,
            remote_block_ids=ids,
            remote_request_id=_text(raw, "remote_request_id"),
            tp_size=_integer(raw, "tp_size"),
            lease_id=_text(raw, LEASE_FIELD),
            compat=compat,
            compat_hash=_text(raw, COMPAT_HASH_FIELD),
            block_chain=_text(raw, CHAIN_FIELD),
            block_hash_algo=_text(raw, CHAIN_ALGO_FIELD),
            producer=_text(raw, PRODUCER_FIELD),
            expires=expires,
            signature=_text(raw, SIG_FIELD),
            lend_blocks=_integer(raw, LEND_FIELD),
            produce=_flag(raw, PRODUCE_FIELD),
        )

    def to_wire(self) -> dict[str, Any]:
        """The JSON object: vLLM's request fields always, the lease's fields
        together once there is a lease, any other field when it is set."""
        out: dict[str, Any] = {
            "do_remote_prefill": self.do_remote_prefill,
            "do_remote_decode": self.do_remote_decode,
            "remote_engine_id": self.remote_engine_id,
            "remote_instance_id": self.remote_instance_id,
            "remote_host": self.remote_host,
            "remote_port": self.remote_port,
            "remote_block_ids": (
                None if self.remote_block_ids is None else list(self.remote_block_ids)
            ),
            "remote_request_id": self.remote_request_id,
            "tp_size": self.tp_size,
            LEASE_FIELD: self.lease_id,
            COMPAT_FIELD: None if self.compat is None else dict(self.compat),
            COMPAT_HASH_FIELD: self.compat_hash,
            CHAIN_FIELD: self.block_chain,
            CHAIN_ALGO_FIELD: self.block_hash_algo,
            PRODUCER_FIELD: self.producer,
            EXPIRES_FIELD: self.expires,
            SIG_FIELD: self.signature,
            LEND_FIELD: self.lend_blocks,
            PRODUCE_FIELD: self.produce or None,
        }
        keep = set(_VLLM_REQUEST_FIELDS)
        if self.lease_id is not None:
            keep.update(_LEASE_FIELDS)
        return {k: v for k, v in out.items() if k in keep or v is not None}

    @property
    def produces(self) -> bool:
        """The request ends as a prefill leg: its blocks are leased for a remote decode."""
        return self.do_remote_decode or self.produce

    def after_load(self) -> KVTransferParams | None:
        """What a request keeps once its pull is over (done, failed or dropped): a
        prefill leg that pulled first still leases its blocks; any other, nothing."""
        return REMOTE_DECODE if self.produce else None

    @property
    def num_blocks(self) -> int:
        """How many blocks the producer lends."""
        return len(self.remote_block_ids or ())


REMOTE_DECODE = KVTransferParams(do_remote_decode=True)
"""A prefill leg's params: hold the prompt's blocks for a remote decode."""


def _text(raw: Mapping[str, Any], name: str) -> str | None:
    value = raw.get(name)
    if value is not None and not isinstance(value, str):
        raise RefusedParams(f"kv_transfer_params: {name} must be a string")
    return value


def _flag(raw: Mapping[str, Any], name: str) -> bool:
    value = raw.get(name, False)
    if value is not None and not isinstance(value, bool):
        raise RefusedParams(f"kv_transfer_params: {name} must be a boolean")
    return bool(value)


def _integer(raw: Mapping[str, Any], name: str) -> int | None:
    value = raw.get(name)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise RefusedParams(f"kv_transfer_params: {name} must be an integer")
    return value


_UNSIGNED = frozenset({SIG_FIELD, PRODUCE_FIELD})


def _canonical(wire: Mapping[str, Any]) -> bytes:
    body = {k: v for k, v in wire.items() if k not in _UNSIGNED}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), default=str).encode()


def _mac(secret: bytes, wire: Mapping[str, Any]) -> str:
    key = derive_key(secret, "kv-params")
    return hmac.new(key, _canonical(wire), hashlib.sha256).hexdigest()


def sign(secret: bytes, params: KVTransferParams, ttl: float) -> KVTransferParams:
    """``params`` with an expiry (wall-clock seconds from now) and an HMAC over
    every field of its wire form."""
    unsigned = replace(params, expires=round(time.time() + ttl, 3), signature=None)
    return replace(unsigned, signature=_mac(secret, unsigned.to_wire()))


def verify(secret: bytes, wire: Mapping[str, Any], now: float | None = None) -> KVTransferParams:
    """The params of ``wire`` (the object exactly as it arrived) once its
    signature and expiry check out; InvalidParams naming why, or ValueError
    for a field of the wrong type."""
    sig = wire.get(SIG_FIELD)
    if not isinstance(sig, str):
        raise InvalidParams("kv_transfer_params are not signed by a prefill engine of this fleet")
    if not hmac.compare_digest(sig.encode(), _mac(secret, wire).encode()):
        raise InvalidParams("kv_transfer_params have a bad signature (forged or altered)")
    expires = wire.get(EXPIRES_FIELD)
    if not isinstance(expires, int | float) or isinstance(expires, bool):
        raise InvalidParams("kv_transfer_params carry no expiry")
    if (time.time() if now is None else now) > float(expires):
        raise InvalidParams("kv_transfer_params have expired")
    return KVTransferParams.from_wire(wire)
