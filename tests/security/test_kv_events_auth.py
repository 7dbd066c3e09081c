"""KV events: fleet members only, hashes without the prompt, on the KV address.

Before, a subscriber with no credential on an engine's events port received
the exact prompt token ids, on a port bound to every interface.
"""

from __future__ import annotations

import struct
import time

import msgpack
import zmq
from helpers.security_pair import post, prompt
from helpers.up import listening_addresses

from pdfleet.engine.contracts import security
from pdfleet.engine.contracts.block_hash import (
    external_block_hash,
    get_hash_fn,
    prompt_block_hashes,
)
from pdfleet.engine.contracts.kv_events import curve_server_keys


def subscriber(port: int, secret: bytes | None) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if secret is not None:
        public, private = zmq.curve_keypair()
        sub.setsockopt(zmq.CURVE_SERVERKEY, curve_server_keys(secret)[0])
        sub.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sub.setsockopt(zmq.CURVE_SECRETKEY, private)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{port}")
    return sub


def batches(sub: zmq.Socket, timeout: float) -> list:
    """The batches received until ``timeout`` seconds pass (from the first one on,
    half a second more at most: heartbeats never stop)."""
    out = []
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0 and sub.poll(int(left * 1000)):
        _topic, seq, payload = sub.recv_multipart()
        out.append((struct.unpack(">q", seq)[0], msgpack.unpackb(payload, raw=False)))
        deadline = min(deadline, time.monotonic() + 0.5)
    return out


def test_only_fleet_members_receive_events_and_they_carry_hashes_not_token_ids(pair):
    secret = security.fleet_secret_from_env()
    assert secret is not None
    member = subscriber(pair.events_port, secret)
    strangers = [
        subscriber(pair.events_port, None),
        subscriber(pair.events_port, b"another-fleets-secret-0123456789"),
    ]
    try:
        # Heartbeats every 0.2 s: a subscriber that may read them has some within
        # 1.5 s; neither a subscriber without a credential nor another fleet's does.
        for sub in strangers:
            assert batches(sub, 1.5) == []
        assert batches(member, 10.0), "a fleet member received no KV events"
        # The `*` endpoint binds the engine's KV address, never every interface.
        bound = {a for a, p in listening_addresses(pair.prefill.proc.pid) if p == pair.events_port}
        assert bound == {"127.0.0.1"}
        tokens = prompt(9501, 64)
        r = post(pair.prefill.url + "/v1/completions", {"prompt": tokens, "max_tokens": 1})
        assert r.status_code == 200, r.text
        want = {
            external_block_hash(h) for h in prompt_block_hashes(tokens, 16, get_hash_fn("sha256"))
        }
        stored = []
        for _ in range(20):
            for _seq, (_ts, events, _rank) in batches(member, 2.0):
                stored += [e for e in events if e["type"] == "BlockStored"]
            if want <= {h for e in stored for h in e["block_hashes"]}:
                break
        assert want <= {h for e in stored for h in e["block_hashes"]}
        assert all(e["token_ids"] == [] for e in stored)
        for sub in strangers:
            assert batches(sub, 0.5) == []
    finally:
        for sub in (member, *strangers):
            sub.close(0)
