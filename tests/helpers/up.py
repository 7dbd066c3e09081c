"""`pdfleet up` as a subprocess in tests (every wait bounded)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from .server import free_port, wait_until


class Up:
    """A `pdfleet up` process: its endpoint, its engines, its output."""

    def __init__(self, spec: dict, tmp: Path, name: str = "up") -> None:
        self.file = tmp / f"{name}.yaml"
        self.file.write_text(yaml.safe_dump(spec))
        self.port = free_port()
        self.run_dir = tmp / f"runs-{name}"
        self.out_path = tmp / f"{name}.out"
        self.out = open(self.out_path, "wb")  # noqa: SIM115 (closed in stop())
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdfleet.engine.cli",
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
        "engine": {"maxModelLen": 512, "maxNumSeqs": 64, "disableLogStats": True},
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
