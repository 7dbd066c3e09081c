"""`make run` on a fresh clone: time to ready and the fleet's resident memory.

Clones the repository (committed state) into a temporary directory and runs
`make run` there with an empty pdfleet cache: it creates the virtual
environment, installs, prepares SmolLM2-135M-Instruct and starts the default
fleet (gateway, one prefill and one decode engine). It reports

* the time from `make run` to `pdfleet up`'s "Ctrl-C stops" line, split at
  the install's end;
* the resident memory (VmRSS) of every process of the fleet, summed (make,
  `pdfleet up`, its engines with any rank processes, the gateway): when ready,
  and its largest value, sampled every second, while the fleet serves chat
  requests (``--requests`` at ``--concurrency``, every fourth one a ~1,200-token
  prompt), and after them;
* the disk the virtual environment takes;
* the load average before and after (the machine may be shared).

Then it stops the fleet with SIGINT (as Ctrl-C) and removes the clone.

    .venv/bin/python benchmarks/make_run.py [--out benchmarks/results/make_run_cpu.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
LONG = "Tell me about the history of Paris. " * 150


def tree(pid: int) -> list[int]:
    """``pid`` and every process below it, from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [pid], [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                found.append(child)
                frontier.append(child)
    return found


def rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def fleet_rss(root: int) -> dict[str, int]:
    out = {}
    for pid in tree(root):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        name = " ".join(a.decode(errors="replace") for a in argv[:6] if a)[-60:]
        out[f"{pid} {name}"] = rss(pid)
    return out


def chat(url: str, i: int) -> int:
    prompt = LONG + str(i) if i % 4 == 0 else f"Question {i}: what is the capital of France?"
    body = {
        "model": "smollm2-135m-instruct",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": 48,
    }
    try:
        return httpx.post(url + "/v1/chat/completions", json=body, timeout=600).status_code
    except httpx.HTTPError:
        return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", default=str(ROOT), help="what to clone (default: this one)")
    parser.add_argument("--out", default="benchmarks/results/make_run_cpu.json")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="pdfleet-make-run-"))
    clone = work / "c"
    subprocess.run(["git", "clone", "-q", args.repo, str(clone)], check=True)
    log_path = work / "make.log"
    env = {**os.environ, "PDFLEET_CACHE_DIR": str(work / "cache")}
    for name in ("PDFLEET_FLEET_SECRET", "PDFLEET_FLEET_SECRET_FILE", "VIRTUAL_ENV"):
        env.pop(name, None)
    result: dict = {"load_before": os.getloadavg()}
    start = time.monotonic()
    with open(log_path, "wb") as log:
        make = subprocess.Popen(
            ["make", "run"],
            cwd=clone,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        installed = None
        while True:
            text = log_path.read_text(errors="replace")
            if installed is None and "==> installed" in text:
                installed = time.monotonic() - start
            if "Ctrl-C stops" in text:
                break
            if make.poll() is not None:
                raise RuntimeError(f"make run exited:\n{text[-3000:]}")
            if time.monotonic() - start > args.timeout:
                raise TimeoutError(f"not ready within {args.timeout:.0f}s")
            time.sleep(0.5)
        result["ready_s"] = round(time.monotonic() - start, 1)
        result["install_s"] = round(installed or 0.0, 1)
        result["load_at_ready"] = os.getloadavg()
        url = re.search(r"ready: (http://[\d.:]+)", text).group(1)  # type: ignore[union-attr]
        result["printed"] = [
            line for line in text.splitlines() if line.startswith(("memory:", "KV cache"))
        ]
        at_ready = fleet_rss(make.pid)
        result["rss_at_ready"] = at_ready
        result["rss_at_ready_total"] = sum(at_ready.values())

        peak = [sum(at_ready.values())]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(1.0):
                peak.append(sum(fleet_rss(make.pid).values()))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            statuses = list(pool.map(lambda i: chat(url, i), range(args.requests)))
        done.set()
        sampler.join(5)
        after = fleet_rss(make.pid)
        result["statuses"] = {str(s): statuses.count(s) for s in sorted(set(statuses))}
        result["rss_after_load"] = after
        result["rss_max_total"] = max([*peak, sum(after.values())])
        result["venv_bytes"] = int(
            subprocess.run(
                ["du", "-sb", str(clone / ".venv")], capture_output=True, text=True
            ).stdout.split()[0]
        )
        result["load_after"] = os.getloadavg()
    finally:
        if make.poll() is None:
            os.killpg(make.pid, signal.SIGINT)
            try:
                make.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(make.pid, signal.SIGKILL)
                make.wait(10)
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    gb = 1e9
    print(
        f"ready in {result['ready_s']:.0f} s (install {result['install_s']:.0f} s); fleet RSS "
        f"{result['rss_at_ready_total'] / gb:.2f} GB at ready, {result['rss_max_total'] / gb:.2f} "
        f"GB at most under load; venv {result['venv_bytes'] / gb:.1f} GB"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
