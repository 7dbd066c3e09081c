"""The request path's shortcuts behave as the general path does.

Leg deadlines (``deadlines.py``), lock-free metrics folded at collection
(``metrics.py``), and the single-engine route that skips the prompt analysis
(``Proxy._sole_route``): each is checked against what it replaced.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from gateway.fake_engine import FakeEngine
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.gateway.app import Gateway
from pdfleet.engine.gateway.call import NOT_ANALYZED, Call
from pdfleet.engine.gateway.deadlines import RESOLUTION, Deadline, current_task
from pdfleet.engine.gateway.discovery import StaticDiscovery
from pdfleet.engine.gateway.engines import EngineLoad
from pdfleet.engine.gateway.metrics import GatewayMetrics

PROMPT = "The harbor was quiet before dawn, and the boats rocked against the pier. " * 8


def test_a_deadline_raises_timeout_error_after_its_time_and_never_before():
    async def main() -> tuple[float, bool]:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError), Deadline(start + 0.2) as d:
            await asyncio.sleep(5)
        waited = loop.time() - start
        # Not fired: the block's own result, and nothing fires later.
        with Deadline(loop.time() + 0.1) as quiet:
            await asyncio.sleep(0)
        await asyncio.sleep(0.2)
        return waited, d.expired() and not quiet.expired()

    waited, ok = asyncio.run(asyncio.wait_for(main(), 10))
    assert ok and 0.2 <= waited < 0.2 + RESOLUTION + 1.0


def test_a_deadline_moved_to_now_fires_at_once_and_a_cancel_from_outside_stays_a_cancel():
    async def rescheduled() -> float:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(TimeoutError), Deadline(start + 60) as d:  # noqa: PT012 (the deadline fires during the await)
            loop.call_later(0.05, d.reschedule, loop.time())  # as the stall watchdog does
            await asyncio.sleep(30)
        return loop.time() - start

    async def cancelled() -> bool:
        async def leg() -> None:
            with Deadline(asyncio.get_running_loop().time() + 60):
                await asyncio.sleep(30)

        task = asyncio.create_task(leg())
        await asyncio.sleep(0.05)
        task.cancel()  # a client that went away: CancelledError, not a timeout
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False

    assert asyncio.run(asyncio.wait_for(rescheduled(), 10)) < 1.0
    assert asyncio.run(asyncio.wait_for(cancelled(), 10))


def exported(registry: CollectorRegistry) -> list[str]:
    """The exposition without its creation timestamps."""
    text = generate_latest(registry).decode()
    return [line for line in text.splitlines() if "_created" not in line]


def test_lock_free_series_export_exactly_what_direct_updates_export():
    buckets = (0.1, 0.5, 1.0)
    values = [0.05, 0.1, 0.3, 0.5, 0.9, 1.0, 2.0, 7.5]  # bounds included: le is inclusive
    direct, folded = CollectorRegistry(), CollectorRegistry()
    for registry, fast in ((direct, False), (folded, True)):
        metrics = GatewayMetrics(registry)
        counter = Counter("c_total", "c", ["k"], registry=registry).labels("a")
        hist = Histogram("h_seconds", "h", ["k"], registry=registry, buckets=buckets).labels("a")
        if fast:
            counter, hist = metrics.fast_counter(counter), metrics.fast_histogram(hist)
        for v in values:
            counter.inc()
            hist.observe(v)
            if fast:
                counter.add_one()  # the request path's inc()
            else:
                counter.inc()
        counter.inc(2.5)
    assert exported(folded) == exported(direct)
    # A second collection adds nothing twice.
    assert exported(folded) == exported(direct)


def healthy_gateway(mode: str, urls: list[str]) -> Gateway:
    config = GatewayConfig(decode=urls, disaggregation_mode=mode, hold_timeout=10)
    gw = Gateway(config, StaticDiscovery([]), fleet_secret=b"")
    from pdfleet.engine.gateway.discovery import Endpoint

    gw.pool.apply([Endpoint(u, "decode") for u in urls])
    for e in gw.pool.engines.values():
        gw.pool.record_success(e, EngineLoad())
    return gw


def test_the_single_engine_route_is_the_general_route_without_prompt_analysis():
    gw = healthy_gateway("Disabled", ["http://d1"])
    proxy, router = gw.proxy, gw.router
    body = {"prompt": PROMPT, "max_tokens": 4}
    info = gw.analyzer.analyze(body, False, gw.pool.block_size)
    general = router.route(info)
    turn = router._rr
    sole = proxy._sole_route()
    assert sole is not None and router._rr == turn + 1  # the round-robin turns on as before
    assert (sole.decode, sole.prefill, sole.decision, sole.reason) == (
        general.decode,
        general.prefill,
        general.decision,
        general.reason,
    )
    # Whatever needs the prompt later gets it analyzed then, exactly.
    call = Call("/v1/completions", "r", 0.0, {}, False, body=body)
    assert proxy.legs.analyzed(call, NOT_ANALYZED) == info
    # Not taken where the prompt can matter: several engines, or another mode.
    assert healthy_gateway("Disabled", ["http://d1", "http://d2"]).proxy._sole_route() is None
    assert healthy_gateway("Conditional", ["http://d1"]).proxy._sole_route() is None
    assert healthy_gateway("Always", ["http://d1"]).proxy._sole_route() is None


class BodyRequest:
    """What ``Proxy.handle`` reads of a request: headers, the whole body."""

    def __init__(self, body: dict) -> None:
        raw = json.dumps(body).encode()
        self.headers = {"content-type": "application/json", "content-length": str(len(raw))}
        self._raw: bytes | None = raw

    def ready_body(self) -> bytes | None:
        raw, self._raw = self._raw, None
        return raw

    def watch_disconnect(self, callback) -> bool:
        return True


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_a_request_on_the_single_engine_route_fails_over_and_counts_as_the_general_one():
    """The sole routable engine refuses the connection: it is ejected, the
    request is held, and it is served by the engine that becomes routable,
    chosen with the prompt analyzed then; counted once as decode_only/disabled."""
    engine = FakeEngine()
    gone = closed_port_url()
    gw = healthy_gateway("Disabled", [gone, engine.url])
    back = gw.pool.engines[engine.url]
    gw.pool.record_failure(back, "down for the test", definitive=True)  # not routable yet
    assert gw.proxy._sole_route().decode.url == gone

    async def main():
        task = asyncio.create_task(
            gw.proxy.handle(BodyRequest({"prompt": PROMPT, "max_tokens": 2}), "/v1/completions")
        )
        deadline = asyncio.get_running_loop().time() + 10
        while gw.pool.engines[gone].routable:  # until the refusal ejected it
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        for _ in range(gw.config.readmit_after):
            gw.pool.record_success(back, EngineLoad())
        response = await asyncio.wait_for(task, 10)
        await gw.upstream.aclose()
        await gw.client.aclose()
        return response

    try:
        response = asyncio.run(main())
    finally:
        engine.server.shutdown()
    assert response.status_code == 200 and json.loads(response.body)["choices"][0]["text"] == "ok"
    assert [s.path for s in engine.seen if s.method == "POST"] == ["/v1/completions"]

    def sample(name: str, **labels: str) -> float:
        for family in gw.metrics.registry.collect():
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    return s.value
        return 0.0

    assert sample("pdfleet_gateway_disagg_decisions_total", reason="disabled") == 1
    assert sample("pdfleet_gateway_retries_total", role="decode") == 1
    assert sample("pdfleet_gateway_upstream_errors_total", engine=gone, kind="connect") == 1
    assert sample("pdfleet_gateway_requests_total", status="200") == 1
    assert sample("pdfleet_gateway_engine_inflight_requests", engine=engine.url) == 0
    # The engine that served it learned the prompt's blocks, as on the general path.
    info = gw.analyzer.analyze({"prompt": PROMPT}, False, gw.pool.block_size)
    assert info.block_hashes
    assert gw.affinity.matched(info.block_hashes, [engine.url])[engine.url] == len(
        info.block_hashes
    )


def test_current_task_is_the_running_task_across_loops_run_one_after_another():
    async def check() -> None:
        with Deadline(None):  # the thread's wheel is this loop's
            assert current_task() is asyncio.current_task()

            async def inner() -> asyncio.Task:
                return current_task()

            child = asyncio.ensure_future(inner())
            assert await child is child

    for _ in range(2):  # a second loop finds the first one's wheel, stopped
        asyncio.run(check())
    assert current_task() is None  # no task, no running loop


class HangUpRequest(BodyRequest):
    """A request whose client hangs up when the test says (``hang_up``)."""

    def __init__(self, body: dict) -> None:
        super().__init__(body)
        self.lost = None

    def watch_disconnect(self, callback) -> bool:
        self.lost = callback
        return True

    def hang_up(self) -> None:
        self.lost()


def answered(gw: Gateway, status: str) -> float:
    """``pdfleet_gateway_requests_total{status}`` as a scrape would show it."""
    text = generate_latest(gw.metrics.registry).decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pdfleet_gateway_requests_total{") and f'status="{status}"' in line
    )


@pytest.mark.parametrize("after_done", [False, True], ids=["mid_stream", "after_done"])
def test_a_client_hanging_up_counts_499_unless_it_had_the_whole_stream(after_done):
    """The client hangs up after one event (499: no answer served), or after the
    last event and [DONE] while the engine's stream has not ended yet (200: it
    had its whole answer; only the leg's end was left)."""

    async def main() -> tuple[float, float]:
        finish = asyncio.Event()

        async def engine(reader, writer) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(
                int(line.split(b":")[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            await reader.readexactly(length)
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"transfer-encoding: chunked\r\n\r\n"
            )
            event = b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n'
            chunk = event + b"data: [DONE]\n\n" if after_done else event
            writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            await writer.drain()
            await finish.wait()  # the rest (at least the stream's last chunk) held back
            writer.close()

        server = await asyncio.start_server(engine, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        gw = healthy_gateway("Disabled", [url])
        request = HangUpRequest({"prompt": PROMPT, "max_tokens": 2, "stream": True})
        before = answered(gw, "499"), answered(gw, "200")
        written = bytearray()

        def write(chunk: bytes) -> None:
            written.extend(chunk)
            if b"[DONE]" in written if after_done else b"data:" in written:
                asyncio.get_running_loop().call_soon(request.hang_up)

        async def relayed() -> None:
            response = await gw.proxy.handle(request, "/v1/completions")
            await response.stream_to(lambda *_: None, write, lambda: None)

        await asyncio.wait_for(asyncio.create_task(relayed()), 10)
        finish.set()
        server.close()
        await gw.upstream.aclose()
        await gw.client.aclose()
        return answered(gw, "499") - before[0], answered(gw, "200") - before[1]

    gone, served = asyncio.run(main())
    assert (gone, served) == ((0.0, 1.0) if after_done else (1.0, 0.0))
