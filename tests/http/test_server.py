"""pdfleet's HTTP server (engine/http/server.py) in this process, against raw sockets.

The engine's FastAPI app and the gateway's route table serve through it; the
real processes are tested in tests/server/ and tests/gateway/. Here: an ASGI
app's lifespan and its requests (keep-alive, pipelining, a stream's head
before its first chunk, a disconnect seen by every ``receive``), a route
table's unknown routes and methods, the chunk bound, and the stop from
another thread.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from contextlib import asynccontextmanager

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from helpers.server import free_port, wait_until

from pdfleet.engine.contracts.http_limits import RequestLimits
from pdfleet.engine.http.asgi import BytesResponse, RouteTable
from pdfleet.engine.http.server import HttpServer

LIMITS = RequestLimits(max_body_bytes=4096, max_chunk_bytes=64, header_timeout=2, body_timeout=2)


class Served:
    """``server`` serving on a free port from a thread of its own, until ``stop``."""

    def __init__(self, server: HttpServer) -> None:
        self.server, self.port = server, free_port()
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert wait_until(self._listening, 10) or self.code is not None

    def _run(self) -> None:
        self.code = asyncio.run(self.server.serve("127.0.0.1", self.port))

    def _listening(self) -> bool:
        try:
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            return False
        return True

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)

    def stop(self) -> int | None:
        self.server.stop_threadsafe()
        self.thread.join(10)
        assert not self.thread.is_alive()
        return self.code


def read_answers(s: socket.socket, count: int) -> list[tuple[int, dict[str, str], bytes]]:
    """``count`` answers off ``s`` (Content-Length or chunked bodies)."""
    buf, out = b"", []
    while len(out) < count:
        while b"\r\n\r\n" not in buf:
            buf += s.recv(65536) or b""
        head, buf = buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
        if "content-length" in headers:
            size = int(headers["content-length"])
            while len(buf) < size:
                buf += s.recv(65536)
            body, buf = buf[:size], buf[size:]
        else:
            body = b""
            while True:
                while b"\r\n" not in buf:
                    buf += s.recv(65536)
                line, buf = buf.split(b"\r\n", 1)
                size = int(line, 16)
                while len(buf) < size + 2:
                    buf += s.recv(65536)
                body, buf = body + buf[:size], buf[size + 2 :]
                if size == 0:
                    break
        out.append((int(lines[0].split()[1]), headers, body))
    return out


def read_until_closed(s: socket.socket) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


@pytest.fixture
def fastapi_app():
    """A FastAPI app that records its lifespan, streams on demand and watches disconnects."""
    events: list[str] = []
    release = asyncio.Event()
    gone: list[str] = []

    @asynccontextmanager
    async def lifespan(app):
        events.append("startup")
        yield
        events.append("shutdown")

    app = FastAPI(lifespan=lifespan)

    @app.get("/n/{n}")
    async def number(n: int):
        return {"n": n}

    @app.post("/echo")
    async def echo(body: dict):
        return body

    @app.get("/stream")
    async def stream():
        async def chunks():
            await release.wait()
            yield b"data: first\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    @app.get("/hold")
    async def hold(request_: __import__("fastapi").Request):
        async def watch(name: str) -> None:
            while (await request_.receive())["type"] != "http.disconnect":
                pass
            gone.append(name)

        gone.append("waiting")
        await asyncio.gather(watch("a"), watch("b"))
        return {}

    return app, events, release, gone


def test_an_asgi_app_runs_its_lifespan_and_serves_kept_alive_and_pipelined_requests(
    fastapi_app,
):
    app, events, _, _ = fastapi_app
    served = Served(HttpServer(app, LIMITS, name="test"))
    assert events == ["startup"]
    with served.connect() as s:
        body = json.dumps({"a": 1}).encode()
        # Three requests in one write: answered in order, on one connection.
        s.sendall(
            b"GET /n/1 HTTP/1.1\r\nhost: x\r\n\r\n"
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s"
            b"GET /n/3 HTTP/1.1\r\nhost: x\r\n\r\n" % (len(body), body)
        )
        answers = read_answers(s, 3)
    assert [(status, json.loads(b)) for status, _, b in answers] == [
        (200, {"n": 1}),
        (200, {"a": 1}),
        (200, {"n": 3}),
    ]
    assert served.stop() == 0 and events == ["startup", "shutdown"]


def test_a_stream_head_goes_out_before_its_first_chunk(fastapi_app):
    app, _, release, _ = fastapi_app
    served = Served(HttpServer(app, LIMITS))
    try:
        with served.connect() as s:
            s.sendall(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
            head = b""
            while b"\r\n\r\n" not in head:
                head += s.recv(65536)
            # The head is here while the stream's first chunk is still to come.
            assert head.startswith(b"HTTP/1.1 200") and b"transfer-encoding: chunked" in head
            assert not release.is_set()
            served.server.loop.call_soon_threadsafe(release.set)
            rest = head.split(b"\r\n\r\n", 1)[1]
            while not rest.endswith(b"0\r\n\r\n"):
                rest += s.recv(65536)
            assert b"data: first" in rest
    finally:
        served.stop()


def test_a_client_that_goes_away_is_seen_by_every_receive(fastapi_app):
    app, _, _, gone = fastapi_app
    served = Served(HttpServer(app, LIMITS))
    try:
        with served.connect() as s:
            s.sendall(b"GET /hold HTTP/1.1\r\nhost: x\r\n\r\n")
            assert wait_until(lambda: gone == ["waiting"], 10), gone
        assert wait_until(lambda: sorted(gone) == ["a", "b", "waiting"], 10), gone
    finally:
        served.stop()


def test_an_app_whose_startup_fails_is_not_served():
    @asynccontextmanager
    async def lifespan(app):
        raise RuntimeError("no model")
        yield

    server = HttpServer(FastAPI(lifespan=lifespan), LIMITS)
    assert asyncio.run(server.serve("127.0.0.1", free_port())) == 1


def route_table() -> RouteTable:
    @asynccontextmanager
    async def lifespan(app):
        yield

    app = RouteTable(lifespan, lambda request, e: BytesResponse(b"", 500, []))

    @app.get("/only-get")
    async def only_get(request):
        return BytesResponse(b"{}", 200, [(b"content-type", b"application/json")])

    @app.post("/sum")
    async def total(request):
        body = b""
        while True:
            message = await request.receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        return BytesResponse(b"%d" % len(body), 200, [])

    return app


def test_a_route_tables_unknown_routes_and_methods_are_openai_errors():
    served = Served(HttpServer(route_table(), LIMITS))
    try:
        with served.connect() as s:
            s.sendall(
                b"GET /nope HTTP/1.1\r\nhost: x\r\n\r\nPOST /only-get HTTP/1.1\r\nhost: x\r\n"
                b"content-length: 0\r\n\r\n"
            )
            (s404, _, b404), (s405, h405, b405) = read_answers(s, 2)
    finally:
        served.stop()
    assert (s404, json.loads(b404)["error"]) == (
        404,
        {"message": "Not Found", "type": "NotFoundError", "param": None, "code": 404},
    )
    assert (s405, h405["allow"], json.loads(b405)["error"]["code"]) == (405, "GET", 405)


def test_a_chunk_over_the_bound_is_refused_whether_announced_or_sent():
    served = Served(HttpServer(route_table(), LIMITS))
    head = b"POST /sum HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
    try:
        with served.connect() as s:  # within the bound: served
            s.sendall(
                head + b"40\r\n" + b"a" * 64 + b"\r\n10;ext=1\r\n" + b"b" * 16 + b"\r\n0\r\n\r\n"
            )
            assert read_answers(s, 1)[0][::2] == (200, b"80")
        for sent in (
            b"41\r\nab",  # announced past the bound, its bytes never sent: refused at once
            b"5\r\nhello\r\n1000000000000000\r\n",  # the second size line, split from its data
            b"41\r\n" + b"a" * 65 + b"\r\n0\r\n\r\n",  # sent whole past the bound
        ):
            with served.connect() as s:
                s.sendall(head + sent)
                out = read_until_closed(s)
            assert out.startswith(b"HTTP/1.1 413"), out[:200]
            error = json.loads(out.split(b"\r\n\r\n", 1)[1])["error"]
            assert (
                error["type"] == "RequestTooLargeError" and "--max-chunk-bytes" in error["message"]
            )
    finally:
        served.stop()


def test_a_chunked_requests_trailer_fields_never_reach_the_next_request():
    """Trailer fields come through the parser's header callback after the
    request's head went into its request: dropped, not the next request's
    head (whose own ``authorization`` they would otherwise replace)."""
    app = FastAPI()

    @app.api_route("/headers", methods=["GET", "POST"])
    async def headers(request: Request) -> dict:
        await request.body()
        return {"headers": request.headers.items()}

    served = Served(HttpServer(app, LIMITS))
    try:
        with served.connect() as s:
            s.sendall(
                b"POST /headers HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n"
                b"authorization: Bearer first\r\n\r\n"
                b"2\r\nhi\r\n0\r\nauthorization: Bearer attacker\r\nx-from-trailer: injected\r\n\r\n"
            )
            first = read_answers(s, 1)[0]
            s.sendall(b"GET /headers HTTP/1.1\r\nhost: x\r\nauthorization: Bearer victim\r\n\r\n")
            second = read_answers(s, 1)[0]
        assert first[0] == second[0] == 200
        assert ["authorization", "Bearer first"] in json.loads(first[2])["headers"]
        seen = json.loads(second[2])["headers"]
        assert ["authorization", "Bearer victim"] in seen
        assert not any(name in ("x-from-trailer",) or "attacker" in value for name, value in seen)
    finally:
        served.stop()
