"""The gateway's HTTP/1.1 server (engine/http/server.py, the engines' too) against raw sockets.

A real gateway process in front of recording engines (``fake_engine.py``):
pipelined requests are answered in order, chunked and ``Expect:
100-continue`` bodies arrive whole, a kept-alive connection's next head has
the header deadline too, a malformed request line is an OpenAI-shaped 400,
a client that closes mid-stream cancels the decode leg, and SIGTERM lets a
running stream finish before the gateway exits 0.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

import httpx
import pytest
from gateway.fake_engine import FakeEngine
from helpers.fleet import auth_headers, metric, start_gateway
from helpers.server import wait_until

KEY = "server-test-key"
EVENT = b'data: {"choices": [{"index": 0, "text": "t"}]}\n\n'


@pytest.fixture(scope="module")
def fakes():
    prefill, decode = FakeEngine(), FakeEngine()
    yield prefill, decode
    prefill.close()
    decode.close()


def gateway_args(fakes) -> list[str]:
    prefill, decode = fakes
    return [
        "--prefill",
        prefill.url,
        "--decode",
        decode.url,
        "--api-key",
        KEY,
        "--scrape-interval",
        "0.2",
        "--header-timeout",
        "1",
        "--body-timeout",
        "2",
    ]


@pytest.fixture(scope="module")
def gateway(fakes, tmp_path_factory):
    gw = start_gateway(gateway_args(fakes), tmp_path_factory.mktemp("http-server"))
    yield gw
    gw.stop()


@pytest.fixture(autouse=True)
def _fresh(fakes):
    for f in fakes:
        f.seen.clear()
        f.answer = None


def connect(gw, timeout: float = 10.0) -> socket.socket:
    port = int(gw.url.rsplit(":", 1)[1])
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def request(body: bytes | None, request_id: str = "", **headers: str) -> bytes:
    lines = ["POST /v1/completions HTTP/1.1", "host: gw", f"authorization: Bearer {KEY}"]
    lines.append("content-type: application/json")
    if request_id:
        lines.append(f"x-request-id: {request_id}")
    if body is not None and "transfer_encoding" not in headers:
        lines.append(f"content-length: {len(body)}")
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + (body or b"")


def completion(prompt: str, **fields) -> bytes:
    return json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 2, **fields}).encode()


class Reader:
    """HTTP/1.1 answers read one by one off a raw socket (Content-Length or chunked)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.buf = sock, b""

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("the gateway closed the connection")
        self.buf += data

    def until(self, marker: bytes) -> bytes:
        while marker not in self.buf:
            self._fill()
        out, _, self.buf = self.buf.partition(marker)
        return out + marker

    def exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def answer(self) -> tuple[int, dict[str, str], bytes]:
        head = self.until(b"\r\n\r\n").decode("latin-1").split("\r\n")
        status = int(head[0].split(" ")[1])
        headers = {}
        for line in head[1:]:
            if line:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
        if "content-length" in headers:
            return status, headers, self.exactly(int(headers["content-length"]))
        body = b""
        while True:
            size = int(self.until(b"\r\n")[:-2], 16)
            if size == 0:
                self.until(b"\r\n")
                return status, headers, body
            body += self.exactly(size + 2)[:-2]


def test_pipelined_requests_are_answered_in_order(gateway, fakes):
    decode = fakes[1]

    def answer(body):
        if body["prompt"] == "slow":  # the first request takes longest
            time.sleep(0.5)
        out = {
            "id": "c",
            "choices": [{"index": 0, "text": body["prompt"], "finish_reason": "length"}],
        }
        return 200, json.dumps(out).encode()

    decode.answer = answer
    prompts = ["slow", "quick", "last"]
    with connect(gateway) as s:
        s.sendall(b"".join(request(completion(p), f"pipe-{p}") for p in prompts))
        reader = Reader(s)
        answers = [reader.answer() for _ in prompts]
    assert [a[0] for a in answers] == [200, 200, 200], answers
    assert [a[1]["x-request-id"] for a in answers] == [f"pipe-{p}" for p in prompts]
    assert [json.loads(a[2])["choices"][0]["text"] for a in answers] == prompts


