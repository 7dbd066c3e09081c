"""Engine HTTP credentials, wire limits and bad input, against a real `pdfleet serve`."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from helpers.server import ServerProcess, fleet_token

from pdfleet.engine.contracts.http_limits import DEFAULT_LIMITS

BODY_LIMIT = 1 << 20  # 1 MiB
CHUNK_LIMIT = 4096
HEADER_TIMEOUT = 1.0
BODY_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("guard")
    keys = tmp / "keys"
    keys.write_text("ka,kb\nkc\n")
    proc = ServerProcess(
        [
            "serve",
            tiny_model,
            "--max-model-len",
            "512",
            "--served-model-name",
            "tiny",
            "--disable-log-stats",
            "--api-key-file",
            str(keys),
            "--max-request-body-bytes",
            str(BODY_LIMIT),
            "--max-chunk-bytes",
            str(CHUNK_LIMIT),
            "--header-timeout",
            str(HEADER_TIMEOUT),
            "--body-timeout",
            str(BODY_TIMEOUT),
            "--large-prompt-chars",
            "10000",
        ],
        tmp,
        env={"PDFLEET_API_KEY": ""},
    )
    try:
        yield proc.wait_healthy()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


def raw(server: ServerProcess, data: bytes, wait: float = 5.0) -> bytes:
    """Send bytes on a fresh connection; what comes back before the server closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as s:
        s.sendall(data)
        return read_until_closed(s, wait)


def read_until_closed(s: socket.socket, wait: float) -> bytes:
    """Everything the server sends until it closes; fails if it is still open after ``wait``."""
    out = b""
    deadline = time.monotonic() + wait
    while True:
        s.settimeout(max(0.05, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            raise AssertionError(
                f"connection still open after {wait}s; got {out[:200]!r}"
            ) from None
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def json_of(response: bytes) -> dict:
    return json.loads(response.split(b"\r\n\r\n", 1)[1])


# -- credentials ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("GET", "/metrics"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/version"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("GET", "/no-such-route"),
    ],
)
def test_every_route_but_health_refuses_a_request_without_credentials(server, method, path):
    r = httpx.request(method, server.url + path, json={"prompt": "x"}, timeout=30)
    assert r.status_code == 401, r.text
    error = r.json()["error"]
    assert error["type"] == "AuthenticationError" and error["code"] == 401
    wrong = httpx.request(
        method, server.url + path, headers={"authorization": "Bearer nope"}, timeout=30
    )
    assert wrong.status_code == 401


def test_health_needs_no_credential(server):
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}


@pytest.mark.parametrize(
    "authorization",
    [
        f"Bearer {fleet_token()}",
        f"bearer {fleet_token()}",
        f"BEARER {fleet_token()}",
        "Bearer ka",
        "Bearer kb",
        "bearer kc",
    ],
)
def test_fleet_token_and_every_key_of_the_key_file_are_accepted(server, authorization):
    r = httpx.get(server.url + "/v1/models", headers={"authorization": authorization}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["data"][0]["id"] == "tiny"


def test_the_whole_comma_separated_string_is_not_a_key(server):
    r = httpx.get(server.url + "/v1/models", headers={"authorization": "Bearer ka,kb"}, timeout=30)
    assert r.status_code == 401


def test_openapi_and_metrics_are_served_with_a_credential(http):
    assert "/v1/completions" in http.get("/openapi.json").json()["paths"]
    assert "pdfleet_engine_num_requests_running" in http.get("/metrics").text


def test_unauthenticated_body_is_never_read(server):
    # A large body from a caller without credentials: refused on its headers alone.
    start = time.monotonic()
    out = raw(
        server,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 500000\r\n\r\n",
    )
    assert status_of(out) == 401 and time.monotonic() - start < 3


# -- body, chunk and time limits ----------------------------------------------------


def test_body_over_the_limit_is_refused_from_content_length_before_it_is_sent(server):
    headers = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {fleet_token()}\r\nContent-Length: 50000000\r\n\r\n"
    ).encode()
    start = time.monotonic()
    out = raw(server, headers)  # not one byte of the 50 MB body is sent
    assert status_of(out) == 413, out[:300]
    assert json_of(out)["error"]["code"] == 413
    assert b"connection: close" in out.lower()
    assert time.monotonic() - start < 3


