"""Start and stop real pdfleet server processes in tests (every wait bounded)."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

import httpx

from pdfleet.engine.contracts import security
from pdfleet.engine.contracts.launch import python_module

from .device import engine_memory_args


def fleet_token(environ: dict[str, str] | None = None) -> str | None:
    """The engine-HTTP token of the fleet secret the tests' processes share."""
    secret = security.fleet_secret_from_env(environ)
    return security.fleet_token(secret) if secret is not None else None


def fleet_headers(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``Authorization`` for calling an engine directly, as the gateway does."""
    token = fleet_token(environ)
    return {"authorization": f"Bearer {token}"} if token else {}


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range: a port the
    kernel picks for ``bind(0)`` can be handed out again as the local port of some
    outgoing connection before the test's server binds it."""
    low, _ = _ephemeral_range()
    for _ in range(200):
        port = random.randrange(10000, max(10001, low))
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


class ServerProcess:
    """``pdfleet <command> ...`` as a subprocess with its log in a file."""

    def __init__(
        self,
        args: list[str],
        log_dir: Path,
        name: str = "server",
        env: dict[str, str] | None = None,
        port: int | None = None,
    ) -> None:
        if args[:1] == ["serve"]:
            # Several engines of one test share a GPU: give each its own share.
            args = [*args, *engine_memory_args(args)]
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}-{self.port}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 (closed in stop())
        # One torch thread per process: test servers share two cores, and OpenMP
        # threads spinning on shared cores slow every step several-fold.
        environ = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
        # What a caller of this process presents (empty when it runs without a secret).
        self.headers = fleet_headers(environ)
        self.proc = subprocess.Popen(
            [*python_module("pdfleet.engine.cli"), *args, "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=environ,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        self.signal(signal.SIGTERM)
        return self.wait_stopped(timeout)

    def wait_stopped(self, timeout: float = 30.0) -> int:
        """Wait for the process to exit (SIGKILL after ``timeout``); its exit code."""
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def stop_all(procs: Iterable[ServerProcess], timeout: float = 30.0) -> None:
    """Stop processes side by side: SIGTERM to each, then wait for each (as
    ``ServerProcess.stop``), so their shutdowns overlap."""
    procs = list(procs)
    for p in procs:
        p.signal(signal.SIGTERM)
    for p in procs:
        p.wait_stopped(timeout)


def scrape(url: str) -> dict[str, float]:
    """Metric samples from /metrics as {name{labels}: value} plus {name: value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    text = httpx.get(url + "/metrics", timeout=5, headers=fleet_headers()).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value if s.labels else s.value
    return out


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
