"""One child process of the local fleet: start, health, stop (every wait bounded).

Children die with their supervisor: each one asks the kernel (Linux
``prctl(PR_SET_PDEATHSIG)``) for SIGKILL when its parent goes, whatever
ends the parent, SIGKILL included. The kernel ties that signal to the
*thread* that forked the child, so every child is forked by one long-lived
spawner thread, never by a short-lived worker (a drain, an autoscaler step).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
GiB = 1 << 30
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
# One thread forks every child and lives as long as the process (see above).
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="spawner")


def die_with_parent(parent_pid: int) -> None:
    """In a forked child, before exec: SIGKILL when the parent dies; exit at
    once if it died already (between fork and here)."""
    if _LIBC is None:
        return
    if _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(126)
    if os.getppid() != parent_pid:
        os._exit(1)


def spawn(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """``subprocess.Popen(argv, **kwargs)`` whose process dies with this one."""
    parent = os.getpid()

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, preexec_fn=lambda: die_with_parent(parent), **kwargs)

    return _SPAWNER.submit(start).result(timeout=60)


def resident_bytes(pid: int, tree: bool = True) -> int:
    """Resident memory (VmRSS) of ``pid`` and (``tree``) of every process below it
    (an engine's tensor-parallel ranks), from /proc; 0 for a process that is gone."""
    parents: dict[int, int] = {}
    if not tree:
        return _vm_rss(pid)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = f"/proc/{entry}/stat"
            with contextlib.suppress(OSError, IndexError, ValueError), open(stat) as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
    found, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                found.add(child)
                frontier.append(child)
    return sum(_vm_rss(p) for p in found)


def _vm_rss(pid: int) -> int:
    with contextlib.suppress(OSError, ValueError, IndexError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


@dataclass(eq=False)
class Child:
    name: str  # "prefill-0", "decode-1", "gateway"
    role: str  # prefill | decode | gateway
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    headers: dict[str, str] = field(default_factory=dict)
    """Sent with every request to the child (the fleet token: engines want it)."""
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_at: float | None = None
    """When it first answered ``/health`` since its latest start (monotonic);
    None while it has not (:attr:`ready`)."""
    draining: bool = False
    restarts: int = 0
    stopping: bool = False

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child owns it; closed on exit)
        try:
            self.proc = spawn(
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
        self.ready_at = None

    @property
    def ready(self) -> bool:
        """It answered ``/health`` since its latest start: it serves."""
        return self.ready_at is not None

    def mark_ready(self) -> None:
        self.ready_at = time.monotonic()

    @property
    def startup_seconds(self) -> float | None:
        """Launch to its first healthy ``/health``; None until it was ready."""
        return None if self.ready_at is None else self.ready_at - self.started_at

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def healthy(self, timeout: float = 1.0) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=timeout).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics_text(self, timeout: float = 2.0) -> str | None:
        """The child's ``/metrics`` (authenticated), or None if it does not answer."""
        try:
            response = httpx.get(self.url + "/metrics", headers=self.headers, timeout=timeout)
            response.raise_for_status()
        except httpx.HTTPError:
            return None
        return response.text

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
