"""Engine and gateway processes for the serving benchmarks (every wait bounded).

Each process is started in its own session with its log in a run directory,
and stopped (SIGTERM, then SIGKILL after a bound) when the ``Fleet`` closes.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx

from pdfleet.engine.contracts.launch import python_module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Fleet:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[tuple[subprocess.Popen, object]] = []

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> str:
        """``pdfleet ARGS --port P``; returns its URL (not yet waited for)."""
        port = free_port()
        log = open(self.log_dir / f"{name}.log", "wb")  # noqa: SIM115 (closed in close())
        proc = subprocess.Popen(
            [*python_module("pdfleet.engine.cli"), *args, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        self.procs.append((proc, log))
        return f"http://127.0.0.1:{port}"

    def wait_healthy(self, urls: list[str], timeout: float = 300.0) -> None:
        deadline = time.monotonic() + timeout
        pending = set(urls)
        while pending and time.monotonic() < deadline:
            for proc, _ in self.procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"a process exited early; see the logs in {self.log_dir}")
            for url in list(pending):
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        pending.discard(url)
                except httpx.HTTPError:
                    pass
            time.sleep(0.2)
        if pending:
            raise TimeoutError(f"not healthy after {timeout}s: {sorted(pending)}")

    def close(self) -> None:
        for proc, _ in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc, log in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            log.close()  # type: ignore[attr-defined]
        self.procs.clear()

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def engine_env(threads: int) -> dict[str, str]:
    """CPU engines: torch's OpenMP threads spin at barriers; on a machine whose
    cores are shared (several engines, the gateway, the load generator) more
    than one thread per engine makes steps many times slower, not faster."""
    return {"OMP_NUM_THREADS": str(threads)} if threads > 0 else {}


def metric(url: str, name: str, **labels: str) -> float:
    """The sum of the ``name`` samples on ``url``/metrics whose labels include
    ``labels`` (names from engine/contracts/metrics.py, read by its parser)."""
    from pdfleet.engine.contracts.metrics import parse_metrics

    scrape = parse_metrics(httpx.get(url + "/metrics", timeout=5).text, only=[name])
    return sum(
        value
        for have, value in scrape.samples.get(name, ())
        if all(have.get(k) == v for k, v in labels.items())
    )


def tiny_model() -> str:
    """The built-in tiny model (built once into the cache; 4096 positions)."""
    from pdfleet.engine.tiny.builder import ensure_tiny_model

    return ensure_tiny_model()
