"""A real PostgreSQL server for tests: initdb in a temporary folder, listening on
a Unix socket only, stopped (bounded) at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .server import free_port

BIN_DIRS = [Path(p) for p in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)]


def _binary(name: str) -> str | None:
    for folder in BIN_DIRS:
        if (folder / name).exists():
            return str(folder / name)
    return shutil.which(name)


def _as_server_user(argv: list[str]) -> list[str]:
    # PostgreSQL refuses to run as root: run it as the postgres account then.
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *argv]
    return argv


@contextlib.contextmanager
def postgres_server(timeout: float = 60.0) -> Iterator[str]:
    """The URL of a fresh PostgreSQL server (user ``pdfleet``, trust auth on its
    socket), in a folder of its own that is removed at the end."""
    initdb, postgres = _binary("initdb"), _binary("postgres")
    if initdb is None or postgres is None:
        pytest.skip("PostgreSQL's initdb and postgres are not installed here")
    # Not under pytest's folders: as root those are closed to the postgres account.
    tmp = Path(tempfile.mkdtemp(prefix="pdfleet-pg-"))
    data, sock = tmp / "data", tmp / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(tmp, "postgres")
        shutil.chown(sock, "postgres")
    subprocess.run(
        _as_server_user(
            [initdb, "-D", str(data), "-A", "trust", "-U", "pdfleet", "--no-sync", "-E", "UTF8"]
        ),
        check=True,
        capture_output=True,
        timeout=timeout,
    )
    port = free_port()
    log = open(tmp / "postgres.log", "wb")  # noqa: SIM115 (closed below)
    # Unix socket only (no TCP listener), fsync off (-F): a test's throwaway server.
    settings = ["-c", "listen_addresses=", "-c", "max_connections=50"]
    proc = subprocess.Popen(
        _as_server_user(
            [postgres, "-D", str(data), "-k", str(sock), "-p", str(port), "-F", *settings]
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"postgresql://pdfleet@/postgres?host={sock}&port={port}"
    try:
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                psycopg.connect(url, connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(
                        "postgres did not start: " + (tmp / "postgres.log").read_text()[-2000:]
                    ) from None
                time.sleep(0.1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)  # fast shutdown
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
