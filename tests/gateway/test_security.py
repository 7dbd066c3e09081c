"""What a real gateway process sends to engines and accepts from clients.

The engines here are recording HTTP servers (``fake_engine.py``) so that every
header and body the gateway sends can be checked: engines get the fleet token
and never the client's key; a client's ``kv_transfer_params`` never reach an
engine; a body the engines would refuse never reaches a prefill engine;
engine errors reach the client without URLs, bodies or traces; TLS engines
are verified; the request limits hold against raw sockets.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import threading
import time

import httpx
import pytest
from gateway.fake_engine import PARAMS, FakeEngine, make_ca, make_client_cert
from helpers.fleet import auth_headers, engines_view, start_gateway
from helpers.server import wait_until

CLIENT_KEY = "client-key-abc"
LONG = "word " * 400  # over --min-prompt-tokens (chars / 4)


def long_prompt() -> str:
    """A long prompt no engine caches yet (so the router picks P/D)."""
    return f"{time.monotonic_ns()} {LONG}"


FORGED = {
    "do_remote_prefill": True,
    "remote_host": "127.0.0.1",
    "remote_port": 9,
    "remote_block_ids": [0, 1, 2],
    "remote_request_id": "victim",
}


@pytest.fixture(scope="module")
def fakes():
    prefill, decode = FakeEngine(), FakeEngine()
    yield prefill, decode
    prefill.close()
    decode.close()


@pytest.fixture(scope="module")
def gateway(fakes, tmp_path_factory):
    prefill, decode = fakes
    gw = start_gateway(
        [
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--api-key",
            CLIENT_KEY,
            "--scrape-interval",
            "0.2",
            "--max-body-bytes",
            "65536",
            "--header-timeout",
            "1",
            "--body-timeout",
            "1",
            "--kv-pair-failures",
            "2",
            "--kv-pair-cooldown",
            "120",
        ],
        tmp_path_factory.mktemp("security"),
    )
    yield gw
    gw.stop()


@pytest.fixture(autouse=True)
def _fresh(fakes):
    for f in fakes:
        f.seen.clear()
        f.answer = None
        f.health_status = 200


def post(gw, body, key: str = CLIENT_KEY, **kw) -> httpx.Response:
    return httpx.post(
        gw.url + "/v1/completions", json=body, headers=auth_headers(key), timeout=30, **kw
    )


def test_engines_get_the_fleet_token_never_the_client_key(gateway, fakes):
    resp = post(gateway, {"model": "tiny", "prompt": long_prompt(), "max_tokens": 3})
    assert resp.status_code == 200, resp.text
    token = auth_headers()["authorization"]
    for f in fakes:
        assert f.posts(), "both legs reached their engine"
        # Legs, health checks and scrapes: every call carries the fleet token.
        assert {s.headers.get("authorization") for s in f.seen} == {token}
        assert not any(CLIENT_KEY in json.dumps(s.headers) for s in f.seen)


def test_client_kv_transfer_params_never_reach_an_engine(gateway, fakes):
    prefill, decode = fakes
    # A long prompt: the prefill leg asks for a remote decode, the decode leg
    # carries exactly what the producer returned.
    resp = post(
        gateway,
        {"model": "tiny", "prompt": long_prompt(), "max_tokens": 3, "kv_transfer_params": FORGED},
    )
    assert resp.status_code == 200, resp.text
    assert prefill.posts()[-1].body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    assert decode.posts()[-1].body["kv_transfer_params"] == PARAMS
    # A short prompt goes straight to decode: with no params at all.
    resp = post(
        gateway, {"model": "tiny", "prompt": "hi", "max_tokens": 3, "kv_transfer_params": FORGED}
    )
    assert resp.status_code == 200, resp.text
    assert "kv_transfer_params" not in decode.posts()[-1].body
    assert len(prefill.posts()) == 1


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 5, "min_tokens": 10}, "min_tokens"),
        ({"max_tokens": "5"}, "max_tokens"),
        ({"max_tokens": 5, "top_k": 2**63}, "top_k"),
        ({"max_tokens": 5, "stop_token_ids": [2**70]}, "stop_token_ids"),
    ],
)
def test_inadmissible_sampling_is_a_400_before_any_leg(gateway, fakes, fields, param):
    resp = post(gateway, {"model": "tiny", "prompt": long_prompt(), **fields})
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["param"] == param and error["code"] == 400
    # No prefill leg ran, so no KV is pinned for a request decode would refuse.
    assert fakes[0].posts() == [] and fakes[1].posts() == []


def test_engine_errors_reach_the_client_without_urls_bodies_or_traces(gateway, fakes):
    decode = fakes[1]
    trace = b'Traceback (most recent call last):\n  File "/srv/engine/secret.py"\nTOKEN=hunter2'
    decode.answer = lambda body: (500, trace)
    resp = post(gateway, {"model": "tiny", "prompt": "hi", "max_tokens": 3})
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error == {
        "message": "the decode engine answered 500",
        "type": "BadGatewayError",
        "param": None,
        "code": 502,
    }
    # A refusal that is not OpenAI-shaped: its status, not its body.
    decode.answer = lambda body: (400, trace)
    resp = post(gateway, {"model": "tiny", "prompt": "hi", "max_tokens": 3})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "the request was refused (400)"
    # An OpenAI-shaped refusal: what the client must change, nothing more (its
    # code is the status, as every pdfleet error's, whatever the engine's said).
    shaped = {"error": {"message": "prompt is too long", "param": "prompt", "code": "too_long"}}
    decode.answer = lambda body: (400, json.dumps({**shaped, "trace": trace.decode()}).encode())
    resp = post(gateway, {"model": "tiny", "prompt": "hi", "max_tokens": 3})
    error = resp.json()["error"]
    assert (error["message"], error["type"], error["param"], error["code"]) == (
        "prompt is too long",
        "BadRequestError",
        "prompt",
        400,
    )
    assert "Traceback" not in resp.text
    for answer in (resp,):
        assert str(decode.port) not in answer.text and "127.0.0.1" not in answer.text
    # The gateway logged the details, with the request id.
    assert "secret.py" in gateway.log()


def test_health_is_bare_and_what_names_engines_needs_a_key(gateway, fakes):
    health = httpx.get(gateway.url + "/health", timeout=5)
    assert health.json() == {"status": "ok"} and fakes[1].url not in health.text
    for path in ("/engines", "/metrics"):
        assert httpx.get(gateway.url + path, timeout=5).status_code == 401
        wrong = httpx.get(gateway.url + path, headers=auth_headers("nope"), timeout=5)
        assert wrong.status_code == 401
        # Lower-case scheme accepted, like the engines'.
        lower = {"authorization": f"bearer {CLIENT_KEY}"}
        assert httpx.get(gateway.url + path, headers=lower, timeout=5).status_code == 200
    for path in ("/docs", "/openapi.json", "/redoc"):
        assert httpx.get(gateway.url + path, timeout=5).status_code == 404


def test_api_keys_from_the_environment_are_split_like_the_engines(fakes, tmp_path):
    gw = start_gateway(["--decode", fakes[1].url], tmp_path, env={"PDFLEET_API_KEY": "ka, kb\nkc"})
    try:
        for key in ("ka", "kb", "kc"):
            assert post(gw, {"prompt": "hi", "max_tokens": 1}, key=key).status_code == 200
        for key in ("ka, kb", "ka,kb", "k", ""):
            assert post(gw, {"prompt": "hi", "max_tokens": 1}, key=key).status_code == 401
    finally:
        gw.stop()


# -- limits, with raw sockets ---------------------------------------------------------


def raw_exchange(gw, data: bytes, trickle: float = 0.0, read_timeout: float = 10.0) -> bytes:
    """Send ``data`` (byte by byte every ``trickle`` seconds), then read to the close."""
    port = int(gw.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=read_timeout) as s:
        try:
            if trickle:
                for b in data:
                    s.sendall(bytes([b]))
                    time.sleep(trickle)
            else:
                s.sendall(data)
        except OSError:  # the gateway closed the connection while we were sending
            pass
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except (ConnectionResetError, TimeoutError):
            pass
    return out


def head(path: str = "/v1/completions", **headers: str) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "host: gw", f"authorization: Bearer {CLIENT_KEY}"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_body_over_the_limit_is_refused_on_its_content_length_before_it_is_read(gateway):
    started = time.monotonic()
    # 50 MB announced, nothing sent: the 413 comes back at once.
    out = raw_exchange(gateway, head(content_length="50000000", content_type="application/json"))
    assert out.startswith(b"HTTP/1.1 413"), out[:200]
    assert b'"RequestTooLargeError"' in out and b'"code": 413' in out
    assert time.monotonic() - started < 3


def test_a_chunked_body_over_the_limit_and_a_huge_chunk_size_are_cut_off(gateway):
    chunk = b"x" * 40000
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(3)) + b"0\r\n\r\n"
    out = raw_exchange(gateway, head(transfer_encoding="chunked") + body)
    assert out.startswith(b"HTTP/1.1 413"), out[:200]
    # A chunk of 2^56 - 1 bytes announced and never sent: past --max-chunk-bytes
    # (the engine server's bound too), a 413 at once.
    started = time.monotonic()
    out = raw_exchange(gateway, head(transfer_encoding="chunked") + b"ffffffffffffff\r\nab")
    assert out.startswith(b"HTTP/1.1 413"), out[:200]
    assert b"--max-chunk-bytes" in out and time.monotonic() - started < 3
    # A chunk within the bound announced and never sent: the body timeout ends it.
    started = time.monotonic()
    out = raw_exchange(gateway, head(transfer_encoding="chunked") + b"400\r\nab")
    assert out.startswith(b"HTTP/1.1 408"), out[:200]
    assert time.monotonic() - started < 5
    # A chunk size past 64 bits is not HTTP/1.1: an OpenAI-shaped 400 at once.
    started = time.monotonic()
    out = raw_exchange(gateway, head(transfer_encoding="chunked") + b"ffffffffffffffffffff\r\nab")
    assert out.startswith(b"HTTP/1.1 400"), out[:200]
    assert b'"code": 400' in out and time.monotonic() - started < 3


def test_a_request_head_over_64_kib_is_a_431(gateway):
    out = raw_exchange(gateway, head(x_big="a" * 70000, content_length="0"))
    assert out.startswith(b"HTTP/1.1 431"), out[:200]
    assert b'"RequestHeaderFieldsTooLargeError"' in out and b'"code": 431' in out


def test_headers_trickled_past_the_header_timeout_close_the_connection(gateway):
    started = time.monotonic()
    out = raw_exchange(gateway, head(x_slow="a" * 40), trickle=0.05)
    assert out == b"" and time.monotonic() - started < 4


@pytest.mark.parametrize(
    ("raw", "what"),
    [
        (b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", "nested too deeply"),
        (b'{"prompt": "\\ud800 lone", "max_tokens": 2}', "surrogate"),
        (b'{"prompt": "\xff\xfe"}', "invalid JSON"),
        (b"[1, 2]", "JSON object"),
    ],
    ids=["deep", "surrogate", "not-utf8", "not-object"],
)
def test_malformed_bodies_are_400s_that_say_why(gateway, fakes, raw, what):
    resp = httpx.post(
        gateway.url + "/v1/completions",
        content=raw,
        headers={**auth_headers(CLIENT_KEY), "content-type": "application/json"},
        timeout=10,
    )
    assert resp.status_code == 400, resp.text
    assert what in resp.json()["error"]["message"]
    assert fakes[1].posts() == []
    # A paired surrogate escape is text, and is served.
    ok = httpx.post(
        gateway.url + "/v1/completions",
        content=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}',
        headers={**auth_headers(CLIENT_KEY), "content-type": "application/json"},
        timeout=10,
    )
    assert ok.status_code == 200


# -- TLS ------------------------------------------------------------------------------


def test_https_engines_are_verified_against_the_ca_bundle(tmp_path):
    ca, server_ctx = make_ca(tmp_path)
    engine = FakeEngine(tls=server_ctx)
    trusted = untrusted = None
    try:
        trusted = start_gateway(
            ["--decode", engine.url, "--ca-bundle", str(ca), "--scrape-interval", "0.2"], tmp_path
        )
        resp = post(trusted, {"prompt": "hi", "max_tokens": 1}, key="")
        assert resp.status_code == 200, resp.text
        assert engine.posts()[-1].headers["authorization"] == auth_headers()["authorization"]
        # Without the CA the certificate is refused: the engine is never routable.
        trusted.stop()
        trusted = None
        engine.seen.clear()
        untrusted = start_gateway(
            ["--decode", engine.url, "--scrape-interval", "0.2", "--hold-timeout", "0.5"],
            tmp_path,
            healthy=False,
        )
        assert wait_until(lambda: _up(untrusted), 30)
        assert engines_view(untrusted.url)["engines"][0]["state"] == "pending"
        refused = post(untrusted, {"prompt": "hi", "max_tokens": 1}, key="")
        assert refused.status_code == 503 and "localhost" not in refused.text
        assert engine.seen == []
    finally:
        for gw in (trusted, untrusted):
            if gw is not None:
                gw.stop()
        engine.close()


def test_an_engine_that_requires_a_client_certificate_gets_the_gateways(tmp_path):
    ca, server_ctx = make_ca(tmp_path)
    cert, key = make_client_cert(tmp_path)
    server_ctx.verify_mode = ssl.CERT_REQUIRED  # mutual TLS
    server_ctx.load_verify_locations(ca)
    engine = FakeEngine(tls=server_ctx)
    common = ["--decode", engine.url, "--ca-bundle", str(ca), "--scrape-interval", "0.2"]
    gw = None
    try:
        gw = start_gateway(
            [*common, "--client-cert", str(cert), "--client-key", str(key)], tmp_path
        )
        assert post(gw, {"prompt": "hi", "max_tokens": 1}, key="").status_code == 200
        gw.stop()
        engine.seen.clear()
        gw = start_gateway([*common, "--hold-timeout", "0.5"], tmp_path, healthy=False)
        assert wait_until(lambda: _up(gw), 30)
        assert post(gw, {"prompt": "hi", "max_tokens": 1}, key="").status_code == 503
        assert engine.seen == []  # no certificate, no request
    finally:
        if gw is not None:
            gw.stop()
        engine.close()


def _up(gw) -> bool:
    try:
        httpx.get(gw.url + "/health", timeout=1)
        return True
    except httpx.HTTPError:
        return False


def test_the_fleet_token_never_goes_out_in_clear_to_an_https_url(tmp_path):
    """A plain TCP listener on an https:// URL sees only TLS handshakes."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    received: list[bytes] = []

    def accept() -> None:
        listener.settimeout(15)
        try:
            while len(received) < 3:
                conn, _ = listener.accept()
                with conn:
                    conn.settimeout(2)
                    data = b""
                    try:
                        while chunk := conn.recv(65536):
                            data += chunk
                    except OSError:
                        pass
                    received.append(data)
        except OSError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    gw = start_gateway(
        ["--decode", f"https://127.0.0.1:{port}", "--scrape-interval", "0.2"],
        tmp_path,
        healthy=False,
    )
    try:
        assert wait_until(lambda: len(received) >= 2, 30), gw.log()
        token = auth_headers()["authorization"].split()[1].encode()
        for data in received:
            assert data[:1] == b"\x16"  # a TLS handshake record
            assert token not in data and b"authorization" not in data.lower()
    finally:
        gw.stop()
        listener.close()
        thread.join(5)


def test_plain_http_to_a_non_loopback_engine_is_logged_once(tmp_path):
    # 192.0.2.0/24 is reserved for documentation: nothing answers there.
    gw = start_gateway(
        ["--decode", "http://192.0.2.10:8000", "--connect-timeout", "0.2"], tmp_path, healthy=False
    )
    try:
        assert wait_until(lambda: "plain http://" in gw.log(), 30)
        # Once per gateway process (each worker of --workers N is one).
        workers = int(os.environ.get("PDFLEET_TEST_GATEWAY_WORKERS") or 1)
        assert wait_until(lambda: gw.log().count("plain http://") >= workers, 30)
        assert gw.log().count("plain http://") == workers
    finally:
        gw.stop()
