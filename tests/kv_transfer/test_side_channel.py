"""The connector's side channel and handshake cache, in one process with real
connector objects (real ZMQ sockets, real NIXL agents in host memory)."""

from __future__ import annotations

import math
import time

import msgpack
import pytest
import torch
import zmq
from helpers.server import free_port, wait_until

from pdfleet.engine.config import EngineArgs
from pdfleet.engine.config.engine import pdfleet_version
from pdfleet.engine.contracts import kv_params, security
from pdfleet.engine.contracts.kv_connector import HandshakeReply
from pdfleet.engine.contracts.kv_side_channel import PROTOCOL_VERSION
from pdfleet.engine.kv_transfer.connector import PDConnector
from pdfleet.engine.kv_transfer.side_channel import SideChannelClient, secure_client


def engine_config(model: str, role: str, connector: str = "NixlConnector", **extra):
    kv = {"kv_connector": connector, "kv_role": role, "kv_port": free_port()}
    if extra:
        kv["kv_connector_extra_config"] = extra
    return EngineArgs(
        model=model, device="cpu", max_model_len=256, kv_transfer_config=kv
    ).create_engine_config("server")


def kv_buffer(config, num_blocks: int = 4) -> torch.Tensor:
    m = config.model_config
    shape = (m.num_hidden_layers, 2, num_blocks, config.cache_config.block_size)
    return torch.zeros(*shape, m.num_key_value_heads, m.head_dim, dtype=torch.float32)


def test_compat_factors_include_the_pdfleet_version_and_not_the_tp_size(tiny_model):
    config = engine_config(tiny_model, "kv_producer")
    factors = config.compat_factors()
    assert factors["pdfleet_version"] == pdfleet_version() != "0+unknown"
    assert not any("tensor_parallel" in k or k == "tp_size" for k in factors)


def test_a_connector_refuses_to_start_without_a_fleet_secret(tiny_model, monkeypatch):
    config = engine_config(tiny_model, "kv_consumer", "ZmqConnector")
    monkeypatch.delenv("PDFLEET_FLEET_SECRET")
    monkeypatch.delenv("PDFLEET_FLEET_SECRET_FILE", raising=False)
    with pytest.raises(ValueError, match="PDFLEET_FLEET_SECRET"):
        PDConnector(config)


def test_a_connector_refuses_to_bind_every_interface(tiny_model, monkeypatch):
    config = engine_config(tiny_model, "kv_producer", "ZmqConnector")
    monkeypatch.setenv("PDFLEET_KV_BIND_IP", "0.0.0.0")  # noqa: S104 (the refused address under test)
    with pytest.raises(ValueError, match="kv_ip"):
        PDConnector(config)


@pytest.fixture
def zmq_producer(tiny_model):
    config = engine_config(tiny_model, "kv_producer", "ZmqConnector")
    c = PDConnector(config)
    c.register(kv_buffer(config))
    yield c
    c.shutdown()


