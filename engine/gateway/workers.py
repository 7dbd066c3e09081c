"""``pdfleet gateway``'s processes: one gateway, or ``--workers N`` of them on one port.

:func:`serve` runs the gateway in this process, or, with ``--workers N``,
supervises N worker processes (``python -m pdfleet.engine.gateway.workers``),
each a whole gateway serving the same port; what they share (the port, their
metrics, routing events) is ``siblings.py``.

The supervisor (the ``pdfleet gateway`` process itself) starts the workers,
restarts one that dies, gives up when they keep dying at startup (a port in
use), and on SIGTERM/SIGINT stops them gracefully. See docs/gateway.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from ..config.gateway import GatewayConfig
from ..contracts.gateway_worker_job import WorkerJob
from ..contracts.launch import python_module
from .app import run_gateway
from .siblings import Siblings, reuseport_socket

logger = logging.getLogger("pdfleet.gateway")

# A worker that exits this soon after its start counts as failing to start.
QUICK_EXIT_SECONDS = 5.0
# Consecutive quick exits of one worker after which the gateway gives up.
MAX_QUICK_EXITS = 3
# Seconds the workers get to stop gracefully before they are killed.
STOP_TIMEOUT = 15.0


def serve(config: GatewayConfig) -> int:
    """Serve until SIGINT/SIGTERM; exit 0 after a graceful stop: the gateway in
    this process, or (``--workers N``) a supervisor of N worker processes."""
    if config.workers > 1:
        return serve_workers(config)
    return run_gateway(config)


# -- the worker ------------------------------------------------------------------------


def worker_main() -> int:
    """A worker's entry (``python -m pdfleet.engine.gateway.workers``): its
    config, index, count and run directory come as a ``WorkerJob`` on stdin
    (``contracts/gateway_worker_job.py``: JSON, never pickle)."""
    job = WorkerJob.decode(sys.stdin.buffer.read())
    config = GatewayConfig(**job.config)
    _die_with_parent()
    return run_gateway(config, Siblings(job.run_dir, job.index, job.count))


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
        self.proc: subprocess.Popen[bytes] | None = None
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
        if w.proc.stdin is None:
            raise RuntimeError("broken invariant: w.proc.stdin is not None")
        # API keys included: a private pipe.
        job = WorkerJob(dataclasses.asdict(config), w.index, count, run_dir)
        w.proc.stdin.write(job.encode())
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
                if w.proc is None:
                    raise RuntimeError("broken invariant: w.proc is not None")
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


def _stop_all(procs: list[subprocess.Popen[bytes]]) -> list[int]:
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
