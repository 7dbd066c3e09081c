"""A small OTLP/HTTP traces receiver for tests (protobuf, as the SDK's exporter sends)."""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class Span:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    service: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)
    error: bool = False
    links: list[tuple[str, str]] = field(default_factory=list)
    """(trace id, span id) of each linked span."""

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OTLPReceiver:
    """Collects every span posted to ``http://127.0.0.1:PORT/v1/traces``."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._store(ExportTraceServiceRequest.FromString(body))
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def _store(self, request: ExportTraceServiceRequest) -> None:
        spans = []
        for rs in request.resource_spans:
            attrs = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        Span(
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            name=s.name,
                            service=service,
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            error=s.status.code == 2,
                            links=[(x.trace_id.hex(), x.span_id.hex()) for x in s.links],
                        )
                    )
        with self.lock:
            self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[Span]:
        with self.lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, predicate, timeout: float = 30.0) -> list[Span]:
        """The trace's spans once ``predicate(spans)`` holds (bounded wait)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.trace(trace_id)
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted(f"{s.service}:{s.name}" for s in spans)
                raise TimeoutError(f"trace {trace_id} incomplete after {timeout}s: {names}")
            time.sleep(0.1)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