def test_chunked_body_over_the_limit_is_refused_while_it_streams(http):
    sent = 0

    def body():
        nonlocal sent
        piece = b'{"prompt": "' + b"a" * 4000
        for _ in range(1000):  # 4 MB if nobody stopped it
            sent += len(piece)
            yield piece

    try:
        r = http.post("/v1/completions", content=body())
        assert r.status_code == 413, r.text
    except httpx.RemoteProtocolError:
        pass  # the server closed while the client was still sending
    assert sent < 4 * BODY_LIMIT


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_refused_huge_bodies_never_take_their_memory(server):
    before = rss_bytes(server.proc.pid)
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {fleet_token()}\r\n"
    ).encode()
    piece = b"a" * 65536
    for _ in range(3):
        # 64 MB announced: refused on the header.
        assert status_of(raw(server, head + b"Content-Length: 64000000\r\n\r\n")) == 413
        # 64 MB chunked, sent until the server closes: refused at the limit.
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(head + b"Transfer-Encoding: chunked\r\n\r\n")
            try:
                for _ in range(1000):
                    s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                pass
            else:
                raise AssertionError("the server read a 64 MB body to the end")
    grown = rss_bytes(server.proc.pid) - before
    assert grown < 48 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"


def test_body_under_the_limit_is_served(http):
    prompt = "word " * 50  # well under both limits, chunked by the client
    body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
    r = http.post(
        "/v1/completions",
        content=iter([body[:100], body[100:]]),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("chunk_line", "status"),
    [
        (b"%x\r\n" % (2**60), 413),  # parsed, far over --max-chunk-bytes
        (b"%x\r\n" % (2 * CHUNK_LIMIT), 413),
        (b"%x\r\n" % (2**80), 400),  # longer than HTTP/1.1 parsers accept
    ],
)
def test_huge_chunk_size_line_is_refused_and_the_connection_closed(server, chunk_line, status):
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {fleet_token()}\r\nTransfer-Encoding: chunked\r\n\r\n"
    ).encode()
    start = time.monotonic()
    out = raw(server, head + chunk_line + b'{"prompt"', wait=3.0)
    assert status_of(out) == status, out[:300]
    assert time.monotonic() - start < 2.5


