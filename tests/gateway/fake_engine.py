"""A recording HTTP engine for the gateway's security tests (a real server,
in a thread of the test process), and a test CA for TLS.

It answers ``/health``, ``/metrics`` and the two OpenAI routes like a pdfleet
engine would (a prefill leg gets ``kv_transfer_params`` back), records every
request (path, headers, body), and can be told to answer differently.
"""

from __future__ import annotations

import json
import ssl
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

METRICS = (
    'pdfleet_engine_cache_config_info{block_size="16",compat_hash="fake"} 1.0\n'
    "pdfleet_engine_num_requests_waiting 0.0\n"
    "pdfleet_engine_num_requests_running 0.0\n"
)
PARAMS = {
    "do_remote_prefill": True,
    "remote_engine_id": "fake-prefill",
    "remote_host": "127.0.0.1",
    "remote_port": 1,
    "remote_block_ids": [1, 2],
    "remote_request_id": "r",
    "pdfleet_sig": "s",
}


def kv_pull_fails(body: dict[str, Any]) -> tuple[int, bytes]:
    """A decode engine's answer whose KV pulls all fail: a 500 for every leg
    that carries ``kv_transfer_params``, a small completion otherwise."""
    if body.get("kv_transfer_params"):
        return 500, b'{"error": {"message": "KV pull failed"}}'
    out = {"id": "c", "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]}
    return 200, json.dumps(out).encode()


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class FakeEngine:
    tls: ssl.SSLContext | None = None
    seen: list[Seen] = field(default_factory=list)
    health_status: int = 200
    tokens_per_scrape: int = 0
    """Generated tokens added per /metrics read: an engine that computes."""
    tokens: int = 0
    waiting: int = 0
    """The queue length its /metrics reports (a gateway learns its capacity from it)."""
    answer: Callable[[dict[str, Any]], tuple[int, Any]] | None = None
    """(status, body) for a completion request, the body as bytes or an
    iterator of SSE events (streamed); default: a small completion."""
    compat_hash: str = "fake"
    resume_identity: str | None = None
    """Published with the compat hash when set (a pdfleet engine's)."""

    def __post_init__(self) -> None:
        engine = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _record(self, body: Any) -> None:
                headers = {k.lower(): v for k, v in self.headers.items()}
                engine.seen.append(Seen(self.command, self.path, headers, body))

            def do_GET(self) -> None:
                self._record(None)
                if self.path == "/health":
                    self._send(engine.health_status, b"{}")
                elif self.path == "/metrics":
                    engine.tokens += engine.tokens_per_scrape
                    info = f'compat_hash="{engine.compat_hash}"'
                    if engine.resume_identity is not None:
                        info += f',resume_identity="{engine.resume_identity}"'
                    text = (
                        METRICS.replace("waiting 0.0", f"waiting {float(engine.waiting)}").replace(
                            'compat_hash="fake"', info
                        )
                        + f"pdfleet_engine_generation_tokens_total {engine.tokens}\n"
                    )
                    self._send(200, text.encode(), "text/plain")
                elif self.path == "/v1/models":
                    self._send(200, json.dumps({"data": [{"id": "tiny"}]}).encode())
                else:
                    self._send(404, b"{}")

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("content-length", 0)))
                body = json.loads(raw)
                self._record(body)
                if engine.answer is not None:
                    status, out = engine.answer(body)
                    if isinstance(out, bytes):
                        self._send(status, out)
                        return
                    # An iterator of SSE events: sent chunked, each as it comes.
                    self.send_response(status)
                    self.send_header("content-type", "text/event-stream")
                    self.send_header("transfer-encoding", "chunked")
                    self.end_headers()
                    for event in out:
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                        self.wfile.flush()
                    self.wfile.write(b"0\r\n\r\n")
                    return
                params = body.get("kv_transfer_params") or {}
                out: dict[str, Any] = {
                    "id": "cmpl-x",
                    "object": "text_completion",
                    "model": "tiny",
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                }
                if params.get("do_remote_decode"):
                    out["kv_transfer_params"] = PARAMS
                self._send(200, json.dumps(out).encode())

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if self.tls is not None:
            self.server.socket = self.tls.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{'localhost' if self.tls else '127.0.0.1'}:{self.port}"

    def posts(self) -> list[Seen]:
        return [s for s in self.seen if s.method == "POST"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def make_ca(directory: Path) -> tuple[Path, ssl.SSLContext]:
    """A throwaway CA (its PEM path) and a server context whose certificate it
    signed for localhost and 127.0.0.1 (made with the openssl CLI)."""

    def openssl(*args: str) -> None:
        subprocess.run(
            ["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=30
        )

    openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=pdfleet test CA",
    )  # fmt: skip
    (directory / "san.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
    )
    openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost",
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.pem", "-days", "1", "-extfile", "san.ext",
    )  # fmt: skip
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(directory / "server.pem", directory / "server.key")
    return directory / "ca.pem", server


def make_client_cert(directory: Path) -> tuple[Path, Path]:
    """A client certificate signed by :func:`make_ca`'s CA (call it first): (cert, key)."""

    def openssl(*args: str) -> None:
        subprocess.run(
            ["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=30
        )

    openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "client.key", "-out", "client.csr", "-subj", "/CN=pdfleet gateway",
    )  # fmt: skip
    (directory / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    openssl(
        "x509", "-req", "-in", "client.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "client.pem", "-days", "1", "-extfile", "client.ext",
    )  # fmt: skip
    return directory / "client.pem", directory / "client.key"
