"""`pdfleet up` as a subprocess in tests (every wait bounded)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import yaml

from pdfleet.engine.contracts.launch import python_module

from .device import engine_memory_spec
from .server import free_port, wait_until


class Up:
    """A `pdfleet up` process: its endpoint, its engines, its output."""

    def __init__(
        self, spec: dict, tmp: Path, name: str = "up", env: dict[str, str] | None = None
    ) -> None:
        self.file = tmp / f"{name}.yaml"
        self.file.write_text(yaml.safe_dump(spec))
        self.port = free_port()
        self.run_dir = tmp / f"runs-{name}"
        self.out_path = tmp / f"{name}.out"
        self.out = open(self.out_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [
                *python_module("pdfleet.engine.cli"),
                "up",
                str(self.file),
                "--port",
                str(self.port),
                "--run-dir",
                str(self.run_dir),
                "--timeout",
                "240",
            ],
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **(env or {})},
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 300) -> Up:
        if not wait_until(
            lambda: "ready: " in self.output() or self.proc.poll() is not None, timeout, 0.25
        ):
            raise TimeoutError(f"pdfleet up not ready:\n{self.output()[-3000:]}")
        if self.proc.poll() is not None:
            raise RuntimeError(f"pdfleet up exited:\n{self.output()[-3000:]}")
        return self

    def engines(self) -> list[dict]:
        (engines_file,) = self.run_dir.glob("*/engines.json")
        return json.loads(engines_file.read_text())["engines"]

    def engine_url(self, role: str) -> str:
        return next(e["url"] for e in self.engines() if e["role"] == role)

    def child_pids(self) -> list[int]:
        """The processes `pdfleet up` started (its direct children)."""
        return children_of(self.proc.pid)

    def stop(self, timeout: float = 90) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.out.close()
        return self.proc.returncode


def fleet_spec(model: str, **extra) -> dict:
    spec = {
        "model": {"name": "tiny", "uri": f"file://{model}"},
        "engine": {
            "maxModelLen": 512,
            "maxNumSeqs": 64,
            "disableLogStats": True,
            **engine_memory_spec(),
        },
        "kvTransfer": {"connector": "NixlConnector", "leaseSeconds": 20},
        "prefill": {"replicas": 1},
        "decode": {"replicas": 1},
        "disaggregation": {"mode": "Conditional", "minPromptTokens": 32},
    }
    spec.update(extra)
    return {
        "apiVersion": "pdfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "tiny"},
        "spec": spec,
    }


def children_of(pid: int) -> list[int]:
    """Live direct children of ``pid``, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and process_state(int(entry)) not in (None, "Z"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid:
                    found.append(int(entry))
    return found


def process_state(pid: int) -> str | None:
    """The state letter of a process (``Z``: a zombie, dead), None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def is_dead(pid: int) -> bool:
    return process_state(pid) in (None, "Z", "X")


def process_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(
        item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item
    )


def process_argv(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on (IPv4 and IPv6)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    found = set()
    for table, size in (("tcp", 4), ("tcp6", 16)):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                host, port = fields[1].split(":")
                found.add((_address(bytes.fromhex(host), size), int(port, 16)))
    return found


def _address(raw: bytes, size: int) -> str:
    import ipaddress

    # /proc/net/tcp prints each 32-bit word in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4))
    return str(ipaddress.ip_address(words))
