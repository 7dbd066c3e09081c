"""Day one: the default fleet under the docs' own loads, on a loaded machine.

Starts ``pdfleet up`` with no file (the built-in SmolLM2-135M-Instruct, one
prefill and one decode engine, Conditional disaggregation) while ``--busy``
processes spin on the CPU (one keeps one of this machine's two cores busy),
then runs, in order:

1. ``example``: the Python example of docs/bench.md (50 requests at
   concurrency 8, 256 → 32 tokens), its code taken from the docs;
2. ``bench``: the docs' bench command, ``pdfleet bench --url URL/v1
   --endpoint chat --request-rate R --duration 60 --num-requests None``, as a
   subprocess, for each rate of ``--rates`` (the docs' 4 first, then a
   sweep: the highest rate with 0 failed is the rate the fleet sustains);
3. ``overload``: Poisson arrivals of the same chat requests at
   ``--overload-rate``; every answer's status, its ``Retry-After`` and how
   long the refusal took;
4. ``freeze``: steady streams, then every engine SIGSTOPped at once for each
   of ``--freeze`` seconds (a fleet slow as a whole: nothing moves) and
   SIGCONTed; the gateway's ejection counter read every half second;
5. ``slow``: the same with every engine slowed to ``--slow-duty`` of the CPU
   (SIGSTOP/SIGCONT in a 1 s cycle) for ``--slow`` seconds.

After each phase: the gateway's ejections and stall ejections (its
``/metrics``), its answers by status, and the load average. Nothing is
timed by an assert: the numbers are printed and written to ``--json``.

    .venv/bin/python benchmarks/day_one.py --json benchmarks/results/day_one_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from pdfleet.engine.contracts.launch import python_module
from pdfleet.engine.contracts.metrics import parse_metrics
from pdfleet.engine.contracts.security import fleet_token, generate_secret

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"
WORDS = [
    *[
        "time",
        "year",
        "people",
        "way",
        "day",
        "man",
        "thing",
        "woman",
        "life",
        "child",
        "world",
        "school",
        "state",
        "family",
    ],
    *[
        "student",
        "group",
        "country",
        "problem",
        "hand",
        "part",
        "place",
        "case",
        "week",
        "company",
        "system",
        "program",
    ],
    *[
        "question",
        "work",
        "government",
        "number",
        "night",
        "point",
        "home",
        "water",
        "room",
        "mother",
        "area",
        "money",
    ],
]


def docs_example(url: str) -> str:
    """The Python block of docs/bench.md that calls ``run_benchmark``, pointed at ``url``."""
    text = (ROOT / "docs" / "bench.md").read_text()
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        if "run_benchmark(" in block:
            return block.replace("http://127.0.0.1:8000", url)
    raise RuntimeError("docs/bench.md has no Python block calling run_benchmark")


def children(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found: list[int] = []
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                found.append(child)
                frontier.append(child)
    return found


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


class DayOne:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.secret = generate_secret()
        self.headers = {"authorization": f"Bearer {fleet_token(self.secret.encode())}"}
        self.busy: list[subprocess.Popen] = []
        self.up: subprocess.Popen | None = None
        self.result: dict[str, Any] = {"phases": {}}

    # -- the fleet and the neighbour -------------------------------------------------

    def start(self) -> None:
        for _ in range(self.args.busy):
            self.busy.append(
                subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)
            )
        env = {**os.environ, "PDFLEET_FLEET_SECRET": self.secret}
        for name in ("PDFLEET_API_KEY", "PDFLEET_API_KEY_FILE", "OMP_NUM_THREADS"):
            env.pop(name, None)
        self.log_path = self.tmp / "up.log"
        log = open(self.log_path, "wb")  # noqa: SIM115 (the child holds it)
        up_args = ["--run-dir", str(self.tmp / "runs"), *self.args.up_args]
        started = time.monotonic()
        self.up = subprocess.Popen(
            [*python_module("pdfleet.engine.cli"), "up", *up_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        deadline = started + 900
        while True:
            text = self.log_path.read_text(errors="replace")
            if "Ctrl-C stops" in text:
                break
            if self.up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdfleet up did not become ready:\n{text[-3000:]}")
            time.sleep(0.5)
        self.result["ready_s"] = round(time.monotonic() - started, 1)
        found = re.search(r"ready: (http://[\d.:]+)/v1", text)
        assert found is not None
        self.url = found.group(1)
        self.engine_pids = [
            p for p in children(self.up.pid) if " serve " in cmdline(p) and "pdfleet" in cmdline(p)
        ]
        print(
            f"fleet ready in {self.result['ready_s']} s at {self.url}; engines {self.engine_pids}"
        )

    def stop(self) -> None:
        for pid in getattr(self, "engine_pids", []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        if self.up is not None and self.up.poll() is None:
            os.killpg(self.up.pid, signal.SIGINT)
            try:
                self.up.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.up.pid, signal.SIGKILL)
                self.up.wait(10)
        for proc in self.busy:
            proc.kill()
            proc.wait(10)

    # -- what the gateway says ---------------------------------------------------------

    def gateway_counts(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=10).text
        scrape = parse_metrics(text)
        out = {
            "ejections": scrape.total("pdfleet_gateway_engine_ejections_total") or 0.0,
            "stalls": scrape.total("pdfleet_gateway_engine_stalls_total") or 0.0,
        }
        for line in text.splitlines():
            m = re.match(r'pdfleet_gateway_requests_total\{.*status="(\d+)".*\} (\S+)', line)
            if m:
                key = f"status_{m.group(1)}"
                out[key] = out.get(key, 0.0) + float(m.group(2))
        return out

    def wait_routable(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                routable = httpx.get(self.url + "/engines", headers=self.headers, timeout=10)
                if all(v >= 1 for v in routable.json()["routable"].values()):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("the engines did not become routable again")

    def phase(self, name: str, run) -> dict[str, Any]:
        self.wait_routable()
        before = self.gateway_counts()
        load_before = os.getloadavg()
        started = time.monotonic()
        out = run()
        out["seconds"] = round(time.monotonic() - started, 1)
        after = self.gateway_counts()
        out["gateway"] = {
            k: after.get(k, 0.0) - before.get(k, 0.0)
            for k in sorted(set(after) | set(before))
            if after.get(k, 0.0) != before.get(k, 0.0)
        }
        out["load_average"] = [round(x, 1) for x in (*load_before, *os.getloadavg())]
        self.result["phases"][name] = out
        print(f"{name}: {json.dumps(out)}", flush=True)
        return out

    # -- the phases ----------------------------------------------------------------------

    def example(self) -> dict[str, Any]:
        scope: dict[str, Any] = {}
        exec(compile(docs_example(self.url), "docs/bench.md", "exec"), scope)  # noqa: S102 (runs the docs' own example, as a reader would)
        r = scope["result"]
        return {
            "completed": r.completed,
            "failed": r.failed,
            "errors": r.errors[:3],
            "request_throughput": round(r.request_throughput, 3),
            "e2e_p50_ms": r.e2e_ms.get("p50"),
        }

    def bench(self, rate: float) -> dict[str, Any]:
        out_json = self.tmp / f"bench-{rate}.json"
        command = [
            *python_module("pdfleet.engine.cli"),
            *("bench", "--url", self.url + "/v1", "--endpoint", "chat"),
            *("--request-rate", str(rate), "--duration", str(self.args.bench_duration)),
            *("--num-requests", "None", "--json", str(out_json)),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
        data = json.loads(out_json.read_text()) if out_json.exists() else {}
        summary = data.get("summary", data)
        return {
            "command": "pdfleet bench --url URL/v1 --endpoint chat --request-rate "
            f"{rate} --duration {self.args.bench_duration} --num-requests None",
            "rc": done.returncode,
            "completed": summary.get("completed"),
            "failed": summary.get("failed"),
            "errors": (summary.get("errors") or [])[:3],
            "request_throughput": summary.get("request_throughput"),
            "e2e_ms": summary.get("e2e_ms"),
            "ttft_ms": summary.get("ttft_ms"),
        }

    def chat_body(self, rng: random.Random) -> dict[str, Any]:
        prompt = " ".join(rng.choice(WORDS) for _ in range(128))
        return {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 64,
            "ignore_eos": True,
            "stream": True,
        }

    async def _one(self, client: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        out: dict[str, Any] = {"status": 0}
        try:
            async with client.stream("POST", self.url + "/v1/chat/completions", json=body) as r:
                out["status"] = r.status_code
                out["head_s"] = time.monotonic() - started
                out["retry_after"] = r.headers.get("retry-after")
                if r.status_code != 200:
                    await r.aread()
                    return out
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and '"error"' in line:
                        out["status"] = "stream_error"
                        out["error"] = line[:300]
                    if line == "data: [DONE]":
                        out.setdefault("done", True)
        except httpx.HTTPError as e:
            out["status"] = type(e).__name__
        out["total_s"] = time.monotonic() - started
        return out

    def overload(self, rate: float, duration: float) -> dict[str, Any]:
        async def main() -> list[dict[str, Any]]:
            rng = random.Random(7)
            async with httpx.AsyncClient(timeout=httpx.Timeout(900), limits=httpx.Limits()) as c:
                tasks = []
                t0 = time.monotonic()
                next_at = t0
                while True:
                    next_at += rng.expovariate(rate)
                    if next_at - t0 >= duration:
                        break
                    await asyncio.sleep(max(0.0, next_at - time.monotonic()))
                    tasks.append(asyncio.create_task(self._one(c, self.chat_body(rng))))
                return await asyncio.gather(*tasks)

        answers = asyncio.run(main())
        statuses: dict[str, int] = {}
        for a in answers:
            statuses[str(a["status"])] = statuses.get(str(a["status"]), 0) + 1
        refused = [a for a in answers if a["status"] in (429, 503)]
        refusal_s = sorted(a["head_s"] for a in refused)
        return {
            "rate": rate,
            "sent": len(answers),
            "statuses": statuses,
            "refused_with_retry_after": sum(1 for a in refused if a.get("retry_after")),
            "retry_after_values": sorted({a["retry_after"] for a in refused if a["retry_after"]}),
            "refusal_s_p50_max": [
                round(refusal_s[len(refusal_s) // 2], 2) if refusal_s else None,
                round(refusal_s[-1], 2) if refusal_s else None,
            ],
            "ok_total_s_max": round(
                max((a["total_s"] for a in answers if a["status"] == 200), default=0.0), 1
            ),
        }

    def stopped_fleet(self, seconds: float, duty: float | None) -> dict[str, Any]:
        """Streams at --streams concurrency; every engine stopped for ``seconds``
        (``duty``: instead run that share of each 1 s cycle)."""
        results: list[dict[str, Any]] = []
        stop_load = threading.Event()

        async def load() -> None:
            rng = random.Random(11)
            async with httpx.AsyncClient(timeout=httpx.Timeout(900)) as client:

                async def loop() -> None:
                    while not stop_load.is_set():
                        results.append(await self._one(client, self.chat_body(rng)))

                await asyncio.gather(*(loop() for _ in range(self.args.streams)))

        loader = threading.Thread(target=lambda: asyncio.run(load()), daemon=True)
        loader.start()
        time.sleep(self.args.settle)
        base = self.gateway_counts()["ejections"]
        first_ejection = None
        started = time.monotonic()
        for pid in self.engine_pids:
            os.kill(pid, signal.SIGSTOP)
        running = False
        try:
            while time.monotonic() - started < seconds:
                if duty is None:
                    end = time.monotonic() + 0.5
                else:  # stopped for (1 - duty) of each second, running for duty
                    end = time.monotonic() + (duty if running else 1 - duty)
                while time.monotonic() < end:
                    if first_ejection is None:
                        try:
                            if self.gateway_counts()["ejections"] > base:
                                first_ejection = time.monotonic() - started
                        except httpx.HTTPError:
                            pass
                    time.sleep(min(0.25, max(0.0, end - time.monotonic())))
                if duty is not None:
                    running = not running
                    for pid in self.engine_pids:
                        os.kill(pid, signal.SIGCONT if running else signal.SIGSTOP)
        finally:
            for pid in self.engine_pids:
                os.kill(pid, signal.SIGCONT)
        stop_load.set()
        loader.join(900)
        statuses: dict[str, int] = {}
        for r in results:
            statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
        return {
            "seconds_stopped" if duty is None else "seconds_slowed": seconds,
            "duty": duty,
            "first_ejection_after_s": None if first_ejection is None else round(first_ejection, 1),
            "requests": statuses,
            "longest_request_s": round(max((r.get("total_s", 0.0) for r in results), default=0), 1),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--busy", type=int, default=1, help="busy-loop processes beside the fleet")
    parser.add_argument("--phases", default="example,bench,overload,freeze,slow")
    parser.add_argument("--rates", default="4,0.1,0.2,0.3,0.4", help="bench rates, req/s")
    parser.add_argument("--bench-duration", type=float, default=60.0)
    parser.add_argument("--overload-rate", type=float, default=4.0)
    parser.add_argument("--overload-duration", type=float, default=60.0)
    parser.add_argument("--freeze", default="10,30,60", help="seconds every engine is stopped")
    parser.add_argument("--slow", default="60", help="seconds every engine is slowed")
    parser.add_argument("--slow-duty", type=float, default=0.25)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--settle", type=float, default=10.0)
    parser.add_argument("--up-args", nargs=argparse.REMAINDER, default=[])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    phases = args.phases.split(",")
    with tempfile.TemporaryDirectory(prefix="pdfleet-day-one-") as tmp:
        day = DayOne(args, Path(tmp))
        day.result["load_average_start"] = [round(x, 1) for x in os.getloadavg()]
        day.result["busy_processes"] = args.busy
        try:
            day.start()
            if "example" in phases:
                day.phase("example", day.example)
            if "bench" in phases:
                for rate in [float(r) for r in args.rates.split(",") if r]:
                    day.phase(f"bench_{rate:g}", lambda rate=rate: day.bench(rate))
            if "overload" in phases:
                day.phase(
                    "overload",
                    lambda: day.overload(args.overload_rate, args.overload_duration),
                )
            if "freeze" in phases:
                for s in [float(x) for x in args.freeze.split(",") if x]:
                    day.phase(f"freeze_{s:g}", lambda s=s: day.stopped_fleet(s, None))
            if "slow" in phases:
                for s in [float(x) for x in args.slow.split(",") if x]:
                    day.phase(f"slow_{s:g}", lambda s=s: day.stopped_fleet(s, args.slow_duty))
        finally:
            day.stop()
            log = day.log_path.read_text(errors="replace") if hasattr(day, "log_path") else ""
            gateway_log = list(Path(tmp, "runs").glob("*/gateway.log"))
            day.result["gateway_log_ejections"] = (
                [ln for ln in gateway_log[0].read_text().splitlines() if "ejected" in ln][:20]
                if gateway_log
                else []
            )
            del log
    bench_rates = {
        k: v for k, v in day.result["phases"].items() if k.startswith("bench_") and k != "bench_4"
    }
    sustained = [float(k[6:]) for k, v in bench_rates.items() if v.get("failed") == 0]
    day.result["sustained_rate"] = max(sustained) if sustained else None
    print(json.dumps(day.result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(day.result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
