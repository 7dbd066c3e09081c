"""The KV side channel before authentication: bounded messages, no half-open table.

Before, one 400 MiB message raised the prefill engine's peak memory by
800 MiB, and 300 unauthenticated hellos pushed a real peer's half-open
handshake out of a 256-entry table (its pull then recomputed). A peer without
the fleet secret now cannot even complete ZeroMQ's CURVE handshake; one that
holds it (an insider without a session) meets the size bounds and the
stateless cookies.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import msgpack
import zmq
from helpers.security_pair import post, prefill_leg, prompt, text_of

from pdfleet.engine.contracts import identity, security
from pdfleet.engine.contracts.kv_side_channel import PROTOCOL_VERSION
from pdfleet.engine.kv_transfer.side_channel import SideChannelClient, secure_client

TRANSFERS = "pdfleet_engine_kv_transfers_total"


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


def body(seed: int) -> dict:
    return {"prompt": prompt(seed), "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def pd_still_works(pair, seed: int) -> None:
    a = body(seed)
    params = prefill_leg(pair, a)
    before = pair.metric("decode", TRANSFERS)
    got = text_of(post(pair.decode.url + "/v1/completions", {**a, "kv_transfer_params": params}))
    assert got == text_of(post(pair.prefill.url + "/v1/completions", a))
    assert pair.metric("decode", TRANSFERS) == before + 1


def test_an_oversized_message_before_authentication_costs_the_producer_no_memory(pair):
    pid = pair.prefill.proc.pid
    before = peak_rss_mib(pid)
    port = pair.kv_ports["prefill"]
    hello = msgpack.packb({"op": "hello", "version": PROTOCOL_VERSION, "pad": "z" * 65536})
    ctx = zmq.Context.instance()
    outsider, insider = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    secure_client(insider, security.fleet_secret_from_env())
    for sock in (outsider, insider):
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        # No fleet secret: 128 MiB in 128 frames (ZeroMQ would buffer a multipart
        # message whole), then a hello; nothing gets past the CURVE handshake.
        # Its sends may find no pipe at all once ZeroMQ has dropped the failed
        # handshake (a DEALER then blocks): bound them, and an unsent message is
        # as good as a refused one.
        outsider.setsockopt(zmq.SNDTIMEO, 2000)
        for frames in ([b"y" * (1 << 20)] * 128, [hello]):
            with contextlib.suppress(zmq.Again):
                outsider.send_multipart(frames)
        # With the secret but no session: one 128 MiB frame, then the padded hello.
        insider.send(b"\x81" + b"x" * (128 << 20))
        insider.send(hello)
        assert insider.poll(10000), "the side channel did not answer the padded hello"
        reply = msgpack.unpackb(insider.recv_multipart()[-1], raw=False)
        assert not outsider.poll(1000), "a peer without the fleet secret got an answer"
        assert peak_rss_mib(pid) - before < 48, (before, peak_rss_mib(pid))
        assert reply["ok"] is False and "at most" in reply["error"]
    finally:
        outsider.close(0)
        insider.close(0)
    pd_still_works(pair, 9401)


class FloodedClient(SideChannelClient):
    """A real consumer whose handshake is interrupted, between its hello and its
    auth, by a flood of unauthenticated hellos from another socket."""

    flood = 0

    def _exchange(self, host, port, frames, timeout):
        got = super()._exchange(host, port, frames, timeout)
        if frames and b"hello" in frames[0][:40] and self.flood:
            # An insider (holds the fleet secret, has no session): an outsider
            # cannot even reach the hello.
            attacker = self.ctx.socket(zmq.DEALER)
            secure_client(attacker, self.secret)
            attacker.setsockopt(zmq.LINGER, 0)
            attacker.connect(f"tcp://{host}:{port}")
            hello = {
                "op": "hello",
                "version": PROTOCOL_VERSION,
                "compat_hash": self.hello.compat_hash,
                "engine_id": "flood",
                "instance_id": "flood",
                "identity": None,
            }
            answered = 0
            for i in range(self.flood):
                attacker.send(msgpack.packb({**hello, "nonce": i.to_bytes(32, "big")}))
            while answered < self.flood and attacker.poll(5000):
                attacker.recv_multipart()
                answered += 1
            attacker.close(0)
            assert answered == self.flood
        return got


def test_a_flood_of_hellos_cannot_push_out_a_real_peers_handshake(pair):
    params = prefill_leg(pair, body(9402))
    own = identity.EngineIdentity.issue(pair.authority, "sec/flooded", "decode", "sec", 60)
    secret = security.fleet_secret_from_env()
    assert secret is not None
    client = FloodedClient(
        secret,
        "sec-flooded",
        "i-1",
        params["pdfleet_compat_hash"],
        identity.FleetIdentity(pair.authority.public_key, own),
    )
    client.flood = 1000
    try:
        reply, _ = client.connect("127.0.0.1", pair.kv_ports["prefill"], 30.0)
        assert reply["ok"] and reply["engine_id"] == params["remote_engine_id"]
        # The session works: this peer may now claim the lease it was given (and
        # gives it back).
        lease = {"lease_id": params["pdfleet_lease_id"], "block_ids": []}
        chain = params["pdfleet_block_chain"]  # the leased blocks' (the producer checks it)
        client.call(
            "127.0.0.1", pair.kv_ports["prefill"], {"op": "claim", **lease, "chain": chain}, 5.0
        )
        client.send_nowait("127.0.0.1", pair.kv_ports["prefill"], {"op": "release", **lease})
    finally:
        client.close()
    pd_still_works(pair, 9403)
