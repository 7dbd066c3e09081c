"""Prefill and decode servers joined by a real connector (NIXL in host memory, or ZMQ)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from helpers.server import ServerProcess, fleet_headers, free_port, scrape, stop_all, wait_until

from pdfleet.engine.contracts import kv_params, security
from pdfleet.engine.contracts.kv_params import KVTransferParams

MAX_LEN = 512


def post(url: str, **kw) -> httpx.Response:
    """A direct call to an engine, with the fleet token (as the gateway sends it)."""
    return httpx.post(url, headers=fleet_headers(), **kw)


def open_stream(method: str, url: str, **kw):
    return httpx.stream(method, url, headers=fleet_headers(), **kw)


def kv_args(connector: str, role: str, port: int, **extra) -> list[str]:
    cfg = {"kv_connector": connector, "kv_role": role, "kv_port": port}
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return ["--kv-transfer-config", json.dumps(cfg)]


def serve(model: str, log_dir, name: str, *extra: str, port: int | None = None) -> ServerProcess:
    return ServerProcess(
        ["serve", model, "--max-model-len", str(MAX_LEN), "--disable-log-stats", *extra],
        log_dir,
        name,
        port=port,
    )


@pytest.fixture(scope="module")
def agg(tiny_model, tmp_path_factory):
    """The aggregated reference engine of the whole module (both connectors'
    fleets and the failure tests'); started, not waited for: those who use it
    wait for it with their own engines, its start overlapping theirs."""
    engine = serve(tiny_model, tmp_path_factory.mktemp("pd-agg"), "agg")
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module", params=["NixlConnector", "ZmqConnector"])
def fleet(request, tiny_model, tmp_path_factory, agg):
    connector = request.param
    logs = tmp_path_factory.mktemp(f"pd-{connector}")
    kv_ports = {"prefill": free_port(), "decode": free_port()}
    procs = {
        "prefill": serve(
            tiny_model,
            logs,
            "prefill",
            *kv_args(connector, "kv_producer", kv_ports["prefill"], lease_seconds=10),
        ),
        # A bandwidth floor no pull can reach: the decode engine reports KVTransferDegraded.
        "decode": serve(
            tiny_model,
            logs,
            "decode",
            *kv_args(
                connector,
                "kv_consumer",
                kv_ports["decode"],
                min_pull_gbps=1e6,
                bandwidth_min_pull_bytes=0,
            ),
        ),
    }
    # The `faulty` fixture's pair starts now too (one wait for all the starts).
    faulty_pair = start_faulty(tiny_model, connector, logs)
    try:
        for p in [*procs.values(), agg]:
            p.wait_healthy()
        yield {k: p.url for k, p in procs.items()} | {
            "agg": agg.url,
            "connector": connector,
            "procs": procs,
            "kv_ports": kv_ports,
            "logs": logs,
            "faulty": faulty_pair,
        }
    finally:
        stop_all([*procs.values(), faulty_pair["producer"], faulty_pair["consumer"]])


def two_legs(fleet, body: dict, stream: bool = False, endpoint: str = "/v1/completions"):
    """The gateway's two-leg protocol (docs/architecture.md), done by hand."""
    pre = post(
        fleet["prefill"] + endpoint,
        timeout=60,
        json={
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        },
    )
    assert pre.status_code == 200, pre.text
    params = pre.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    decode_body = {**body, "kv_transfer_params": params}
    if not stream:
        r = post(fleet["decode"] + endpoint, json=decode_body, timeout=60)
        assert r.status_code == 200, r.text
        return params, r.json()["choices"][0][
            "text" if "completions" in endpoint and "chat" not in endpoint else "message"
        ]
    text = ""
    with open_stream(
        "POST", fleet["decode"] + endpoint, json={**decode_body, "stream": True}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                for c in chunk["choices"]:
                    text += c.get("text") or c.get("delta", {}).get("content") or ""
    return params, text


def aggregated(fleet, body: dict) -> str:
    r = post(fleet["agg"] + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


WORDS = [
    "the",
    "harbor",
    "was",
    "quiet",
    "before",
    "dawn",
    "and",
    "boats",
    "rocked",
    "against",
    "the",
    "pier",
]


def prompt_of(n_tokens_hint: int, seed: int) -> list[int]:
    # Token-id prompts give exact lengths: shorter than a block, exact multiples, long.
    return [(seed * 131 + i * 17) % 1700 + 20 for i in range(n_tokens_hint)]


LENGTHS = [3, 10, 15, 16, 17, 31, 32, 33, 48, 64, 65, 100, 127, 128, 200, 300]


def test_two_leg_protocol_is_token_identical_to_one_engine(fleet):
    async def run_all():
        async def one(i: int, n: int):
            body = {
                "prompt": prompt_of(n, i),
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            }
            ref = await asyncio.to_thread(aggregated, fleet, body)
            params, text = await asyncio.to_thread(two_legs, fleet, body, i % 2 == 1)
            return n, params, text, ref

        return await asyncio.gather(*(one(i, n) for i, n in enumerate(LENGTHS)))

    for n, params, text, ref in asyncio.run(run_all()):
        assert text == ref, f"prompt of {n} tokens"
        assert len(params["remote_block_ids"]) == (n - 1) // 16
    d = scrape(fleet["decode"])
    assert d["pdfleet_engine_kv_transfers_total"] >= sum(1 for n in LENGTHS if (n - 1) // 16)
    assert d["pdfleet_engine_kv_transfer_blocks_pulled_total"] > 0
    # Every lease was claimed: the producer's blocks are free again.
    assert wait_until(
        lambda: scrape(fleet["prefill"])["pdfleet_engine_kv_cache_usage_ratio"] == 0, 10
    )
    assert scrape(fleet["prefill"])["pdfleet_engine_kv_transfer_expired_leases_total"] == 0


def test_pull_bandwidth_under_the_floor_raises_kv_transfer_degraded(fleet):
    body = {"prompt": prompt_of(70, 901), "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    two_legs(fleet, body)
    d = scrape(fleet["decode"])
    assert d["pdfleet_engine_kv_pull_bandwidth_bytes_per_second"] > 0
    assert d["pdfleet_engine_kv_transfer_degraded"] == 1
    # The producer pulls nothing and has no floor.
    assert scrape(fleet["prefill"])["pdfleet_engine_kv_transfer_degraded"] == 0


def test_chat_through_both_legs(fleet):
    body = {
        "messages": [{"role": "user", "content": " ".join(WORDS * 3)}],
        "max_tokens": 8,
        "temperature": 0,
    }
    _, message = two_legs(fleet, body, endpoint="/v1/chat/completions")
    ref = post(fleet["agg"] + "/v1/chat/completions", json=body, timeout=60).json()
    assert message["content"] == ref["choices"][0]["message"]["content"]


def test_decode_prefix_cache_reduces_blocks_pulled(fleet):
    base = prompt_of(96, 777)
    body = {"prompt": base, "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    two_legs(fleet, body)
    before = scrape(fleet["decode"])["pdfleet_engine_kv_transfer_blocks_pulled_total"]
    longer = {**body, "prompt": base + prompt_of(40, 778)}  # 136 tokens: 8 full blocks
    _, text = two_legs(fleet, longer)
    pulled = scrape(fleet["decode"])["pdfleet_engine_kv_transfer_blocks_pulled_total"] - before
    # The first 6 blocks are already cached on the decode engine: only 2 are pulled.
    assert pulled == 2
    assert text == aggregated(fleet, longer)


def test_unclaimed_lease_frees_the_producers_blocks(fleet):
    pre = post(
        fleet["prefill"] + "/v1/completions",
        timeout=60,
        json={
            "prompt": prompt_of(80, 999),
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    ).json()
    assert len(pre["kv_transfer_params"]["remote_block_ids"]) == 4
    assert scrape(fleet["prefill"])["pdfleet_engine_kv_cache_usage_ratio"] > 0
    assert wait_until(
        lambda: scrape(fleet["prefill"])["pdfleet_engine_kv_transfer_expired_leases_total"] >= 1,
        15,
    )
    assert scrape(fleet["prefill"])["pdfleet_engine_kv_cache_usage_ratio"] == 0


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"do_remote_prefill": True}, "not signed"),
        ({"do_remote_decode": True}, "not a KV producer"),
    ],
)
def test_bad_kv_transfer_params_are_a_400(fleet, params, message):
    r = post(
        fleet["decode"] + "/v1/completions",
        timeout=30,
        json={"prompt": "hello", "max_tokens": 2, "kv_transfer_params": params},
    )
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "kv_transfer_params"  # what the gateway checks


def producer_args(kv_port: int | None = None) -> list[str]:
    return kv_args(
        "NixlConnector",
        "kv_producer",
        kv_port or free_port(),
        lease_seconds=5,
        params_grace_seconds=600,  # stale params stay authentic on a slow machine
    )


@pytest.fixture(scope="module")
def nixl_pair(tiny_model, tmp_path_factory, agg):
    """A consumer with each failure policy, and the aggregated reference; and the
    engines the tests below kill, freeze, restart or drain, one each (``spare``),
    all started side by side: one engine's start is mostly waiting on one core."""
    logs = tmp_path_factory.mktemp("pd-failures")
    restart_ports = {"http": free_port(), "kv": free_port()}
    procs = {
        "recompute": serve(
            tiny_model, logs, "d-recompute", *kv_args("NixlConnector", "kv_consumer", free_port())
        ),
        "fail": serve(
            tiny_model,
            logs,
            "d-fail",
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": "NixlConnector",
                    "kv_role": "kv_consumer",
                    "kv_port": free_port(),
                    "kv_load_failure_policy": "fail",
                }
            ),
        ),
    }
    spare = {
        "doomed": serve(tiny_model, logs, "doomed", *producer_args()),
        "frozen": serve(tiny_model, logs, "frozen", *producer_args()),
        "first": serve(
            tiny_model,
            logs,
            "first",
            *producer_args(restart_ports["kv"]),
            port=restart_ports["http"],
        ),
        "p16": serve(tiny_model, logs, "p16", *producer_args()),
        "d32": serve(
            tiny_model,
            logs,
            "d32",
            "--block-size",
            "32",
            *kv_args("NixlConnector", "kv_consumer", free_port()),
        ),
        "draining": serve(
            tiny_model,
            logs,
            "draining",
            *kv_args("NixlConnector", "kv_producer", free_port(), lease_seconds=20),
        ),
    }
    try:
        for p in [*procs.values(), *spare.values(), agg]:
            p.wait_healthy()
        yield (
            {k: p.url for k, p in procs.items()}
            | {"agg": agg.url, "logs": logs, "spare": spare, "restart_ports": restart_ports}
        )
    finally:
        stop_all([*procs.values(), *spare.values()])


def start_producer(model, logs, http_port=None, kv_port=None, name="prefill") -> ServerProcess:
    return serve(model, logs, name, *producer_args(kv_port), port=http_port).wait_healthy()


def prefill(url: str, body: dict) -> dict:
    r = post(
        url + "/v1/completions",
        timeout=60,
        json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
    )
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_producer_killed_recompute_completes_and_fail_errors_in_bound(tiny_model, nixl_pair):
    producer = nixl_pair["spare"]["doomed"]
    body = {"prompt": prompt_of(120, 5), "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    params = prefill(producer.url, body)
    os.kill(producer.proc.pid, signal.SIGKILL)
    producer.stop()
    ref = post(nixl_pair["agg"] + "/v1/completions", json=body, timeout=60).json()
    r = post(
        nixl_pair["recompute"] + "/v1/completions",
        timeout=60,
        json={**body, "kv_transfer_params": params},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    assert (
        scrape(nixl_pair["recompute"])["pdfleet_engine_kv_transfer_handshake_failures_total"] >= 1
    )
    start = time.monotonic()
    r = post(
        nixl_pair["fail"] + "/v1/completions",
        timeout=60,
        json={**body, "kv_transfer_params": params},
    )
    elapsed = time.monotonic() - start
    assert r.status_code == 502 and "kv_load_failure_policy is fail" in r.json()["error"]["message"]
    assert elapsed < 5.0
    # A stream with the fail policy ends with an error event, not a hang.
    with open_stream(
        "POST",
        nixl_pair["fail"] + "/v1/completions",
        timeout=30,
        json={**body, "stream": True, "kv_transfer_params": params},
    ) as s:
        lines = [line for line in s.iter_lines() if line]
    assert "error" in json.loads(lines[-2][6:]) and lines[-1] == "data: [DONE]"


def test_producer_frozen_before_the_handshake_is_bounded(tiny_model, nixl_pair):
    producer = nixl_pair["spare"]["frozen"]
    try:
        body = {"prompt": prompt_of(160, 6), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        params = prefill(producer.url, body)
        os.kill(producer.proc.pid, signal.SIGSTOP)  # alive but silent: the handshake hangs
        start = time.monotonic()
        r = post(
            nixl_pair["recompute"] + "/v1/completions",
            timeout=60,
            json={**body, "kv_transfer_params": params},
        )
        assert r.status_code == 200 and time.monotonic() - start < 8
        ref = post(nixl_pair["agg"] + "/v1/completions", json=body, timeout=60).json()
        assert r.json()["choices"][0]["text"] == ref["choices"][0]["text"]
    finally:
        os.kill(producer.proc.pid, signal.SIGCONT)
        producer.stop()


def test_restarted_producer_on_the_same_address(tiny_model, nixl_pair):
    http_port, kv_port = nixl_pair["restart_ports"]["http"], nixl_pair["restart_ports"]["kv"]

    def body(seed: int) -> dict:
        return {
            "prompt": prompt_of(90, seed),
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        }

    def expected(seed: int) -> str:
        r = post(nixl_pair["agg"] + "/v1/completions", json=body(seed), timeout=60)
        return r.json()["choices"][0]["text"]

    def pd(producer_url: str, seed: int, params: dict | None = None) -> str:
        params = params or prefill(producer_url, body(seed))
        r = post(
            nixl_pair["recompute"] + "/v1/completions",
            timeout=60,
            json={**body(seed), "kv_transfer_params": params},
        )
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def transfers() -> float:
        return scrape(nixl_pair["recompute"])["pdfleet_engine_kv_transfers_total"]

    first = nixl_pair["spare"]["first"]
    assert pd(first.url, 80) == expected(80)
    stale = prefill(first.url, body(81))
    first.stop()
    second = start_producer(tiny_model, nixl_pair["logs"], http_port, kv_port, "second")
    try:
        # A new handshake with the new instance on the same address.
        before = transfers()
        assert pd(second.url, 82) == expected(82)
        assert transfers() == before + 1
        # Params naming the old instance are refused and recomputed, still correct.
        assert pd(second.url, 81, stale) == expected(81)
        assert transfers() == before + 1
    finally:
        second.stop()


def test_incompatible_engines_are_refused_naming_the_field(nixl_pair):
    producer, consumer = nixl_pair["spare"]["p16"], nixl_pair["spare"]["d32"]
    try:
        body = {"prompt": prompt_of(100, 9), "max_tokens": 3, "temperature": 0}
        params = prefill(producer.url, body)
        r = post(
            consumer.url + "/v1/completions",
            timeout=30,
            json={**body, "kv_transfer_params": params},
        )
        assert r.status_code == 400 and "block_size" in r.json()["error"]["message"]
        # Params without the factors are altered params: refused before any dial.
        bare = {k: v for k, v in params.items() if k != "pdfleet_compat"}
        r = post(
            consumer.url + "/v1/completions", timeout=30, json={**body, "kv_transfer_params": bare}
        )
        assert r.status_code == 400 and "signature" in r.json()["error"]["message"]
        assert scrape(consumer.url).get("pdfleet_engine_kv_transfers_total", 0) == 0
        assert scrape(consumer.url).get("pdfleet_engine_kv_transfer_handshakes_total", 0) == 0
    finally:
        producer.stop()
        consumer.stop()


# -- security: kv_transfer_params and the side channel (both connectors) -------------


def decode(url: str, body: dict, params: dict) -> httpx.Response:
    return post(url + "/v1/completions", timeout=60, json={**body, "kv_transfer_params": params})


@contextlib.contextmanager
def trap_port():
    """A listening socket of the test: any connection to it is a server-side request."""
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen()
        trap.setblocking(False)
        yield trap


def sign(secret: bytes, wire: dict, ttl: float) -> dict:
    """``wire`` signed as a producer with ``secret`` would."""
    return kv_params.sign(secret, KVTransferParams.from_wire(wire), ttl).to_wire()


def dialled(trap: socket.socket) -> bool:
    try:
        conn, _ = trap.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


def refusal(r: httpx.Response, stream: bool) -> str:
    """The error message of a refused request (a 400, or a stream's first event)."""
    if r.status_code == 200 and stream:  # refused before the first token
        return json.loads(r.text.split("\n")[0].removeprefix("data: "))["error"]["message"]
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


def test_forged_altered_or_expired_params_are_a_400_and_nothing_is_dialled(fleet):
    secret = security.fleet_secret_from_env()
    body = {"prompt": prompt_of(70, 41), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    before = scrape(fleet["decode"])
    with trap_port() as trap:
        port = trap.getsockname()[1]
        real = prefill(fleet["prefill"], body)
        for params in (
            {**real, "remote_port": port},
            {**real, "remote_block_ids": [0, 1, 2, 3]},
            {**real, "remote_request_id": "another-request"},
        ):
            message = refusal(decode(fleet["decode"], body, params), False)
            assert message.startswith("kv_transfer_params:") and "signature" in message
        # The lease those params named was never touched: the real decode leg pulls it.
        r = decode(fleet["decode"], body, real)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == aggregated(fleet, body)
        ssrf = {
            "do_remote_prefill": True,
            "remote_engine_id": "x",
            "remote_host": "127.0.0.1",
            "remote_port": port,
            "remote_block_ids": [0, 1, 2],
            "remote_request_id": "x",
            "pdfleet_lease_id": "x",
        }
        for params, why in (
            (ssrf, "not signed"),
            (sign(b"another-fleet-secret-0123456789", ssrf, 30), "signature"),
            (sign(secret, ssrf, ttl=-1), "expired"),
        ):
            for stream in (False, True):
                r = decode(fleet["decode"], {**body, "stream": stream}, params)
                message = refusal(r, stream)
                assert message.startswith("kv_transfer_params:") and why in message
        assert not dialled(trap)
    after = scrape(fleet["decode"])
    assert after["pdfleet_engine_kv_transfers_total"] == (
        before["pdfleet_engine_kv_transfers_total"] + 1
    )
    for name in ("transfer_handshake_failures", "transfer_failures"):
        key = f"pdfleet_engine_kv_{name}_total"
        assert after.get(key, 0) == before.get(key, 0), key


def raw_dealer(port: int, message: dict, timeout_ms: int = 2000) -> dict:
    """One message from a peer that holds the fleet secret (it passes the side
    channel's CURVE handshake) but has no session."""
    from pdfleet.engine.kv_transfer.side_channel import secure_client

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client(sock, security.fleet_secret_from_env())
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        sock.send(msgpack.packb(message, use_bin_type=True))
        assert sock.poll(timeout_ms), "the side channel did not answer"
        return msgpack.unpackb(sock.recv_multipart()[0], raw=False)
    finally:
        sock.close(0)


def test_another_requests_blocks_cannot_be_read_or_freed_by_naming_them(fleet):
    victim = {"prompt": prompt_of(90, 42), "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    attacker = {**victim, "prompt": prompt_of(90, 43)}
    v = prefill(fleet["prefill"], victim)
    a = prefill(fleet["prefill"], attacker)
    # The attacker's own params with the victim's blocks or lease: refused.
    for field in ("remote_block_ids", "pdfleet_lease_id", "remote_request_id"):
        r = decode(fleet["decode"], attacker, {**a, field: v[field]})
        assert r.status_code == 400 and "signature" in r.json()["error"]["message"]
    # A raw peer naming the victim on the side channel gets nothing and frees nothing.
    kv_port = fleet["kv_ports"]["prefill"]
    for message in (
        {"op": "release", "request_id": v["remote_request_id"]},
        {"op": "release", "lease_id": v["pdfleet_lease_id"]},
        {"op": "read", "lease_id": v["pdfleet_lease_id"], "block_ids": v["remote_block_ids"]},
        {"op": "handshake"},
    ):
        reply = raw_dealer(kv_port, message)
        assert reply["ok"] is False and "not authenticated" in reply["error"]
        assert "agent_metadata" not in reply and "layout" not in reply
    if fleet["connector"] == "NixlConnector":
        # A standalone NIXL agent asking the producer's port for its metadata.
        from nixl_cu12._api import nixl_agent, nixl_agent_config

        agent = nixl_agent(
            "intruder", nixl_agent_config(enable_listen_thread=True, listen_port=free_port())
        )
        name = f"{v['remote_engine_id']}-{v['remote_instance_id']}"
        agent.fetch_remote_metadata(name, "127.0.0.1", kv_port)
        assert not wait_until(lambda: agent.check_remote_metadata(name), 1.5)
    before = scrape(fleet["decode"])["pdfleet_engine_kv_transfers_total"]
    for body, params in ((victim, v), (attacker, a)):
        r = decode(fleet["decode"], body, params)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == aggregated(fleet, body)
    # Both leases were still held: both pulls succeeded (no recompute).
    assert scrape(fleet["decode"])["pdfleet_engine_kv_transfers_total"] == before + 2
    assert scrape(fleet["prefill"])["pdfleet_engine_kv_side_channel_refused_total"] >= 4


def listening_addresses(pid: int) -> dict[int, str]:
    """{port: address} of the TCP sockets process ``pid`` listens on (/proc/net/tcp*)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)
            if len(raw) == 4:
                ip = socket.inet_ntop(socket.AF_INET, raw[::-1])
            else:
                ip = socket.inet_ntop(
                    socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                )
            out[int(hex_port, 16)] = ip
    return out


def test_kv_side_channel_and_ucx_listen_only_on_loopback(fleet):
    for role in ("prefill", "decode"):
        proc = fleet["procs"][role]
        ports = listening_addresses(proc.proc.pid)
        ports.pop(proc.port, None)  # the HTTP port binds --host
        assert all(ip == "127.0.0.1" for ip in ports.values()), (role, ports)
        if role == "prefill":
            assert ports.get(fleet["kv_ports"]["prefill"]) == "127.0.0.1"
        if fleet["connector"] == "NixlConnector":
            assert ports, "UCX opened no listener"  # and it is on loopback, as checked


# -- faults: leases at pull time, quarantined pull targets (both connectors) -----------


def start_faulty(tiny_model: str, connector: str, logs: Path) -> dict:
    """Start (not wait for) a producer with 1 s leases and a small cache, and a
    consumer whose READs can be delayed on demand (the transports' test hook) and
    whose pool is small."""
    delay = logs / "read-delay"
    delay.write_text("0")
    producer = serve(
        tiny_model,
        logs,
        "p-1s",
        "--max-model-len",
        "256",
        "--num-gpu-blocks-override",
        "20",
        *kv_args(connector, "kv_producer", free_port(), lease_seconds=1),
    )
    consumer = ServerProcess(
        [
            "serve",
            tiny_model,
            "--max-model-len",
            "256",
            "--disable-log-stats",
            "--num-gpu-blocks-override",
            "40",
            *kv_args(
                connector,
                "kv_consumer",
                free_port(),
                handshake_timeout_seconds=1,
                transfer_timeout_seconds=3,
                quarantine_timeout_seconds=2.5,
            ),
        ],
        logs,
        "d-delayed",
        env={"PDFLEET_KV_TEST_READ_DELAY_FILE": str(delay)},
    )
    return {"producer": producer, "consumer": consumer, "delay": delay}


@pytest.fixture(scope="module")
def faulty(fleet):
    """The fleet's faulty pair (started with it, its start overlapping theirs)."""
    pair = fleet["faulty"]
    producer, consumer = pair["producer"], pair["consumer"]
    try:
        producer.wait_healthy()
        consumer.wait_healthy()
        yield {"prefill": producer.url, "decode": consumer.url, "delay": pair["delay"]}
    finally:
        producer.stop()
        consumer.stop()


def metric(url: str, name: str) -> float:
    return scrape(url).get(name, 0.0)


def churn_producer(url: str, seed: int) -> None:
    """Fill the producer's small cache with other prompts, reusing its free blocks."""
    for i in range(4):
        post(
            url + "/v1/completions",
            timeout=60,
            json={"prompt": prompt_of(150, seed + i), "max_tokens": 1},
        ).raise_for_status()


def test_a_pull_after_the_lease_expired_recomputes_and_is_not_a_transfer(fleet, faulty):
    body = {"prompt": prompt_of(120, 51), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    expired = metric(faulty["prefill"], "pdfleet_engine_kv_transfer_expired_leases_total")
    params = prefill(faulty["prefill"], body)
    assert wait_until(
        lambda: (
            metric(faulty["prefill"], "pdfleet_engine_kv_transfer_expired_leases_total") > expired
        ),
        10,
    )
    churn_producer(faulty["prefill"], 600)
    transfers = metric(faulty["decode"], "pdfleet_engine_kv_transfers_total")
    r = decode(faulty["decode"], body, params)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == aggregated(fleet, body)
    assert metric(faulty["decode"], "pdfleet_engine_kv_transfers_total") == transfers


def test_a_lease_that_expires_mid_pull_is_not_confirmed_and_recomputes(fleet, faulty):
    body = {"prompt": prompt_of(120, 52), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    expired = metric(faulty["prefill"], "pdfleet_engine_kv_transfer_expired_leases_total")
    transfers = metric(faulty["decode"], "pdfleet_engine_kv_transfers_total")
    unconfirmed = metric(faulty["decode"], "pdfleet_engine_kv_transfer_unconfirmed_total")
    faulty["delay"].write_text("2")
    try:
        params = prefill(faulty["prefill"], body)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(decode, faulty["decode"], body, params)
            # The lease lapses while the READ is delayed; others reuse its blocks.
            assert wait_until(
                lambda: (
                    metric(faulty["prefill"], "pdfleet_engine_kv_transfer_expired_leases_total")
                    > expired
                ),
                10,
            )
            churn_producer(faulty["prefill"], 700)
            r = pending.result(60)
    finally:
        faulty["delay"].write_text("0")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == aggregated(fleet, body)
    assert metric(faulty["decode"], "pdfleet_engine_kv_transfers_total") == transfers
    assert (
        metric(faulty["decode"], "pdfleet_engine_kv_transfer_unconfirmed_total") == unconfirmed + 1
    )


def greedy(url: str, seeds: range) -> list[tuple[str, int]]:
    """(text, cached prompt tokens) of greedy completions of distinct prompts."""
    out = []
    for seed in seeds:
        r = post(
            url + "/v1/completions",
            timeout=60,
            json={
                "prompt": prompt_of(150, seed),
                "max_tokens": 6,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out.append((r.json()["choices"][0]["text"], cached))
    return out


def check_pool_is_clean(fleet, faulty, seeds: range) -> list[str]:
    """Requests that reuse the consumer's pool give the clean run's greedy outputs."""
    ref = [
        aggregated(
            fleet,
            {"prompt": prompt_of(150, s), "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        )
        for s in seeds
    ]
    assert [t for t, _ in greedy(faulty["decode"], seeds)] == ref
    return ref


def test_an_aborted_pull_quarantines_its_blocks_until_the_read_lands(fleet, faulty):
    url = faulty["decode"]
    body = {"prompt": prompt_of(160, 53), "max_tokens": 6, "temperature": 0, "stream": True}
    params = prefill(fleet["prefill"], {**body, "stream": False})  # a 10 s lease
    faulty["delay"].write_text("2")
    try:
        with open_stream(
            "POST", url + "/v1/completions", timeout=30, json={**body, "kv_transfer_params": params}
        ):
            assert wait_until(lambda: metric(url, "pdfleet_engine_kv_pulls_in_flight") >= 1, 10)
        # The client is gone: the request is aborted, its READ is still pending.
        assert wait_until(lambda: metric(url, "pdfleet_engine_kv_quarantined_blocks") == 9, 10)
        faulty["delay"].write_text("0")
        seeds = range(800, 804)
        ref = check_pool_is_clean(fleet, faulty, seeds)
        assert wait_until(lambda: metric(url, "pdfleet_engine_kv_quarantined_blocks") == 0, 10)
        # Run again from the consumer's prefix cache: the cached KV is intact (a late
        # READ into a reused block would change these outputs).
        again = greedy(url, seeds)
        assert [t for t, _ in again] == ref and any(c > 0 for _, c in again)
    finally:
        faulty["delay"].write_text("0")


def test_a_stalled_pull_times_out_quarantines_and_flags_the_engine_unhealthy(fleet, faulty):
    if fleet["connector"] != "NixlConnector":
        pytest.skip("ZMQ reads are synchronous: a late reply is discarded with its socket")
    url = faulty["decode"]
    body = {"prompt": prompt_of(160, 54), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    failures = metric(url, "pdfleet_engine_kv_transfer_failures_total")
    params = prefill(fleet["prefill"], body)  # a 10 s lease
    faulty["delay"].write_text("8")  # past the 4 s deadline (handshake 1 s + transfer 3 s)
    try:
        start = time.monotonic()
        r = decode(url, body, params)
        elapsed = time.monotonic() - start
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == aggregated(fleet, body)
        assert elapsed < 6
        assert metric(url, "pdfleet_engine_kv_transfer_failures_total") == failures + 1
        assert metric(url, "pdfleet_engine_kv_quarantined_blocks") == 9
        # Past quarantine_timeout_seconds the engine says it is unhealthy ...
        assert wait_until(lambda: httpx.get(url + "/health", timeout=5).status_code == 503, 6)
        faulty["delay"].write_text("0")
        # ... until the READ has landed and the blocks are free again.
        assert wait_until(lambda: metric(url, "pdfleet_engine_kv_quarantined_blocks") == 0, 10)
        assert wait_until(lambda: httpx.get(url + "/health", timeout=5).status_code == 200, 5)
        check_pool_is_clean(fleet, faulty, range(810, 813))
    finally:
        faulty["delay"].write_text("0")


def test_prefill_sigterm_waits_for_held_leases_so_no_decode_leg_recomputes(nixl_pair):
    producer = nixl_pair["spare"]["draining"]
    try:
        url = nixl_pair["recompute"]
        bodies = [
            {
                "prompt": prompt_of(100, 60 + i),
                "max_tokens": 4,
                "temperature": 0,
                "ignore_eos": True,
            }
            for i in range(3)
        ]
        # References first: the leases run from the prefill legs on, and on a
        # loaded machine these calls could outlast them.
        refs = [
            post(nixl_pair["agg"] + "/v1/completions", json=body, timeout=60).json()
            for body in bodies
        ]
        params = [prefill(producer.url, body) for body in bodies]
        before = scrape(url)
        signalled = time.monotonic()
        producer.signal(signal.SIGTERM)  # a scale-down with leases held
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda bp: decode(url, *bp), zip(bodies, params, strict=True)))
        for r, ref in zip(results, refs, strict=True):
            assert r.status_code == 200 and r.json()["choices"] == ref["choices"]
        after = scrape(url)
        # Every decode leg pulled its blocks: zero recomputes.
        assert (
            after["pdfleet_engine_kv_transfers_total"]
            == before["pdfleet_engine_kv_transfers_total"] + 3
        )
        assert after.get("pdfleet_engine_kv_transfer_failures_total", 0) == before.get(
            "pdfleet_engine_kv_transfer_failures_total", 0
        )
        # ... and the engine exits once they are claimed, not after the whole lease.
        assert producer.proc.wait(30) == 0
        assert time.monotonic() - signalled < 20
    finally:
        producer.stop()
