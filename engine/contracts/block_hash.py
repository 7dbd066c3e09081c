"""Chained hashes of full KV blocks for prefix caching.

The hash of block i covers the hash of block i-1 and block i's token ids, so
equal hashes mean equal prefixes (up to collisions, which the block pool also
guards against by comparing token ids and the parent block).

The scheme is public (docs/kv_events.md, "Block hashes"): the engine's
scheduler and the gateway's exact prefix index both call
:func:`prompt_block_hashes` / :func:`extend_block_hashes` here, and an
external router that knows the block size and the algorithm reproduces the
64-bit ids KV events carry with :func:`external_block_hash`.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence

ROOT_HASH = b"\x00" * 32

HashFn = Callable[[bytes, Sequence[int]], bytes]


def root_hash(cache_salt: str | None = None, lora_name: str | None = None) -> bytes:
    """The parent of a prompt's first block: ``ROOT_HASH``, or, for a request
    with a ``cache_salt`` or a LoRA adapter, a digest of them. Requests with
    different salts or adapters (or one with and one without) share no block
    hash, so no prefix-cache block, KV event id or gateway index entry: the KV
    of a prompt depends on the adapter that computed it. ``lora_name`` is the
    adapter's identity as ``/v1/models`` lists it (``lora_identity``: its
    name and a digest of its files, :func:`lora_identity`), so an adapter
    loaded again under its name with other weights or another scaling shares
    nothing either."""
    if not cache_salt and not lora_name:
        return ROOT_HASH
    if not lora_name:
        return hashlib.sha256(b"pdfleet cache_salt\x00" + (cache_salt or "").encode()).digest()
    # Length-prefixed fields: no (salt, adapter) pair reads as another.
    salt, name = (cache_salt or "").encode(), lora_name.encode()
    payload = b"pdfleet lora\x00" + struct.pack("<q", len(name)) + name + salt
    return hashlib.sha256(payload).digest()


def lora_identity(name: str, digest: str) -> str:
    """An adapter's prefix-cache identity: ``name@`` and the first 16 hex
    digits of the sha256 of its adapter_config.json and
    adapter_model.safetensors (so a change of scaling alone is another
    identity)."""
    return f"{name}@{digest[:16]}"


def _sha256(parent: bytes, token_ids: Sequence[int]) -> bytes:
    # Canonical bytes: the parent hash, the count, then each id as signed 64-bit little-endian.
    payload = parent + struct.pack(f"<q{len(token_ids)}q", len(token_ids), *token_ids)
    return hashlib.sha256(payload).digest()


def _cbor_uint(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if value < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, value)
    raise ValueError(f"integer too large for CBOR: {value}")


def cbor_encode(obj: object) -> bytes:
    """Minimal canonical CBOR (RFC 8949) for ints, bytes, lists and None."""
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bool):
        return b"\xf5" if obj else b"\xf4"
    if isinstance(obj, int):
        return _cbor_uint(0, obj) if obj >= 0 else _cbor_uint(1, -1 - obj)
    if isinstance(obj, bytes):
        return _cbor_uint(2, len(obj)) + obj
    if isinstance(obj, (list, tuple)):
        return _cbor_uint(4, len(obj)) + b"".join(cbor_encode(x) for x in obj)
    raise TypeError(f"cannot CBOR-encode {type(obj).__name__}")


def _sha256_cbor(parent: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(cbor_encode([parent, list(token_ids), None])).digest()


HASH_FUNCTIONS: dict[str, HashFn] = {"sha256": _sha256, "sha256_cbor": _sha256_cbor}


def get_hash_fn(name: str) -> HashFn:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"unknown prefix_caching_hash_algo {name!r}") from None


def _int64_le(token_ids: Sequence[int]) -> bytes:
    """Token ids as consecutive signed 64-bit little-endian integers."""
    packed = array("q", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def extend_block_hashes(
    hashes: list[bytes],
    token_ids: Sequence[int],
    block_size: int,
    hash_fn: HashFn,
    root: bytes = ROOT_HASH,
) -> None:
    """Append hashes for every newly completed full block of ``token_ids``
    (``root``: the first block's parent, see :func:`root_hash`)."""
    start, end = len(hashes), len(token_ids) // block_size
    if start >= end:
        return
    if hash_fn is _sha256:
        # The same bytes as _sha256, packed once for all the new blocks (the
        # gateway hashes a whole prompt per request).
        raw = _int64_le(token_ids[start * block_size : end * block_size])
        count = struct.pack("<q", block_size)
        step = 8 * block_size
        parent = hashes[-1] if start else root
        sha256 = hashlib.sha256
        for off in range(0, len(raw), step):
            parent = sha256(parent + count + raw[off : off + step]).digest()
            hashes.append(parent)
        return
    for i in range(start, end):
        parent = hashes[i - 1] if i else root
        hashes.append(hash_fn(parent, token_ids[i * block_size : (i + 1) * block_size]))


def prompt_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    hash_fn: HashFn,
    max_blocks: int | None = None,
    cache_salt: str | None = None,
    lora_name: str | None = None,
) -> list[bytes]:
    """Hashes of the leading full blocks of a prompt (at most ``max_blocks``),
    exactly as the engine's prefix cache hashes them (``lora_name``: the
    adapter the request names, None for the base model)."""
    if max_blocks is not None:
        token_ids = token_ids[: max_blocks * block_size]
    hashes: list[bytes] = []
    extend_block_hashes(hashes, token_ids, block_size, hash_fn, root_hash(cache_salt, lora_name))
    return hashes


def external_block_hash(block_hash: bytes) -> int:
    """The id a KV event carries for a block: the digest's last 8 bytes read
    big-endian, unsigned (vLLM's default integer form of a block hash)."""
    return int.from_bytes(block_hash[-8:], "big")