def test_request_head_over_the_shared_head_limit_is_a_431_and_closes(server):
    limit = DEFAULT_LIMITS.max_head_bytes

    def health_with_header(size: int) -> bytes:
        head = (
            f"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: {'a' * size}\r\n\r\n"
        )
        return raw(server, head.encode(), wait=5.0)

    # Within the limit (past the 16 KiB some servers stop at): served.
    ok = health_with_header(limit // 2)
    assert status_of(ok) == 200, ok[:200]
    # Past it, though it arrives whole: refused and closed (read_until_closed returns;
    # a reset may take the answer with it, so an empty read counts as closed too).
    refused = health_with_header(limit + 1024)
    assert not refused.startswith(b"HTTP/1.1 200"), refused[:200]
    if refused:
        assert status_of(refused) == 431, refused[:200]
        assert json_of(refused)["error"]["type"] == "RequestHeaderFieldsTooLargeError"


def test_slow_loris_headers_are_cut_off(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        closed_after = None
        # Trickle one header byte every 0.2 s, as a slow-loris client does.
        while time.monotonic() - start < 4 * HEADER_TIMEOUT + 2:
            try:
                s.sendall(b"X")
                s.settimeout(0.2)
                if s.recv(1024) == b"":
                    closed_after = time.monotonic() - start
                    break
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed_after = time.monotonic() - start
                break
        assert closed_after is not None, "the trickling connection was never closed"
        assert closed_after < HEADER_TIMEOUT + 1.5


def test_idle_connection_without_a_request_is_closed(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        start = time.monotonic()
        assert read_until_closed(s, HEADER_TIMEOUT + 2) == b""
        assert time.monotonic() - start >= HEADER_TIMEOUT * 0.9


def test_body_that_stops_arriving_gets_408(server):
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {fleet_token()}\r\nContent-Length: 1000\r\n\r\n"
    ).encode()
    start = time.monotonic()
    out = raw(server, head + b'{"prompt": "hel', wait=BODY_TIMEOUT + 3)
    assert status_of(out) == 408, out[:300]
    assert json_of(out)["error"]["type"] == "RequestTimeoutError"
    assert BODY_TIMEOUT * 0.9 <= time.monotonic() - start < BODY_TIMEOUT + 2


def test_keep_alive_connection_serves_several_requests(server, http):
    for _ in range(3):
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200


# -- tokenizer work --------------------------------------------------------------------


def test_prompt_too_long_for_the_context_is_refused_before_tokenizing(http):
    start = time.monotonic()
    r = http.post("/v1/completions", json={"prompt": "z" * 900_000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "characters" in r.json()["error"]["message"]
    assert time.monotonic() - start < 2  # tokenizing 900k characters takes seconds here


def test_large_lane_queue_is_bounded():
    import threading

    from pdfleet.engine.entrypoints.openai.protocol import APIError
    from pdfleet.engine.entrypoints.openai.serving_base import TokenizerLanes

    lanes = TokenizerLanes(large_chars=10, max_large=2)
    release = threading.Event()

    async def main():
        held = [asyncio.ensure_future(lanes.run(100, release.wait, 10)) for _ in range(2)]
        for _ in range(1000):  # until both hold the large lane (bounded)
            if lanes.num_large == 2:
                break
            await asyncio.sleep(0.01)
        assert lanes.num_large == 2
        with pytest.raises(APIError) as refused:
            await lanes.run(100, release.wait, 10)
        small = await lanes.run(5, lambda: "short ones still run")
        release.set()
        return refused.value.status, small, await asyncio.gather(*held)

    try:
        status, small, held = asyncio.run(main())
    finally:
        release.set()
        lanes.shutdown()
    assert status == 503 and small == "short ones still run" and held == [True, True]
    assert lanes.num_large == 0


def test_short_prompts_are_tokenized_on_the_event_loop_longer_ones_in_a_lane():
    import threading

    from pdfleet.engine.entrypoints.openai.serving_base import INLINE_CHARS, TokenizerLanes

    lanes = TokenizerLanes(large_chars=1000, inline_chars=16)

    async def main():
        return (
            threading.get_ident(),
            await lanes.run(16, threading.get_ident),
            await lanes.run(17, threading.get_ident),
            await lanes.run(1000, threading.get_ident),
        )

    try:
        loop_thread, short, longer, large = asyncio.run(main())
    finally:
        lanes.shutdown()
    assert short == loop_thread
    assert longer != loop_thread and large != loop_thread and longer != large
    # A server's lanes inline short prompts (never a large one).
    assert TokenizerLanes(large_chars=1 << 16).inline_chars == INLINE_CHARS > 0
    assert TokenizerLanes(large_chars=10).inline_chars == 9


def test_short_request_completes_while_large_prompts_are_tokenized(server):
    big = "The harbor was quiet before dawn. " * 8000  # ~270k characters each

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120) as c:
            large = [
                # Enough of them (the large lane tokenizes one at a time) that it
                # is still busy when the short one is answered on a quiet machine.
                asyncio.ensure_future(c.post("/tokenize", json={"prompt": big}))
                for _ in range(12)
            ]
            await asyncio.sleep(0.3)
            start = time.monotonic()
            short = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            short_s = time.monotonic() - start
            pending = sum(not t.done() for t in large)
            results = await asyncio.gather(*large)
            return short, short_s, pending, results

    short, short_s, pending, results = asyncio.run(main())
    assert short.status_code == 200, short.text
    assert all(r.status_code == 200 and r.json()["count"] > 10_000 for r in results)
    # The large prompts were still being worked on when the short one was answered.
    assert pending >= 1, f"the short request waited for the large ones ({short_s:.1f}s)"


# -- bad input is a 400 --------------------------------------------------------------------


def nested(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


@pytest.mark.parametrize(
    "body",
    [
        '{"prompt": ' + nested(1000) + "}",
        '{"prompt": "x", "stop": ' + nested(1000) + "}",
        '{"prompt": "x", "extra": ' + "{" + '"a":{' * 999 + "}" * 1000 + "}",
        nested(100_000),
    ],
)
def test_deeply_nested_json_is_a_400(http, body):
    r = http.post(
        "/v1/completions", content=body.encode(), headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["type"] == "BadRequestError", r.text[:300]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "hi \ud800 there"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt"),
        ("/v1/completions", {"prompt": "hi", "stop": ["\ud800"]}, "stop"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\ud801"}]}]},
            "messages",
        ),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(http, path, body, param):
    # json.dumps escapes the lone surrogate as \ud800, as an attacker's client would send it.
    r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": {"a": 1}}, "prompt"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "n": "two"}, "n"),
        ({"prompt": "x", "temperature": [1]}, "temperature"),
        ({"prompt": "x", "stream_options": "yes", "stream": True}, "stream_options"),
        ({"prompt": "x", "kv_transfer_params": [1, 2]}, "kv_transfer_params"),
        ({"prompt": [1.5, 2]}, "prompt"),
    ],
)
def test_wrong_types_are_a_400_naming_the_field(http, body, param):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == param


def test_errors_carry_no_traceback_and_the_server_keeps_serving(http):
    for body in ('{"prompt": ' + nested(1000) + "}", '{"prompt": "\\ud800"}', "{bad"):
        r = http.post(
            "/v1/completions", content=body.encode(), headers={"content-type": "application/json"}
        )
        text = r.text
        assert r.status_code == 400
        assert "Traceback" not in text and 'File "' not in text and "/site-packages/" not in text
    ok = http.post("/v1/completions", json={"prompt": "still here", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