def test_a_chunked_request_body_arrives_whole(gateway, fakes):
    raw = completion("chunked " * 20)
    parts = [raw[:10], raw[10:50], raw[50:]]
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    with connect(gateway) as s:
        head = request(None, "chunked-1", transfer_encoding="chunked")
        s.sendall(head + chunked[:25])
        time.sleep(0.1)  # the rest in a later segment: the body is read as it arrives
        s.sendall(chunked[25:])
        status, _, body = Reader(s).answer()
    assert status == 200, body
    assert fakes[1].posts()[-1].body["prompt"] == "chunked " * 20


def test_expect_100_continue_is_answered_before_the_body_is_sent(gateway, fakes):
    raw = completion("continue")
    with connect(gateway) as s:
        s.sendall(request(None, "expect-1", expect="100-continue", content_length=str(len(raw))))
        reader = Reader(s)
        assert reader.until(b"\r\n\r\n").startswith(b"HTTP/1.1 100 Continue")
        s.sendall(raw)
        status, _, body = reader.answer()
    assert status == 200, body
    assert fakes[1].posts()[-1].body["prompt"] == "continue"


def test_a_kept_alive_connections_next_head_has_the_header_deadline(gateway):
    with connect(gateway) as s:
        s.sendall(request(completion("first")))
        reader = Reader(s)
        assert reader.answer()[0] == 200
        started = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: gw\r\n")  # and nothing more
        with pytest.raises(EOFError):
            reader.answer()
    assert time.monotonic() - started < 4


def test_a_malformed_request_line_is_an_openai_shaped_400(gateway):
    with connect(gateway) as s:
        s.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, headers, body = Reader(s).answer()
    assert status == 400 and headers["connection"] == "close"
    assert json.loads(body)["error"] == {
        "message": "invalid HTTP/1.1 request",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }


def test_unknown_paths_and_methods_are_404_and_405(gateway):
    assert httpx.get(gateway.url + "/nowhere", timeout=5).status_code == 404
    assert httpx.get(gateway.url + "/v1/completions", timeout=5).status_code == 405


def test_a_client_that_closes_mid_stream_cancels_the_decode_leg(gateway, fakes):
    decode = fakes[1]
    sent = []
    stopped = threading.Event()

    def events():
        try:
            for _ in range(100):
                sent.append(1)
                yield EVENT
                time.sleep(0.05)
            yield b"data: [DONE]\n\n"
        finally:
            stopped.set()

    decode.answer = lambda body: (200, events())
    with connect(gateway) as s:
        s.sendall(request(completion("stream me", stream=True), "gone-1"))
        reader = Reader(s)
        assert reader.until(b"\r\n\r\n").startswith(b"HTTP/1.1 200")
        reader.until(b"\n\n")  # the first event reached the client
    # The gateway closes the engine's connection: the engine's writes fail
    # long before its 100 events (5 s) are out.
    assert stopped.wait(10), "the decode leg was not cancelled"
    assert len(sent) < 60, len(sent)
    assert wait_until(
        lambda: metric(gateway.url, "pdfleet_gateway_engine_inflight_requests", role="decode") == 0,
        10,
    )


def test_sigterm_lets_a_running_stream_finish_and_exits_0(fakes, tmp_path):
    decode = fakes[1]

    def events():
        for _ in range(10):
            yield EVENT
            time.sleep(0.1)
        yield b"data: [DONE]\n\n"

    decode.answer = lambda body: (200, events())
    gw = start_gateway(gateway_args(fakes), tmp_path)
    try:
        with connect(gw) as s:
            s.sendall(request(completion("stream", stream=True), "stop-1"))
            reader = Reader(s)
            assert reader.until(b"\r\n\r\n").startswith(b"HTTP/1.1 200")
            reader.until(b"\n\n")
            gw.signal(signal.SIGTERM)
            rest = b""
            with pytest.raises(EOFError):  # noqa: PT012 (reads until the connection ends; the stream ends, then the connection)
                while True:
                    rest += reader.until(b"\r\n")
        assert b"data: [DONE]" in rest
        assert gw.proc.wait(20) == 0
    finally:
        gw.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(gw.url + "/health", headers=auth_headers(KEY), timeout=2)
