"""The KV connector's handshake reply and shard carriers: one encoding, decoders
that name the field."""

from __future__ import annotations

import msgpack
import pytest

from pdfleet.engine.contracts.kv_connector import (
    HandshakeReply,
    KVLayoutWire,
    ShardConnect,
    ShardInfo,
    shard_command_from_wire,
)

LAYOUT = KVLayoutWire(2, 64, 16, 4, 8, "bfloat16", 2, "cuda:0")
SHARDS = [ShardInfo(r, b"agent-%d" % r, 4096 * (r + 1), r, 64, 2) for r in range(2)]


def test_the_reply_encodes_as_the_map_the_consumer_has_always_read():
    reply = HandshakeReply(4, "e", "i", {"model": "m"}, "abc", LAYOUT, "nixl", 2, SHARDS)
    wire = reply.to_wire()
    assert list(wire) == [
        "ok", "version", "engine_id", "instance_id", "compat", "compat_hash", "layout",
        "transport", "tp_size", "shards",
    ]  # fmt: skip
    assert list(wire["layout"]) == [
        "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype",
        "element_size", "device",
    ]  # fmt: skip
    assert list(wire["shards"][0]) == [
        "rank", "agent_metadata", "base_address", "device_id", "num_blocks", "num_kv_heads",
    ]  # fmt: skip
    back = msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False)
    assert HandshakeReply.from_wire(back) == reply
    zmq = HandshakeReply(4, "e", "i", {}, "abc", LAYOUT, "zmq")
    assert "shards" not in zmq.to_wire() and "tp_size" not in zmq.to_wire()
    assert HandshakeReply.from_wire(zmq.to_wire()) == zmq


def _broken(path: str, value: object) -> dict:
    wire = HandshakeReply(4, "e", "i", {}, "abc", LAYOUT, "nixl", 2, SHARDS).to_wire()
    *parents, last = path.split("/")
    node = wire
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return wire


@pytest.mark.parametrize(
    ("path", "value", "named"),
    [
        ("ok", False, "ok"),
        ("version", "4", "version"),
        ("engine_id", None, "engine_id"),
        ("instance_id", 7, "instance_id"),
        ("compat", [], "compat"),
        ("compat_hash", KeyError, "compat_hash"),
        ("layout", None, "layout"),
        ("layout/num_blocks", "64", r"layout\.num_blocks"),
        ("layout/dtype", 2, r"layout\.dtype"),
        ("transport", KeyError, "transport"),
        ("tp_size", True, "tp_size"),
        ("shards", {}, "shards"),
        ("shards/1/agent_metadata", "text", r"shards\[1\]\.agent_metadata"),
        ("shards/0/num_kv_heads", KeyError, r"shards\[0\]\.num_kv_heads"),
        ("shards/0/base_address", -1, r"shards\[0\]\.base_address"),
    ],
)
def test_a_malformed_reply_is_a_value_error_naming_the_field(path, value, named):
    with pytest.raises(ValueError, match=named):
        HandshakeReply.from_wire(_broken(path, value))


def test_shard_connect_carries_typed_shards_over_the_rank_wire():
    command = ShardConnect("k", SHARDS[:1], [[0, 0, 0, 2]])
    assert shard_command_from_wire(command.to_wire()) == command
    with pytest.raises(ValueError, match=r"remote shard\.num_blocks"):
        shard_command_from_wire(["connect", "k", [{**SHARDS[0].to_wire(), "num_blocks": 0}], []])
