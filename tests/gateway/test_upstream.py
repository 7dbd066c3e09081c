"""The gateway's HTTP/1.1 client for engine calls, against real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest

from pdfleet.engine.http import upstream
from pdfleet.engine.http.upstream import UpstreamClient, UpstreamConnectError, UpstreamError


class Server:
    """A scripted HTTP/1.1 server: ``handler(reader, writer, request_body)`` answers
    each request; every connection and finished request is recorded."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.connections = 0
        self.bodies: list[bytes] = []
        self.closed = asyncio.Event()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 2)

    async def _serve(self, reader, writer) -> None:
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    break
                length = 0
                for line in head.decode().split("\r\n")[1:]:
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":")[1])
                body = await reader.readexactly(length)
                self.bodies.append(body)
                if await self.handler(reader, writer, body) == "close":
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.closed.set()
            writer.close()


async def json_answer(reader, writer, body):
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()


async def sse_answer(reader, writer, body):
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n")
    writer.write(b"transfer-encoding: chunked\r\n\r\n")
    for event in (b'data: {"a": 1}\n\n', b'data: {"b": 2}\n\n', b"data: [DONE]\n\n"):
        writer.write(b"%x\r\n%s\r\n" % (len(event), event))
        await writer.drain()
        await asyncio.sleep(0.01)
    writer.write(b"0\r\n\r\n")
    await writer.drain()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_json_answers_and_kept_alive_connections():
    async def main():
        server = Server(json_answer)
        async with server as url:
            client = UpstreamClient(connect_timeout=2)
            for i in range(3):
                resp = await client.post(url + "/v1/completions", b'{"i": %d}' % i, {}, 5)
                assert resp.status_code == 200 and resp.json() == {"i": i}
                assert resp.headers["content-type"] == "application/json"
            await client.aclose()
        assert server.connections == 1  # one connection served all three

    run(main())


def test_idle_connections_per_engine_are_bounded(monkeypatch):
    monkeypatch.setattr(upstream, "MAX_IDLE_PER_ENGINE", 2)

    async def main():
        server = Server(json_answer)
        async with server as url:
            client = UpstreamClient(connect_timeout=2)
            answers = await asyncio.gather(
                *(client.post(url + "/v1/completions", b"{}", {}, 5) for _ in range(5))
            )
            assert all(a.status_code == 200 for a in answers)
            assert server.connections == 5
            assert sum(len(idle) for idle in client._idle.values()) == 2
            await client.aclose()

    run(main())


def test_chunked_stream_is_relayed_event_by_event_and_reused():
    async def main():
        server = Server(sse_answer)
        async with server as url:
            client = UpstreamClient(connect_timeout=2)
            for _ in range(2):
                resp = await client.stream(url + "/v1/completions", b"{}", {"x-request-id": "r1"})
                events = [chunk async for chunk in resp.aiter_raw()]
                await resp.aclose()
                assert b"".join(events).endswith(b"data: [DONE]\n\n")
                assert len(events) == 3
            await client.aclose()
        assert server.connections == 1

    run(main())


async def sse_at_once(reader, writer, body):
    events = b'data: {"a": 1}\n\ndata: [DONE]\n\n'
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(events), events)
    )
    await writer.drain()


def test_what_is_buffered_reads_as_the_iterator_would_and_the_end_reuses_the_connection():
    """``read_buffered`` gives what the next ``aiter_raw`` step would without
    a step (the iterator goes on after it), b"" at the end; ``drained`` ends
    a body read whole. Each end leaves the connection to the next request,
    as the iterator's end does."""

    async def arrived(resp):
        while not resp.received():  # the whole answer is one write of the server's
            await asyncio.sleep(0.01)

    async def main():
        server = Server(sse_at_once)
        async with server as url:
            client = UpstreamClient(connect_timeout=2)
            whole = b'data: {"a": 1}\n\ndata: [DONE]\n\n'
            # Read, then the end read too.
            resp = await client.stream(url + "/v1/completions", b"{}", {})
            await arrived(resp)
            assert resp.buffered() and resp.read_buffered() == whole
            assert resp.buffered() and resp.read_buffered() == b""
            assert not resp.drained()  # (already released)
            resp.close()
            # Read, then drained.
            resp = await client.stream(url + "/v1/completions", b"{}", {})
            await arrived(resp)
            assert not resp.drained()  # its body is unread
            assert resp.read_buffered() == whole and resp.drained()
            resp.close()
            # Read, then the iterator: it only ends.
            resp = await client.stream(url + "/v1/completions", b"{}", {})
            await arrived(resp)
            chunks = resp.aiter_raw()
            assert resp.read_buffered() == whole
            assert [chunk async for chunk in chunks] == []
            await resp.aclose()
            await client.aclose()
        assert server.connections == 1

    run(main())


