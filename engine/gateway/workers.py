"""``--workers N``: N gateway processes on one port, and one view of their metrics.

Each worker is a whole gateway (its own engine pool, health checks, metric
scrapes, prefix table and breaker) listening on the same address with
``SO_REUSEPORT``, so the kernel spreads connections over the workers and each
uses its own core. Routing stays as good as one process's: every worker
scrapes every engine's load and (with KV events) reads every engine's block
events, so they all see the same fleet; only the in-flight counts of other
workers are seen one scrape late, through the engines' own queue gauges.

``/metrics`` must not depend on which worker a scrape lands on: each worker
also serves its own exposition on a unix socket in a private directory, and
whichever worker answers ``/metrics`` adds its siblings' series to its own
(counters and histograms summed; in-flight and held requests summed; health
and breaker gauges, and the ejection and stall counts of an engine, which
every worker observes, the largest). ``/engines`` is the answering worker's view.
What a worker learns from its own requests (a stall ejection, a failed KV
hand-off, a pair used) it passes to the others as events (``Siblings``), so
stall ejections and the KV-pair breaker agree across workers.

The supervisor (the ``pdfleet gateway`` process itself) starts the workers,
restarts one that dies, gives up when they keep dying at startup (a port in
use), and on SIGTERM/SIGINT stops them gracefully. See docs/gateway.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from pdfleet.engine.config import metrics as m
from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.config.launch import python_module

logger = logging.getLogger("pdfleet.gateway")

# A worker that exits this soon after its start counts as failing to start.
QUICK_EXIT_SECONDS = 5.0
# Consecutive quick exits of one worker after which the gateway gives up.
MAX_QUICK_EXITS = 3
# Seconds the workers get to stop gracefully before they are killed.
STOP_TIMEOUT = 15.0
# Seconds a sibling has to hand over its metrics.
SIBLING_TIMEOUT = 2.0
# Gauges whose workers' values add up (the rest: the largest value).
SUMMED_GAUGES = frozenset({m.GATEWAY_ENGINE_INFLIGHT.family, m.GATEWAY_HELD_REQUESTS.family})
# Counters of what happened to an engine (not to a request): every worker sees
# the same event, so the workers' largest count is the engine's.
ENGINE_EVENT_COUNTERS = frozenset(
    {m.GATEWAY_ENGINE_EJECTIONS.family, m.GATEWAY_ENGINE_STALLS.family}
)
# The longest event line a worker accepts from a sibling, and the unread
# backlog after which a sibling that does not read is dropped.
MAX_EVENT_BYTES = 64 * 1024
MAX_EVENT_BACKLOG = 1 << 20
# Seconds a starting worker waits for its event links to the others, and the
# longest pause between tries of a link to a sibling that is (re)starting.
LINK_TIMEOUT = 5.0
LINK_RETRY_MAX = 0.25
ENV_WORKER = "PDFLEET_GATEWAY_WORKER"
"""Set in each worker's environment: ``INDEX/N`` (logs, tests)."""


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening socket that other workers may bind too (SO_REUSEPORT)."""
    if not hasattr(socket, "SO_REUSEPORT"):
        raise ValueError("--workers above 1 needs SO_REUSEPORT (Linux, BSD or macOS)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(4096)
    sock.set_inheritable(True)
    return sock


# -- metrics of all workers ------------------------------------------------------------


class Siblings:
    """This worker's place among the others: serves its metrics, reads theirs,
    and passes the events that must change every worker's routing state (a
    stall ejection, a failed KV hand-off) to the others.

    Events are JSON lines on a unix socket per worker, written to kept-open
    connections without waiting (``publish`` is synchronous: the bytes are in
    the siblings' sockets before the request that caused them is answered).
    A sibling that is down or restarting misses them; it starts with fresh
    state, as a new gateway would."""

    def __init__(self, run_dir: str, index: int, count: int) -> None:
        self.run_dir = Path(run_dir)
        self.index, self.count = index, count
        self._servers: list[asyncio.AbstractServer] = []
        self._peers: dict[int, asyncio.StreamWriter] = {}
        self._links: list[asyncio.Task] = []
        self._on_event: Callable[[dict[str, Any]], None] = lambda event: None

    def path(self, index: int) -> str:
        return str(self.run_dir / f"metrics-{index}.sock")

    def events_path(self, index: int) -> str:
        return str(self.run_dir / f"events-{index}.sock")

    async def serve(
        self,
        exposition: Callable[[], bytes],
        on_event: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """Hand ``exposition()`` to every sibling that connects; apply their
        events with ``on_event``; keep a connection to each sibling for ours."""

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                writer.write(exposition())
                await writer.drain()
            finally:
                writer.close()

        if on_event is not None:
            self._on_event = on_event
        for path, handler in (
            (self.path(self.index), handle),
            (self.events_path(self.index), self._events),
        ):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a restarted worker's predecessor left it
            self._servers.append(
                await asyncio.start_unix_server(handler, path, limit=MAX_EVENT_BYTES)
            )
        self._links = [
            asyncio.create_task(self._link(i), name=f"pdfleet-gateway-sibling-{i}")
            for i in range(self.count)
            if i != self.index
        ]
        # Serve only once every sibling hears this worker's events (they start
        # together); one that does not come up within LINK_TIMEOUT is left to
        # the reconnecting link.
        deadline = time.monotonic() + LINK_TIMEOUT
        while len(self._peers) < self.count - 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if len(self._peers) < self.count - 1:
            missing = sorted(set(range(self.count)) - {self.index} - set(self._peers))
            logger.warning(
                "gateway worker %d: no event link to workers %s yet", self.index, missing
            )

    async def _events(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A sibling's event stream: one JSON object a line, until it closes."""
        try:
            while line := await reader.readline():
                try:
                    event = json.loads(line)
                    self._on_event(event)
                except Exception:  # a bad event never stops the stream or the worker
                    logger.exception(
                        "gateway worker %d: bad sibling event %r", self.index, line[:200]
                    )
        except (OSError, asyncio.LimitOverrunError, ValueError) as e:
            logger.warning("gateway worker %d: sibling event stream broke: %s", self.index, e)
        finally:
            writer.close()

    async def _link(self, index: int) -> None:
        """Keep a connection to sibling ``index``'s event socket (reconnecting
        while it starts or restarts)."""
        delay = 0.05
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(self.events_path(index))
            except OSError:
                await asyncio.sleep(delay)
                delay = min(LINK_RETRY_MAX, delay * 2)
                continue
            delay = 0.05
            self._peers[index] = writer
            try:
                await reader.read()  # nothing comes back: EOF when the sibling goes
            except OSError:
                pass
            finally:
                if self._peers.get(index) is writer:
                    del self._peers[index]
                writer.close()

    def publish(self, event: dict[str, Any]) -> None:
        """Send ``event`` to every connected sibling now (no await)."""
        line = json.dumps(event).encode() + b"\n"
        for index, writer in list(self._peers.items()):
            transport = writer.transport
            if writer.is_closing() or transport.get_write_buffer_size() > MAX_EVENT_BACKLOG:
                logger.warning(
                    "gateway worker %d: sibling %d does not read events", self.index, index
                )
                del self._peers[index]
                writer.close()
                continue
            writer.write(line)

    async def close(self) -> None:
        for task in self._links:
            task.cancel()
        await asyncio.gather(*self._links, return_exceptions=True)
        for writer in self._peers.values():
            writer.close()
        self._peers.clear()
        for server in self._servers:
            server.close()
            with contextlib.suppress(Exception):
                await server.wait_closed()

    async def _read(self, index: int) -> bytes | None:
        try:
            async with asyncio.timeout(SIBLING_TIMEOUT):
                reader, writer = await asyncio.open_unix_connection(self.path(index))
                try:
                    return await reader.read()
                finally:
                    writer.close()
        except (OSError, TimeoutError) as e:  # restarting: its series are back next scrape
            logger.warning("gateway worker %d: no metrics from worker %d: %s", self.index, index, e)
            return None

    async def merged(self, own: bytes) -> bytes:
        """``own`` plus every sibling's series, as one exposition."""
        others = [i for i in range(self.count) if i != self.index]
        texts = await asyncio.gather(*(self._read(i) for i in others))
        return merge_expositions([own, *(t for t in texts if t)])


def merge_expositions(texts: Iterable[bytes]) -> bytes:
    """Prometheus text of several processes of one kind as one: samples with
    equal name and labels summed (counters, histograms, SUMMED_GAUGES) or the
    largest kept (other gauges); ``*_created`` series dropped."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, str, dict[tuple, float]]] = {}
    for text in texts:
        for fam in text_string_to_metric_families(text.decode("utf-8")):
            _, _, samples = families.setdefault(fam.name, (fam.type, fam.documentation, {}))
            for s in fam.samples:
                if s.name.endswith("_created"):
                    continue
                key = (s.name, tuple(sorted(s.labels.items())))
                if key not in samples:
                    samples[key] = s.value
                elif (fam.type == "gauge" and fam.name not in SUMMED_GAUGES) or (
                    fam.name in ENGINE_EVENT_COUNTERS
                ):
                    samples[key] = max(samples[key], s.value)
                elif fam.type != "info":
                    samples[key] += s.value
    out: list[str] = []
    for name, (kind, doc, samples) in families.items():
        shown = name + {"counter": "_total", "info": "_info"}.get(kind, "")
        doc = doc.replace("\\", r"\\").replace("\n", r"\n")
        out.append(f"# HELP {shown} {doc}\n# TYPE {shown} {kind if kind != 'info' else 'gauge'}\n")
        for (sample, labels), value in samples.items():
            if labels:
                inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
                out.append(f"{sample}{{{inner}}} {_number(value)}\n")
            else:
                out.append(f"{sample} {_number(value)}\n")
    return "".join(out).encode("utf-8")


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value)}.0"
    return repr(float(value))


# -- the worker ------------------------------------------------------------------------


def worker_main() -> int:
    """A worker's entry (``python -m pdfleet.engine.gateway.workers``): its
    config, index, count and run directory come as JSON on stdin (never pickle)."""
    job = json.load(sys.stdin)
    config = GatewayConfig(**job["config"])
    index, count, run_dir = job["index"], job["count"], job["run_dir"]
    _die_with_parent()
    os.environ[ENV_WORKER] = f"{index}/{count}"
    from .app import run_gateway

    return run_gateway(config, Siblings(run_dir, index, count))


def _die_with_parent() -> None:
    """Linux: SIGTERM this worker when the supervisor dies (even by SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(Exception):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the supervisor died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)


# -- the supervisor --------------------------------------------------------------------


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.quick_exits = 0


def serve_workers(config: GatewayConfig) -> int:
    """Run ``config.workers`` workers until SIGTERM/SIGINT; 0 after a graceful stop."""
    count = config.workers
    # Fail here, clearly, when the address is taken by a process not of ours.
    reuseport_socket(config.host, config.port).close()
    run_dir = tempfile.mkdtemp(prefix="pdfleet-gateway-")
    os.chmod(run_dir, 0o700)  # the metrics sockets are for the workers only
    workers = [_Worker(i) for i in range(count)]
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}

    def start(w: _Worker) -> None:
        w.proc = subprocess.Popen(
            python_module("pdfleet.engine.gateway.workers"), stdin=subprocess.PIPE
        )
        assert w.proc.stdin is not None
        job = {
            "config": dataclasses.asdict(config),  # API keys included: a private pipe
            "index": w.index,
            "count": count,
            "run_dir": run_dir,
        }
        w.proc.stdin.write(json.dumps(job).encode())
        w.proc.stdin.close()
        w.started = time.monotonic()

    logger.info("pdfleet gateway: %d workers on %s:%d", count, config.host, config.port)
    failed = False
    try:
        for w in workers:
            start(w)
        while not stopping:
            time.sleep(0.2)
            for w in workers:
                assert w.proc is not None
                code = w.proc.poll()
                if code is None or stopping:
                    continue
                quick = time.monotonic() - w.started < QUICK_EXIT_SECONDS
                w.quick_exits = w.quick_exits + 1 if quick else 0
                if w.quick_exits >= MAX_QUICK_EXITS:
                    logger.error(
                        "gateway worker %d exited %d times at startup (last status %s); "
                        "stopping the gateway",
                        w.index,
                        w.quick_exits,
                        code,
                    )
                    failed = True
                    stopping = True
                    break
                logger.warning("gateway worker %d exited with %s; restarting it", w.index, code)
                start(w)
    finally:
        codes = _stop_all([w.proc for w in workers if w.proc is not None])
        for s, handler in previous.items():
            signal.signal(s, handler)
        shutil.rmtree(run_dir, ignore_errors=True)
    if failed:
        return 1
    return 0 if all(c in (0, -signal.SIGTERM, -signal.SIGINT) for c in codes) else 1


def _stop_all(procs: list[subprocess.Popen]) -> list[int]:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_TIMEOUT
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(p.wait(10))
    return codes


if __name__ == "__main__":
    raise SystemExit(worker_main())