def raw(port: int, *frames: bytes, timeout_ms: int = 2000) -> dict:
    """One request from an unauthenticated DEALER (a CURVE client that knows the
    fleet's side-channel key, as any holder of the secret); the first reply frame."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, security.fleet_secret_from_env())
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send_multipart(list(frames))
        assert sock.poll(timeout_ms), "no answer"
        return msgpack.unpackb(sock.recv_multipart()[0], raw=False)
    finally:
        sock.close(0)


def pack(obj) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def test_an_unauthenticated_peer_gets_nothing_and_frees_nothing(zmq_producer):
    c = zmq_producer
    from pdfleet.engine.kv_transfer.connector import Lease

    c.held["victim-lease"] = Lease("victim", [0, 1], time.monotonic() + 60)
    port = c.port
    for op in ("handshake", "read", "claim", "confirm", "release"):
        reply = raw(port, pack({"op": op, "lease_id": "victim-lease", "block_ids": [0, 1]}))
        assert reply["ok"] is False and "not authenticated" in reply["error"]
    # A made-up session with a made-up MAC.
    body = pack({"op": "release", "lease_id": "victim-lease", "session": b"x" * 16, "seq": 1})
    assert "unknown session" in raw(port, body, b"\0" * 32)["error"]
    # The hello's challenge answered with a wrong proof.
    hello = {"op": "hello", "version": PROTOCOL_VERSION, "compat_hash": c.compat_hash}
    reply = raw(port, pack({**hello, "nonce": b"n" * 32, "engine_id": "e", "instance_id": "i"}))
    assert reply["ok"] and "agent_metadata" not in reply and "layout" not in reply
    hello_fields = {"engine_id": "e", "instance_id": "i", "compat_hash": c.compat_hash}
    auth = {
        "op": "auth",
        "session": reply["session"],
        "client_nonce": b"n" * 32,
        "nonce": reply["nonce"],
        "hello": pack({**hello_fields, "identity": None}),
        "cookie": reply["cookie"],
    }
    refused = raw(port, pack({**auth, "proof": b"p" * 32}))
    assert refused["ok"] is False and "authentication failed" in refused["error"]
    # A cookie that does not match what the server answered: no session at all.
    forged = raw(port, pack({**auth, "cookie": b"c" * 32, "proof": b"p" * 32}))
    assert forged["ok"] is False and "unknown session" in forged["error"]
    assert "victim-lease" in c.held and not c.freed


def test_the_hello_checks_version_and_compat_hash_naming_the_field(zmq_producer):
    c = zmq_producer
    base = {"op": "hello", "nonce": b"n" * 32, "engine_id": "e", "instance_id": "i"}
    reply = raw(c.port, pack({**base, "version": 1, "compat_hash": c.compat_hash}))
    assert reply["ok"] is False and reply["error"].startswith("version:")
    reply = raw(c.port, pack({**base, "version": PROTOCOL_VERSION, "compat_hash": "0" * 16}))
    assert reply["ok"] is False and reply["error"].startswith("compat_hash:")


def test_a_peer_with_another_secret_fails_both_ways(zmq_producer):
    c = zmq_producer
    wrong = SideChannelClient(b"another-fleets-secret-0123456789", "e", "i", c.compat_hash)
    try:
        # Its CURVE handshake fails (the server's key derives from the secret): no
        # answer at all, so it learns nothing.
        with pytest.raises(TimeoutError):
            wrong.connect("127.0.0.1", c.port, 1.0)
    finally:
        wrong.close()
    right = SideChannelClient(c.secret, "e", "i", c.compat_hash)
    try:
        reply, _ = right.connect("127.0.0.1", c.port, 2.0)
        # Only what a READ needs: no buffer address for the ZMQ transport.
        assert reply["engine_id"] == c.engine_id and "base_address" not in reply["layout"]
        typed = HandshakeReply.from_wire(reply)
        assert (typed.transport, typed.shards) == ("zmq", None)
        assert typed.to_wire() == reply  # one encoding, both ways
    finally:
        right.close()


def test_a_lease_binds_to_the_first_consumer_that_claims_it(zmq_producer):
    c = zmq_producer
    from pdfleet.engine.kv_transfer.connector import Lease

    c.held["L"] = Lease("victim", [0, 1], time.monotonic() + 60)
    first = SideChannelClient(c.secret, "decode-a", "1", c.compat_hash)
    second = SideChannelClient(c.secret, "decode-b", "1", c.compat_hash)
    try:
        for client in (first, second):
            client.connect("127.0.0.1", c.port, 2.0)
        first.call("127.0.0.1", c.port, {"op": "read", "lease_id": "L", "block_ids": [0]}, 2.0)
        with pytest.raises(RuntimeError, match="another consumer"):
            second.call("127.0.0.1", c.port, {"op": "read", "lease_id": "L", "block_ids": [0]}, 2)
        with pytest.raises(RuntimeError, match="ended"):
            second.call("127.0.0.1", c.port, {"op": "confirm", "lease_id": "L"}, 2.0)
        second.send_nowait("127.0.0.1", c.port, {"op": "release", "lease_id": "L"})
        with pytest.raises(RuntimeError, match="not held"):
            first.call("127.0.0.1", c.port, {"op": "read", "lease_id": "L", "block_ids": [3]}, 2)
        # A malformed message is refused naming its field, and holds nothing.
        with pytest.raises(RuntimeError, match="^read: block_ids: "):
            first.call("127.0.0.1", c.port, {"op": "read", "lease_id": "L", "block_ids": ["0"]}, 2)
        with pytest.raises(RuntimeError, match="^confirm: lease_id: "):
            first.call("127.0.0.1", c.port, {"op": "confirm", "lease_id": 5}, 2.0)
        assert "L" in c.held
        first.call("127.0.0.1", c.port, {"op": "confirm", "lease_id": "L"}, 2.0)
        assert "L" not in c.held and c.freed == ["victim"]
    finally:
        first.close()
        second.close()


class FromAddress(SideChannelClient):
    """A client whose connections leave from ``source`` (another loopback address)."""

    source = "127.0.0.2"

    def _sock(self, host, port):
        if (host, port) not in self.socks:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            secure_client(s, self.secret)
            s.connect(f"tcp://{self.source}:0;{host}:{port}")
            self.socks[(host, port)] = s
        return self.socks[(host, port)]


def test_without_identities_a_lease_binds_to_the_stated_ids_and_their_address(zmq_producer):
    # Another holder of the fleet secret states the real consumer's engine and
    # instance ids, from another address: the lease is not its to read, confirm
    # or release.
    c = zmq_producer
    from pdfleet.engine.kv_transfer.connector import Lease

    c.held["L"] = Lease("victim", [0, 1], time.monotonic() + 60)
    real = SideChannelClient(c.secret, "decode-a", "1", c.compat_hash)
    poser = FromAddress(c.secret, "decode-a", "1", c.compat_hash)
    try:
        for client in (real, poser):
            client.connect("127.0.0.1", c.port, 2.0)
        real.call("127.0.0.1", c.port, {"op": "claim", "lease_id": "L", "block_ids": [0]}, 2.0)
        with pytest.raises(RuntimeError, match="another consumer"):
            poser.call("127.0.0.1", c.port, {"op": "read", "lease_id": "L", "block_ids": [0]}, 2)
        with pytest.raises(RuntimeError, match="ended"):
            poser.call("127.0.0.1", c.port, {"op": "confirm", "lease_id": "L"}, 2.0)
        poser.send_nowait("127.0.0.1", c.port, {"op": "release", "lease_id": "L"})
        real.call("127.0.0.1", c.port, {"op": "confirm", "lease_id": "L"}, 2.0)
        assert c.freed == ["victim"]
    finally:
        real.close()
        poser.close()


def test_a_replayed_message_is_refused(zmq_producer):
    c = zmq_producer
    from pdfleet.engine.kv_transfer.connector import Lease

    c.held["L"] = Lease("victim", [0], time.monotonic() + 60)
    client = SideChannelClient(c.secret, "d", "1", c.compat_hash)
    try:
        client.connect("127.0.0.1", c.port, 2.0)
        frames, _ = client._signed("127.0.0.1", c.port, {"op": "claim", "lease_id": "L"})
        sock = client._sock("127.0.0.1", c.port)
        sock.send_multipart(frames)
        assert sock.poll(2000)
        sock.recv_multipart()
        assert "replayed" in raw(c.port, *frames)["error"]
    finally:
        client.close()


@pytest.mark.parametrize(("connector", "instances"), [("ZmqConnector", 100), ("NixlConnector", 20)])
def test_the_handshake_cache_stays_bounded_under_producer_churn(tiny_model, connector, instances):
    bound = 8 if instances > 20 else 4
    consumer_config = engine_config(tiny_model, "kv_consumer", connector, max_remote_engines=bound)
    consumer = PDConnector(consumer_config)
    buffer = kv_buffer(consumer_config)
    # The transfer thread's view, without starting the thread.
    from pdfleet.engine.kv_transfer.layout import KVLayout

    consumer.layout = KVLayout.of(buffer)
    consumer.transport.register(buffer, consumer.layout)
    client = SideChannelClient(
        consumer.secret, consumer.engine_id, consumer.instance_id, consumer.compat_hash
    )
    port = free_port()
    producer_config = engine_config(tiny_model, "kv_producer", connector)
    names = []
    try:
        for i in range(instances):
            # Every third instance restarts on the same address; the others move.
            if i % 3:
                port = free_port()
            producer_config.kv_transfer_config.kv_port = port
            producer = PDConnector(producer_config)
            producer.register(kv_buffer(producer_config))
            try:
                params = kv_params.KVTransferParams(
                    remote_engine_id=producer.engine_id,
                    remote_instance_id=producer.instance_id,
                    remote_host="127.0.0.1",
                    remote_port=port,
                )
                consumer._handshake(client, params, time.monotonic() + 5)
                # The producer's one shard agent (TP1), as the consumer added it.
                names.append(getattr(producer.transport, "agent_name", None))
                consumer._evict_remotes(client, busy=set())
                assert len(consumer.remotes) <= bound
                # An instance change on one address leaves one entry for it.
                assert sum(1 for k in consumer.remotes if k[3] == port) == 1
            finally:
                producer.shutdown()
        assert consumer.stats.handshakes == instances
        assert consumer.stats.remote_evictions == instances - len(consumer.remotes)

        def live_agents() -> int:
            agent = getattr(getattr(consumer.transport, "local", None), "agent", None)
            return sum(1 for n in names if agent and n and agent.check_remote_metadata(n))

        if connector == "NixlConnector":
            assert live_agents() == len(consumer.remotes)
        # An idle TTL of zero empties the cache and releases every remote agent.
        consumer.remote_idle_seconds = 0.0
        time.sleep(0.01)
        consumer._evict_remotes(client, busy=set())
        assert not consumer.remotes and live_agents() == 0
        assert len(client.socks) == 0
    finally:
        client.close()
        consumer.shutdown()


def test_a_repeated_request_id_never_takes_over_held_blocks(zmq_producer):
    from types import SimpleNamespace

    from pdfleet.engine.kv_transfer.connector import PDConnectorScheduler

    sched = PDConnectorScheduler(zmq_producer)
    request = SimpleNamespace(
        request_id="same",
        num_prompt_tokens=40,
        kv_transfer_params=kv_params.REMOTE_DECODE,
        block_hashes=[bytes([i]) * 32 for i in range(2)],
    )
    hold, first = sched.request_finished(request, [0, 1, 2])
    assert hold and first.remote_block_ids == (0, 1)
    # The lease names its content: the chain hash of its last block.
    assert first.to_wire()["pdfleet_block_chain"] == (b"\x01" * 32).hex()
    hold, second = sched.request_finished(request, [3, 4, 5])
    # The second is not held (its blocks are freed at once); the first lease is intact.
    assert not hold and second.remote_block_ids == ()
    assert [x.block_ids for x in zmq_producer.held.values()] == [[0, 1]]
    assert first.lease_id != second.lease_id
    assert kv_params.verify(zmq_producer.secret, first.to_wire()).lease_id in zmq_producer.held


def test_a_session_lasts_no_longer_than_its_identity_tokens_and_renewal_keeps_the_lease(
    tiny_model, tmp_path, monkeypatch
):
    # Short-lived tokens (1 s here, an hour in a cluster): the consumer's renewed
    # token replaces its old one; the client re-authenticates on it before the old
    # one expires, and its lease, bound to the subject, stays its own. A session
    # still resting on an expired token is refused.
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    from pdfleet.engine.contracts import identity
    from pdfleet.engine.kv_transfer.connector import Lease
    from pdfleet.engine.kv_transfer.identity_client import RenewableIdentity

    authority = identity.Authority.generate()
    path = tmp_path / "prefill.json"
    identity.EngineIdentity.issue(authority, "svc-prefill-0", "prefill", "svc", 3600).write(path)
    monkeypatch.setenv(identity.IDENTITY_AUTHORITY_ENV, authority.public_key)
    monkeypatch.setenv(identity.IDENTITY_FILE_ENV, str(path))
    config = engine_config(tiny_model, "kv_producer", "ZmqConnector")
    c = PDConnector(config)
    c.register(kv_buffer(config))

    def consumer(subject: str, ttl: float) -> RenewableIdentity:
        key = Ed25519PrivateKey.generate()
        raw_key = key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        token = authority.issue(subject, "decode", "svc", raw_key, ttl)
        return RenewableIdentity(key, token, identity.verify_token(authority.public_key, token))

    renewed, stale = consumer("svc-decode-0", 1.0), consumer("svc-decode-1", 1.0)
    clients = [
        SideChannelClient(
            c.secret, f"d{i}", "1", c.compat_hash, identity.FleetIdentity(authority.public_key, own)
        )
        for i, own in enumerate((renewed, stale))
    ]
    c.held["L"] = Lease("victim", [0], time.monotonic() + 60)
    try:
        for client in clients:
            client.connect("127.0.0.1", c.port, 2.0)
        clients[0].call("127.0.0.1", c.port, {"op": "claim", "lease_id": "L", "block_ids": [0]}, 2)
        first = renewed.claims.expires
        # The renewal: a new token for the same key and subject.
        token = authority.issue("svc-decode-0", "decode", "svc", renewed.claims.public_key, 60)
        renewed.renew(token, identity.verify_token(authority.public_key, token))
        # An old client that would never re-authenticate.
        clients[1].sessions["127.0.0.1", c.port].renew_at = math.inf
        assert wait_until(lambda: time.time() > first + 0.05, timeout=5)
        reply, _ = clients[0].call("127.0.0.1", c.port, {"op": "confirm", "lease_id": "L"}, 2.0)
        assert reply["ok"] and c.freed == ["victim"]
        with pytest.raises(RuntimeError, match="identity token has expired"):
            clients[1].call("127.0.0.1", c.port, {"op": "confirm", "lease_id": "M"}, 2.0)
        # A renewal for another subject (or key) is not a renewal.
        other = authority.issue("svc-decode-9", "decode", "svc", renewed.claims.public_key, 60)
        with pytest.raises(ValueError, match="svc-decode-9"):
            renewed.renew(other, identity.verify_token(authority.public_key, other))
    finally:
        for client in clients:
            client.close()
        c.shutdown()


def test_the_connector_snapshot_is_what_the_engine_exports(zmq_producer):
    """The metrics exporter reads the connector only through its snapshot:
    counters (refused reads with the server's own), gauges, the pulls'
    durations (drained by the snapshot) and the block size."""
    from prometheus_client import generate_latest

    from pdfleet.engine.contracts import metrics as m
    from pdfleet.engine.kv_transfer.connector import PDConnectorScheduler
    from pdfleet.engine.metrics import EngineMetrics

    c = zmq_producer
    with c.lock:
        c.stats.transfers, c.stats.bytes_transferred, c.stats.refused_reads = 3, 4096, 2
        c.stats.transfer_seconds = [0.5, 0.25]
        c.stats.per_producer["p"] = [1.0, 2048.0, 0.5]
        c.active["r"] = 2
        c.quarantined.add("r")
    assert c.server is not None
    c.server.num_rejected = 1
    side = PDConnectorScheduler(c)
    snapshot = side.stats_snapshot()
    assert snapshot.transfers == 3 and snapshot.refused_reads == 3
    assert snapshot.transfer_seconds == (0.5, 0.25) and c.stats.transfer_seconds == []
    assert snapshot.pulls_in_flight == 1 and snapshot.quarantined_blocks == 2
    assert snapshot.block_bytes == c.bytes_per_block and snapshot.shard_bytes == ()
    assert side.stats_snapshot().transfer_seconds == ()  # drained
    with c.lock:
        c.active.clear()
        c.quarantined.clear()
    metrics = EngineMetrics(c.config)
    metrics._update_kv(snapshot)
    samples = m.parse_metrics(generate_latest(metrics.registry).decode()).samples

    def value(metric: m.Metric, suffix: str = "") -> float:
        return sum(v for _, v in samples[metric.name + suffix])

    assert value(m.ENGINE_KV_TRANSFERS) == 3
    assert value(m.ENGINE_KV_TRANSFER_BYTES) == 4096
    assert value(m.ENGINE_KV_SIDE_CHANNEL_REFUSED) == 3
    assert value(m.ENGINE_KV_PULLS_IN_FLIGHT) == 1
    assert value(m.ENGINE_KV_QUARANTINED_BLOCKS) == 2
    assert value(m.ENGINE_KV_BLOCK_BYTES) == c.bytes_per_block
    assert value(m.ENGINE_KV_TRANSFER_SECONDS, "_count") == 2
