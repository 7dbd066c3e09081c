"""What the workers of ``--workers N`` share: one port, one view of their
metrics, the events that change routing (docs/gateway.md, "Workers").

Each worker is a whole gateway (its own engine pool, health checks, metric
scrapes, prefix table and breaker) listening on the same address with
``SO_REUSEPORT`` (:func:`reuseport_socket`), so the kernel spreads
connections over the workers and each uses its own core. Routing stays as
good as one process's: every worker scrapes every engine's load and (with KV
events) reads every engine's block events, so they all see the same fleet;
only the in-flight counts of other workers are seen one scrape late, through
the engines' own queue gauges.

``/metrics`` must not depend on which worker a scrape lands on: each worker
also serves its own exposition on a unix socket in a private directory, and
whichever worker answers ``/metrics`` adds its siblings' series to its own
(:func:`merge_expositions`: counters and histograms summed; in-flight,
held and queued requests and each worker's share of an engine's capacity
summed; health and breaker gauges, stall limits, and the ejection and stall
counts of an engine, which every worker observes, the largest). ``/engines``
is the answering worker's view. What a worker learns from its own requests
(a stall ejection, a failed KV hand-off, a pair used) it passes to the
others as events (:class:`Siblings`; the events are
``contracts/gateway_events.py``), so stall ejections and the KV-pair
breaker agree across workers. The processes themselves are started and
supervised by ``workers.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path

from ..contracts import metrics as m
from ..contracts.gateway_events import MAX_EVENT_BYTES, SiblingEvent, decode_event, encode_event

logger = logging.getLogger("pdfleet.gateway")

# Seconds a sibling has to hand over its metrics.
SIBLING_TIMEOUT = 2.0
# Gauges whose workers' values add up (the rest: the largest value).
SUMMED_GAUGES = frozenset(
    {
        m.GATEWAY_ENGINE_INFLIGHT.family,
        m.GATEWAY_HELD_REQUESTS.family,
        m.GATEWAY_QUEUED_REQUESTS.family,
        m.GATEWAY_ENGINE_CAPACITY.family,
    }
)
# Counters of what happened to an engine (not to a request): every worker sees
# the same event, so the workers' largest count is the engine's.
ENGINE_EVENT_COUNTERS = frozenset(
    {m.GATEWAY_ENGINE_EJECTIONS.family, m.GATEWAY_ENGINE_STALLS.family}
)
# The unread event backlog (bytes) after which a sibling that does not read is
# dropped (the longest event line is the contract's MAX_EVENT_BYTES).
MAX_EVENT_BACKLOG = 1 << 20
# Seconds a starting worker waits for its event links to the others, and the
# longest pause between tries of a link to a sibling that is (re)starting.
LINK_TIMEOUT = 5.0
LINK_RETRY_MAX = 0.25


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
        self._links: list[asyncio.Task[None]] = []
        self._on_event: Callable[[SiblingEvent], None] = lambda event: None

    def path(self, index: int) -> str:
        return str(self.run_dir / f"metrics-{index}.sock")

    def events_path(self, index: int) -> str:
        return str(self.run_dir / f"events-{index}.sock")

    async def serve(
        self,
        exposition: Callable[[], bytes],
        on_event: Callable[[SiblingEvent], None] | None = None,
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
        while len(self._peers) < self.count - 1 and time.monotonic() < deadline:  # noqa: ASYNC110 (bounded by LINK_TIMEOUT; the link tasks fill _peers)
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
                    event = decode_event(line)
                except ValueError as e:  # refused, logged; the stream reads on
                    logger.warning(
                        "gateway worker %d: refused a sibling event (%s): %r",
                        self.index,
                        e,
                        line[:200],
                    )
                    continue
                try:
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

    def publish(self, event: SiblingEvent) -> None:
        """Send ``event`` to every connected sibling now (no await)."""
        line = encode_event(event)
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
    largest kept (other gauges); ``*_created`` series dropped. Read with the
    one ``/metrics`` parser (``contracts/metrics.py``); ValueError for a text
    that is not Prometheus exposition format."""
    families: dict[str, tuple[str, str, dict[tuple[str, tuple[tuple[str, str], ...]], float]]] = {}
    for text in texts:
        for fam in m.parse_metrics(text.decode("utf-8")).families:
            _, _, samples = families.setdefault(fam.name, (fam.kind, fam.documentation, {}))
            for name, found, value in fam.samples:
                if name.endswith("_created"):
                    continue
                key = (name, tuple(sorted(found.items())))
                if key not in samples:
                    samples[key] = value
                elif (fam.kind == "gauge" and fam.name not in SUMMED_GAUGES) or (
                    fam.name in ENGINE_EVENT_COUNTERS
                ):
                    samples[key] = max(samples[key], value)
                elif fam.kind != "info":
                    samples[key] += value
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
