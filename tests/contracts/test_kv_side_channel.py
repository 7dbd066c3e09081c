"""The KV side channel's handshake messages: the same bytes as the maps both
sides have always sent, and a refusal naming the field for a hostile one."""

import msgpack
import pytest

from pdfleet.engine.contracts import kv_side_channel as sc


def packed(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


FIELDS = sc.HelloFields("engine-a", "inst-1", "c0ffee", "pdfleet-id1.tok")
HELLO_MAP = {
    "op": "hello",
    "version": sc.PROTOCOL_VERSION,
    "nonce": b"n" * 32,
    "engine_id": "engine-a",
    "instance_id": "inst-1",
    "compat_hash": "c0ffee",
    "identity": "pdfleet-id1.tok",
}


def test_hello_keeps_its_wire_bytes_and_round_trips():
    hello = sc.Hello(b"n" * 32, FIELDS)
    assert hello.encode() == packed(HELLO_MAP)
    assert sc.Hello.decode(sc.unpack(hello.encode())) == hello
    # What the proofs cover: the four fields, in this order.
    assert FIELDS.packed() == packed({k: HELLO_MAP[k] for k in list(HELLO_MAP)[3:]})
    assert sc.HelloFields.unpacked(FIELDS.packed()) == FIELDS
    # A hello without an identity (a fleet without identities) is one with None.
    bare = {k: v for k, v in HELLO_MAP.items() if k != "identity"}
    assert sc.Hello.decode(bare).fields.identity is None


@pytest.mark.parametrize(
    ("change", "refusal"),
    [
        ({"version": 3}, "version: side-channel protocol 3"),
        ({"version": "4"}, "version: side-channel protocol '4'"),
        ({"op": "auth"}, "op: 'auth' is not 'hello'"),
        ({"nonce": b"short"}, "nonce: 5 bytes, not 16 to 64"),
        ({"nonce": "n" * 32}, "nonce: missing or not bytes"),
        ({"engine_id": 7}, "engine_id: missing, not a string"),
        ({"instance_id": "i" * 257}, "instance_id: .* over 256 characters"),
        ({"compat_hash": None}, "compat_hash: missing"),
        ({"identity": b"tok"}, "identity: not a string"),
    ],
)
def test_a_malformed_hello_is_refused_naming_the_field(change, refusal):
    with pytest.raises(ValueError, match=refusal):
        sc.Hello.decode({**HELLO_MAP, **change})


def test_the_reply_and_auth_keep_their_wire_bytes_and_round_trip():
    sid = b"s" * 16
    reply = sc.HelloReply(sid, b"m" * 32, b"c" * 32, b"p" * 32)
    wire = {"ok": True, "session": sid, "nonce": b"m" * 32, "cookie": b"c" * 32}
    assert reply.encode() == packed({**wire, "proof": b"p" * 32})
    assert sc.HelloReply.decode(sc.unpack(reply.encode())) == reply
    signed = sc.HelloReply(sid, b"m" * 32, b"c" * 32, b"p" * 32, "tok", b"g" * 64)
    assert sc.unpack(signed.encode())["identity_sig"] == b"g" * 64
    assert sc.HelloReply.decode(sc.unpack(signed.encode())) == signed
    with pytest.raises(ValueError, match="session: 15 bytes"):
        sc.HelloReply.decode({**wire, "session": b"s" * 15, "proof": b"p" * 32})

    auth = sc.Auth(sid, b"n" * 32, b"m" * 32, FIELDS.packed(), b"c" * 32, b"p" * 32)
    auth_map = {
        "op": "auth",
        "session": sid,
        "client_nonce": b"n" * 32,
        "nonce": b"m" * 32,
        "hello": FIELDS.packed(),
        "cookie": b"c" * 32,
        "proof": b"p" * 32,
    }
    assert auth.encode() == packed(auth_map)
    assert sc.Auth.decode(sc.unpack(auth.encode())) == auth
    with pytest.raises(ValueError, match="hello: missing or not bytes"):
        sc.Auth.decode({**auth_map, "hello": {"engine_id": "x"}})
    with pytest.raises(ValueError, match="session: missing or not bytes"):
        sc.Auth.decode({k: v for k, v in auth_map.items() if k != "session"})


def test_refusals_and_the_envelope():
    assert sc.Refusal("no").encode() == packed({"ok": False, "error": "no"})
    wire = {"ok": False, "error": "gone", "code": "lease_ended", "seq": 3}
    assert sc.Refusal.of(wire) == sc.Refusal("gone", "lease_ended")
    assert sc.Refusal.of({"ok": True}) is None
    assert sc.Refusal.of({"ok": 1}) == sc.Refusal("refused")  # only true is ok
    compat = sc.Refusal("compat_hash: differs", compat={"model": "m"})
    assert sc.Refusal.of(sc.unpack(compat.encode())) == compat

    body = sc.Envelope(b"s" * 16, 7).seal({"op": "confirm", "lease_id": "l"})
    assert body == packed({"op": "confirm", "lease_id": "l", "session": b"s" * 16, "seq": 7})
    assert sc.Envelope.of(sc.unpack(body)) == sc.Envelope(b"s" * 16, 7)
    for bad, why in (({"seq": 0}, "seq:"), ({"seq": True}, "seq:"), ({"session": "s"}, "session:")):
        with pytest.raises(ValueError, match=why):
            sc.Envelope.of({"session": b"s" * 16, "seq": 1, **bad})


def test_unpack_bounds_and_refuses_what_is_not_a_map():
    with pytest.raises(ValueError, match="at most 8192 bytes"):
        sc.unpack(packed({"pad": "z" * 9000}), sc.MAX_HELLO_BYTES)
    with pytest.raises(ValueError, match="not a map"):
        sc.unpack(packed([1, 2]))
    with pytest.raises(ValueError, match="not msgpack"):
        sc.unpack(b"\xc1")


def test_the_lease_messages_keep_their_bytes_and_refuse_naming_the_field():
    use = sc.LeaseUse(sc.CLAIM, "lease", (3, 4), "ab12")
    # The maps the connector built by hand, key for key in the same order.
    assert sc.pack(use.to_wire()) == sc.pack(
        {"op": "claim", "lease_id": "lease", "block_ids": [3, 4], "chain": "ab12"}
    )
    assert sc.pack(sc.LeaseEnd(sc.RELEASE, "lease").to_wire()) == sc.pack(
        {"op": "release", "lease_id": "lease"}
    )
    sealed = sc.unpack(sc.Envelope(b"s" * 16, 2).seal(use.to_wire()))
    assert sc.LeaseUse.decode(sealed) == use
    assert sc.LeaseUse.decode({"op": "read", "lease_id": "l", "block_ids": []}).chain is None
    assert sc.LeaseEnd.decode({"op": "confirm", "lease_id": "l"}) == sc.LeaseEnd("confirm", "l")
    for bad, field in [
        ({"op": "confirm", "lease_id": "l", "block_ids": [0]}, "op"),
        ({"op": "read", "block_ids": [0]}, "lease_id"),
        ({"op": "read", "lease_id": 7, "block_ids": [0]}, "lease_id"),
        ({"op": "read", "lease_id": "l" * 129, "block_ids": [0]}, "lease_id"),
        ({"op": "read", "lease_id": "l"}, "block_ids"),
        ({"op": "read", "lease_id": "l", "block_ids": [0, -1]}, "block_ids"),
        ({"op": "read", "lease_id": "l", "block_ids": ["0"]}, "block_ids"),
        ({"op": "claim", "lease_id": "l", "block_ids": [0], "chain": 5}, "chain"),
        ({"op": "claim", "lease_id": "l", "block_ids": [0], "extra": 1}, "extra"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            sc.LeaseUse.decode(bad)
    for bad, field in [
        ({"op": "read", "lease_id": "l"}, "op"),
        ({"op": "release"}, "lease_id"),
        ({"op": "release", "lease_id": "l", "request_id": "r"}, "request_id"),
    ]:
        with pytest.raises(ValueError, match=f"^{field}: "):
            sc.LeaseEnd.decode(bad)


def test_the_bare_answers_are_the_carriers():
    assert sc.Accepted().to_wire() == {"ok": True}
    assert sc.unpack(sc.Accepted().encode()) == {"ok": True}
    assert sc.Refusal("no").to_wire() == {"ok": False, "error": "no"}
    assert sc.Refusal.of(sc.Accepted().to_wire()) is None