def test_an_abandoned_stream_closes_its_connection():
    async def main():
        server = Server(sse_answer)
        async with server as url:
            client = UpstreamClient(connect_timeout=2)
            resp = await client.stream(url + "/v1/completions", b"{}", {})
            chunks = resp.aiter_raw()
            assert (await anext(chunks)).startswith(b"data:")
            await resp.aclose()  # the client went away: the engine must see the end
            await asyncio.wait_for(server.closed.wait(), 5)
            resp = await client.post(url + "/v1/completions", b"{}", {}, 5)
            assert resp.status_code == 200
            await client.aclose()
        assert server.connections == 2

    run(main())


def test_a_stale_kept_alive_connection_is_retried_on_a_new_one(monkeypatch):
    async def once_then_close(reader, writer, body):
        await json_answer(reader, writer, body)
        return "close"  # closes without saying so (no "connection: close")

    async def main():
        server = Server(once_then_close)
        async with server as url:
            client = UpstreamClient(connect_timeout=2)
            assert (await client.post(url + "/a", b"1", {}, 5)).content == b"1"
            await asyncio.wait_for(server.closed.wait(), 5)
            # Even if the pool cannot tell the connection is dead, the request is
            # resent on a new connection, not failed.
            monkeypatch.setattr(upstream._Conn, "usable", lambda self, now, expiry: True)
            assert (await client.post(url + "/a", b"2", {}, 5)).content == b"2"
            await client.aclose()
        assert server.connections == 2 and server.bodies == [b"1", b"2"]

    run(main())


def test_refused_connections_timeouts_and_garbage_are_distinct_errors():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]

    async def slow(reader, writer, body):
        await reader.read()  # never answers; returns when the client hangs up
        return "close"

    async def garbage(reader, writer, body):
        writer.write(b"SSH-2.0-nope\r\n\r\n")
        await writer.drain()
        return "close"

    async def main():
        client = UpstreamClient(connect_timeout=2)
        with pytest.raises(UpstreamConnectError):
            await client.post(f"http://127.0.0.1:{free}/v1/completions", b"{}", {}, 5)
        server = Server(slow)
        async with server as url:
            with pytest.raises(TimeoutError):
                await client.post(url + "/v1/completions", b"{}", {}, 0.2)
            await asyncio.wait_for(server.closed.wait(), 5)  # the engine saw the end
        async with Server(garbage) as url:
            with pytest.raises(UpstreamError, match="not an HTTP/1.1 answer"):
                await client.post(url + "/v1/completions", b"{}", {}, 5)
        with pytest.raises(UpstreamError, match="not an http"):
            await client.post("ftp://x/y", b"", {}, 5)
        await client.aclose()

    run(main())


def test_headers_and_reason_are_read_from_the_head_when_asked():
    """The parser makes no call per header: an answer's headers and reason
    phrase are read from its head when asked, also after its connection went
    on to the next answer, and from a head that came in several reads."""
    heads = [
        b"HTTP/1.1 200 Fine By Me\r\nContent-Type: application/json\r\n"
        b"X-Twice: 1\r\nx-twice:  2 \r\nX-Empty:\r\n",
        b"HTTP/1.1 201\r\nContent-Type: text/plain\r\n",
    ]

    async def answer(reader, writer, body):
        head = heads[(len(server.bodies) - 1) % 2]
        whole = head + b"content-length: %d\r\n\r\n%s" % (len(body), body)
        for i in range(0, len(whole), 7):  # the head in pieces, across reads
            writer.write(whole[i : i + 7])
            await writer.drain()
            await asyncio.sleep(0)

    server = Server(answer)

    async def main():
        async with server as url:
            client = UpstreamClient(connect_timeout=2)
            first = await client.post(url + "/a", b'{"n": 1}', {}, 5)
            second = await client.post(url + "/a", b"two", {}, 5)
            assert server.connections == 1  # the first answer's connection served the second
            assert first.reason_phrase == "Fine By Me" and second.reason_phrase == ""
            assert first.status_code == 200 and second.status_code == 201
            assert first.header(b"content-type") == b"application/json"
            assert first.headers == {
                "content-type": "application/json",
                "x-twice": "2",
                "x-empty": "",
                "content-length": "8",
            }
            assert second.content == b"two" and second.headers["content-type"] == "text/plain"
            await client.aclose()

    run(main())


def test_a_body_without_length_ends_with_the_connection_and_is_not_kept():
    async def until_close(reader, writer, body):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n" + body)
        await writer.drain()
        return "close"

    async def main():
        server = Server(until_close)
        async with server as url:
            client = UpstreamClient(connect_timeout=2)
            resp = await client.post(url + "/a", b"all of it", {}, 5)
            assert resp.content == b"all of it" and resp.header(b"content-type") == b"text/plain"
            assert not client._idle.get(resp._key)  # not put back: it is closed
            assert (await client.post(url + "/a", b"again", {}, 5)).content == b"again"
            await client.aclose()
        assert server.connections == 2

    run(main())


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/1.1 200 OK\ncontent-length: 2\n\n",  # bare LF line ends
        b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-folded: a\r\n b\r\n\r\n",  # a folded line
    ],
)
def test_a_head_of_other_than_crlf_lines_is_refused(head):
    """What ``_header`` and ``_parse_headers`` rely on: the parser takes only
    CRLF lines, one per header."""

    refused_answer(head + b"ok", "not an HTTP/1.1 answer")


