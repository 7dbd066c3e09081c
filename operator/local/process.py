"""One child process of the local fleet: start, health, stop (every wait bounded)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx


@dataclass(eq=False)
class Child:
    name: str  # "prefill-0", "decode-1", "gateway"
    role: str  # prefill | decode | gateway
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready: bool = False
    draining: bool = False
    restarts: int = 0
    stopping: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child owns it; closed on exit)
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        finally:
            log.close()
        self.started_at = time.monotonic()
        self.ready = False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def healthy(self, timeout: float = 1.0) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL of the whole process group after ``grace`` seconds."""
        self.stopping = True
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return self.proc.returncode

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""
