"""A small request next to an ``n=128`` request: its TTFT against its unloaded TTFT.

One ``pdfleet serve`` engine (the built-in tiny model at its default size,
CPU server defaults: 128 sequence slots). First a small request's time to
first token is measured alone; then an ``n=128`` request (long outputs,
``ignore_eos``) is started, and once its sequences hold every slot the same
small request is sent again, several times, while it runs. The ratio of the
medians is the figure: target within 3x.

The same is run with ``--max-request-share 1`` (one request may keep every
slot whatever waits: the behaviour before the bound) for comparison; with
``--gateway`` both go through a ``pdfleet gateway`` in front of the engine.
Rerun:

    .venv/bin/python -P benchmarks/n_fairness.py --json benchmarks/results/n_fairness_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from pdfleet.engine.contracts import security
from pdfleet.engine.contracts.launch import python_module

SMALL = {"model": "tiny", "prompt": "The weather today is", "max_tokens": 4, "stream": True}
BIG_N = 128
BIG_TOKENS = 400
SECRET = "n-fairness-benchmark-secret-0123456789"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    def __init__(self, argv: list[str], log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "wb")  # noqa: SIM115 (closed in stop())
        env = {**os.environ, "OMP_NUM_THREADS": "1", security.FLEET_SECRET_ENV: SECRET}
        self.proc = subprocess.Popen(
            [*python_module("pdfleet.engine.cli"), *argv, "--port", str(self.port)],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def wait_healthy(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited: see {self.log.name}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"not healthy: see {self.log.name}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()


HEADERS = {"authorization": f"Bearer {security.fleet_token(SECRET.encode())}"}


def ttft(url: str) -> float:
    """Seconds from sending the small request to its first streamed token."""
    start = time.perf_counter()
    with httpx.stream(
        "POST", url + "/v1/completions", json=SMALL, headers=HEADERS, timeout=600
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                return time.perf_counter() - start
    raise RuntimeError("the stream ended without a token")


def running(engine_url: str) -> float:
    text = httpx.get(engine_url + "/metrics", headers=HEADERS, timeout=10).text
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def measure(model: str, share: float, repeats: int, gateway: bool, logs: Path) -> dict:
    engine = Process(
        ["serve", model, "--served-model-name", "tiny", "--max-model-len", "1024",
         "--disable-log-stats", "--max-request-share", str(share)],
        logs / f"engine-share-{share}.log",
    )  # fmt: skip
    front: Process | None = None
    try:
        engine.wait_healthy()
        url = engine.url
        if gateway:
            front = Process(
                ["gateway", "--host", "127.0.0.1", "--decode", engine.url,
                 "--disaggregation-mode", "Disabled"],
                logs / f"gateway-share-{share}.log",
            )  # fmt: skip
            front.wait_healthy(120)
            url = front.url
        ttft(url)  # warm up
        alone = [ttft(url) for _ in range(repeats)]
        big_body = {
            "model": "tiny", "prompt": "Once upon a time", "n": BIG_N,
            "max_tokens": BIG_TOKENS, "ignore_eos": True, "temperature": 1.0,
        }  # fmt: skip
        big_done = threading.Event()
        big_seconds: list[float] = []

        def big() -> None:
            start = time.perf_counter()
            try:
                httpx.post(url + "/v1/completions", json=big_body, headers=HEADERS, timeout=1800)
            finally:
                big_seconds.append(time.perf_counter() - start)
                big_done.set()

        threading.Thread(target=big, daemon=True).start()
        deadline = time.monotonic() + 300
        while running(engine.url) < BIG_N and time.monotonic() < deadline:
            time.sleep(0.2)
        full = running(engine.url)
        loaded = []
        for _ in range(repeats):
            if big_done.is_set():
                break
            loaded.append(ttft(url))
        still_running = not big_done.is_set()
        big_done.wait(1800)
        return {
            "max_request_share": share,
            "slots_taken_before_small_requests": full,
            "ttft_alone_s": [round(x, 4) for x in alone],
            "ttft_next_to_n128_s": [round(x, 4) for x in loaded],
            "n128_still_running_after": still_running,
            "n128_seconds": round(big_seconds[0], 2) if big_seconds else None,
            "ratio_median": round(statistics.median(loaded) / statistics.median(alone), 2)
            if loaded
            else None,
        }
    finally:
        if front is not None:
            front.stop()
        engine.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model directory (default: built-in tiny)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gateway", action="store_true", help="through a pdfleet gateway")
    ap.add_argument("--no-baseline", action="store_true", help="skip --max-request-share 1")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args()
    from pdfleet.engine.tiny.builder import ensure_tiny_model

    model = args.model or ensure_tiny_model()
    logs = Path(tempfile.mkdtemp(prefix="n-fairness-"))
    runs = [measure(model, 0.5, args.repeats, args.gateway, logs)]
    if not args.no_baseline:
        runs.append(measure(model, 1.0, args.repeats, args.gateway, logs))
    result = {
        "benchmark": "n_fairness",
        "model": args.model or "built-in tiny (default size)",
        "path": "gateway -> engine" if args.gateway else "engine",
        "target_ratio": 3.0,
        "runs": runs,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
    }
    print(f"process logs: {logs}", file=sys.stderr)
    print(json.dumps(result, indent=2))
    for run in runs:
        print(
            f"max_request_share {run['max_request_share']}: small-request TTFT next to n=128 / "
            f"alone = {run['ratio_median']}x (target <= 3x)",
            file=sys.stderr,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