def refused_answer(answer: bytes, match: str) -> None:
    """A request answered ``answer`` (then closed) raises an UpstreamError
    matching ``match``."""

    async def scripted(reader, writer, body):
        writer.write(answer)
        await writer.drain()
        return "close"

    async def main():
        async with Server(scripted) as url:
            client = UpstreamClient(connect_timeout=2)
            with pytest.raises(UpstreamError, match=match):
                await client.post(url + "/a", b"{}", {}, 5)
            await client.aclose()

    run(main())


def test_a_204_without_length_is_not_kept_and_a_kept_connection_holds_no_head():
    """A 204 (or 304) without a length is closed: bytes an engine sent after it
    would be read as the next answer. A connection put back keeps nothing of
    its last answer (the response holds its own head)."""

    async def no_content(reader, writer, body):
        if body != b"none":
            return await json_answer(reader, writer, body)
        writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        await writer.drain()
        # A connection used again gets a stray answer before its own.
        if await reader.read(1):
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale")
            await writer.drain()
        return "close"

    async def main():
        server = Server(no_content)
        async with server as url:
            client = UpstreamClient(connect_timeout=2)
            first = await client.post(url + "/a", b"none", {}, 5)
            assert first.status_code == 204 and first.content == b""
            assert not client._idle.get(first._key)
            second = await client.post(url + "/a", b"fresh", {}, 5)
            assert second.content == b"fresh"
            kept = client._idle[second._key]
            assert kept and all(conn.head == b"" for conn in kept)
            assert second.header(b"content-length") == b"5"
            await client.aclose()
        assert server.connections == 2

    run(main())


def test_an_interim_head_before_the_final_one_in_one_read_is_refused():
    """A 1xx nobody asked for, whether the final head follows in the same read
    or a later one: an error, not the final answer with the interim's headers."""

    refused_answer(
        b"HTTP/1.1 100 Continue\r\n\r\n"
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}",
        "interim",
    )


def test_a_head_over_the_bound_is_refused_also_when_it_comes_whole_in_one_read():
    """The head's bound holds however the head arrives: over many reads or as
    one read that also holds its end and the body."""
    filler = b"x-pad: " + b"a" * (upstream.MAX_HEAD_BYTES + 10) + b"\r\n"
    refused_answer(b"HTTP/1.1 200 OK\r\n" + filler + b"content-length: 2\r\n\r\n{}", "too large")


@pytest.mark.parametrize(
    "stray",
    [
        b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nstale",  # a second answer
        b"\r\nJUNK\r\n\r\n",  # no answer at all
        b"tail beyond the length",
    ],
    ids=["answer", "junk", "overlong"],
)
def test_bytes_after_an_answer_in_its_read_leave_it_whole_and_the_connection_unused(stray):
    """An engine that sends more than its answer in the same write: the answer
    stands, the extra bytes are read into nothing, and the next request goes on
    a new connection."""

    async def extra(reader, writer, body):
        if body != b"extra":
            return await json_answer(reader, writer, body)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok" + stray)
        await writer.drain()
        # Kept open: a client that read the stray bytes as the next answer would
        # send its next request here.
        await reader.read(1)
        return "close"

    async def main():
        server = Server(extra)
        async with server as url:
            client = UpstreamClient(connect_timeout=2)
            first = await client.post(url + "/a", b"extra", {}, 5)
            assert first.status_code == 200 and first.content == b"ok"
            second = await client.post(url + "/a", b"fresh", {}, 5)
            assert second.content == b"fresh"
            await client.aclose()
        assert server.connections == 2

    run(main())


def test_a_stray_head_on_an_idle_connection_closes_it_before_it_is_used_again():
    """Part of a head an engine sends on a connection idle in the pool: the
    connection is dropped, so the next request's answer is not read after it."""
    idle, sent = asyncio.Event(), asyncio.Event()

    async def same_connection(reader, writer, body):
        await json_answer(reader, writer, body)
        if body == b"one":
            await idle.wait()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-le")
            await writer.drain()
            sent.set()

    async def main():
        server = Server(same_connection)
        async with server as url:
            client = UpstreamClient(connect_timeout=2)
            first = await client.post(url + "/a", b"one", {}, 5)
            assert first.content == b"one"
            (conn,) = client._idle[first._key]
            idle.set()
            await sent.wait()
            # The bytes reach the client's loop soon after; a client that kept the
            # connection would send the next request on it (bounded wait).
            deadline = asyncio.get_running_loop().time() + 2
            while not conn.closed and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            second = await client.post(url + "/a", b"two", {}, 5)
            assert second.content == b"two"
            await client.aclose()
        assert server.connections == 2

    run(main())
