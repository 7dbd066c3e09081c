"""Gateway throughput per core: pdfleet's gateway beside vLLM's Rust router.

A stub engine (nginx with canned answers on every route a router touches:
``/v1/completions`` as one JSON answer, or as a stream of 26 SSE events;
``/health``, ``/metrics``, ``/v1/models``) is fast enough to bound neither
router. Each router is pinned to the same core(s) (``taskset``) and driven by
the same ``wrk`` (a Lua script POSTs the body) pinned with nginx to the other
core(s). Reported per router: req/s and latency percentiles for non-streamed
requests at 16 and 64 connections, streams/s and events/s for streamed ones,
pdfleet at ``--workers 1`` and ``--workers 2``, and pdfleet's ratio to the Rust
router in the same run; and each router's CPU time per request (its process
and workers, from /proc), whose ratio is the per-core comparison that a
loaded machine's neighbours move least. ``vllm-router`` is installed by this
script into a throwaway virtualenv under ``build/`` (cached there).

``--engines 1 2`` (the default) also puts two stub engines (two nginx server
blocks) behind each router, non-streamed and streamed at 16 connections, one
worker: with one engine pdfleet's gateway skips the prompt analysis (nothing
to choose), with two it runs its general path (block hashes, approximate
prefix affinity and load scoring; no KV events from a stub, so no exact
index) and ``vllm-router`` runs ``cache_aware`` (its prefix-tree policy, the
closest peer) instead of ``round_robin``; ``vllm-router-rr`` is the Rust
router with ``round_robin`` over the same engines, its cheapest policy.

    .venv/bin/python benchmarks/gateway_throughput.py [--duration 10]
        [--repeat 1] [--router-cpus 0] [--load-cpus 1] [--workers 1 2]
        [--engines 1 2] [--general-connections 16]
        [--json benchmarks/results/gateway_throughput_cpu.json]

On a 2-core machine ``--workers 2`` shares its one router core (or, with
``--router-cpus 0,1``, the load generator's): scaling needs more cores than
that, so the scaling rows say which cores they had.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from fleet import free_port

from pdfleet.engine.contracts.launch import python_module

ROOT = Path(__file__).resolve().parent.parent
ROUTER_VENV = ROOT / "build" / "vllm-router-venv"
ROUTER_VERSION = "0.1.17"
NUM_EVENTS = 26
PROMPT = "Tell me about the history of the bicycle in three short sentences."

COMPLETION = json.dumps(
    {
        "id": "cmpl-stub",
        "object": "text_completion",
        "created": 1,
        "model": "stub",
        "choices": [
            {
                "index": 0,
                "text": " The bicycle was invented in the early 19th century.",
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 14, "completion_tokens": 16, "total_tokens": 30},
    },
    separators=(",", ":"),
)


def _event(i: int, comments: bool = False) -> str:
    """One streamed chunk; ``comments``: with the migration comment a pdfleet
    engine writes before it (``: ids N``, ``: end N`` on the last), and
    without logprobs (the block stays within nginx's 4 KiB ``return``)."""
    last = i == NUM_EVENTS - 2
    data = {
        "id": "cmpl-stub",
        "object": "text_completion",
        "created": 1,
        "model": "stub",
        "choices": [
            {
                "index": 0,
                "text": f" tok{i}",
                "logprobs": None,
                "finish_reason": "length" if last else None,
            }
        ],
    }
    if last:
        data["usage"] = {"prompt_tokens": 14, "completion_tokens": 25, "total_tokens": 39}
    comment = ""
    if comments:
        del data["choices"][0]["logprobs"]  # type: ignore[attr-defined]
        comment = (": end " if last else ": ids ") + str(100 + i) + "\n"
    return comment + "data: " + json.dumps(data, separators=(",", ":")) + "\n\n"


def stream(comments: bool = False) -> str:
    """25 chunks (the last with usage) and [DONE]: 26 events."""
    return "".join(_event(i, comments) for i in range(NUM_EVENTS - 1)) + "data: [DONE]\n\n"


STREAM = stream()
# What the stub engines stream (``--engine-comments`` sets it).
STREAM_BODY = [STREAM]
METRICS = (
    "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
    "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
)
MODELS = json.dumps({"object": "list", "data": [{"id": "stub", "object": "model"}]})


def _nginx_string(text: str) -> str:
    assert "$" not in text and "'" not in text  # nginx would interpolate / end the string
    return "'" + text.replace("\\", "\\\\") + "'"


def nginx_conf(run_dir: Path, json_ports: list[int], sse_ports: list[int]) -> str:
    def server(port: int, body: str, media: str) -> str:
        return f"""
  server {{
    listen 127.0.0.1:{port} reuseport backlog=4096;
    location = /v1/completions {{ default_type {media}; return 200 {_nginx_string(body)}; }}
    location = /health {{ default_type text/plain; return 200 ''; }}
    location = /metrics {{ default_type text/plain; return 200 {_nginx_string(METRICS)}; }}
    location = /v1/models {{ default_type application/json; return 200 {_nginx_string(MODELS)}; }}
  }}"""

    tmp = run_dir / "nginx"
    return f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log warn;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  keepalive_requests 10000000;
  keepalive_timeout 75s;
  client_body_temp_path {tmp}/body;
  proxy_temp_path {tmp}/proxy;
  fastcgi_temp_path {tmp}/fastcgi;
  uwsgi_temp_path {tmp}/uwsgi;
  scgi_temp_path {tmp}/scgi;
{"".join(server(port, COMPLETION, "application/json") for port in json_ports)}
{"".join(server(port, STREAM_BODY[0], "text/event-stream") for port in sse_ports)}
}}
"""


WRK_SCRIPT = """
wrk.method = "POST"
wrk.body = os.getenv("BENCH_BODY")
wrk.headers["Content-Type"] = "application/json"

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "WRKJSON {\\"requests\\":%d,\\"duration_us\\":%d,\\"bytes\\":%d," ..
    "\\"errors\\":%d,\\"status_errors\\":%d,\\"timeouts\\":%d," ..
    "\\"mean_us\\":%.1f,\\"p50_us\\":%d,\\"p90_us\\":%d,\\"p99_us\\":%d,\\"max_us\\":%d}\\n",
    summary.requests, summary.duration, summary.bytes,
    e.connect + e.read + e.write + e.timeout, e.status, e.timeout,
    latency.mean, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.max))
end
"""


def ensure_vllm_router() -> Path:
    exe = ROUTER_VENV / "bin" / "vllm-router"
    if exe.exists():
        return exe
    print(f"installing vllm-router {ROUTER_VERSION} into {ROUTER_VENV} ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(ROUTER_VENV)], check=True)
    subprocess.run(
        [str(ROUTER_VENV / "bin" / "pip"), "install", "-q", f"vllm-router=={ROUTER_VERSION}"],
        check=True,
        timeout=900,
    )
    return exe


class Procs:
    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, cmd: list[str], cpus: str, env: dict | None = None):
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (a child keeps it)
        proc = subprocess.Popen(
            ["taskset", "-c", cpus, *cmd],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
        self.procs.remove(proc)

    def close(self) -> None:
        for proc in list(self.procs):
            self.stop(proc)


def wait_serving(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    """Until a completion goes through (discovery done, the engine routable)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the router exited ({proc.returncode}); see its log")
        try:
            r = httpx.post(
                url + "/v1/completions",
                json={"model": "stub", "prompt": PROMPT, "max_tokens": 16},
                timeout=5,
            )
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} did not serve within {timeout}s")


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of ``pid`` and its live descendants (a
    gateway's workers): what a router spent, whatever else loads the machine."""
    parents: dict[int, int] = {}
    ticks: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry.name)] = int(fields[1])
        ticks[int(entry.name)] = int(fields[11]) + int(fields[12])  # utime, stime
    family, grew = {pid}, True
    while grew:
        more = {p for p, parent in parents.items() if parent in family} - family
        family |= more
        grew = bool(more)
    return sum(ticks.get(p, 0) for p in family) / os.sysconf("SC_CLK_TCK")


def run_wrk(url: str, body: dict, connections: int, duration: float, cpus: str, script: Path):
    out = subprocess.run(
        [
            "taskset",
            "-c",
            cpus,
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{duration:g}s",
            "--timeout",
            "10s",
            "-s",
            str(script),
            url + "/v1/completions",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "BENCH_BODY": json.dumps(body)},
        timeout=duration + 60,
    )
    for line in out.stdout.splitlines():
        if line.startswith("WRKJSON "):
            raw = json.loads(line[len("WRKJSON ") :])
            secs = raw["duration_us"] / 1e6
            return {
                "rps": raw["requests"] / secs,
                "requests": raw["requests"],
                "errors": raw["errors"] + raw["status_errors"],
                "mean_ms": raw["mean_us"] / 1000,
                "p50_ms": raw["p50_us"] / 1000,
                "p90_ms": raw["p90_us"] / 1000,
                "p99_ms": raw["p99_us"] / 1000,
                "max_ms": raw["max_us"] / 1000,
            }
    raise RuntimeError(f"wrk gave no result: {out.stdout[-500:]} {out.stderr[-500:]}")


def main() -> int:  # noqa: C901 (a script's main: one phase after another)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of wrk before each run")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each cell (median kept)")
    ap.add_argument("--router-cpus", default="0", help="cores of each router (taskset list)")
    ap.add_argument("--load-cpus", default="1", help="cores of wrk and nginx")
    ap.add_argument(
        "--scale-cpus", default=None, help="cores of --workers 2 (default: --router-cpus)"
    )
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--connections", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--stream-connections", type=int, default=16)
    ap.add_argument(
        "--engines",
        type=int,
        nargs="+",
        default=[1, 2],
        help="stub engines behind each router; N > 1 runs the general routing path",
    )
    ap.add_argument(
        "--general-connections",
        type=int,
        nargs="+",
        default=[16],
        help="connections of the several-engine cells (non-streamed; streamed: its own)",
    )
    ap.add_argument(
        "--engine-comments",
        action="store_true",
        help="the streamed stub writes the migration comments of a pdfleet engine "
        "(': ids N' before each event), which pdfleet's gateway reads and strips",
    )
    ap.add_argument("--no-vllm-router", action="store_true", help="measure pdfleet only")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.engine_comments:
        STREAM_BODY[0] = stream(comments=True)
    for tool in ("nginx", "wrk", "taskset"):
        if shutil.which(tool) is None:
            raise SystemExit(
                f"{tool} is not installed (apt-get install nginx-light wrk util-linux)"
            )
    router_exe = None if args.no_vllm_router else ensure_vllm_router()
    load_start = os.getloadavg()

    run_dir = Path(tempfile.mkdtemp(prefix="gw-throughput-"))
    (run_dir / "nginx").mkdir()
    script = run_dir / "post.lua"
    script.write_text(WRK_SCRIPT)
    max_engines = max(args.engines)
    ports = {mode: [free_port() for _ in range(max_engines)] for mode in ("json", "sse")}
    conf = run_dir / "nginx.conf"
    conf.write_text(nginx_conf(run_dir, ports["json"], ports["sse"]))
    procs = Procs(run_dir)
    procs.start("nginx", ["nginx", "-c", str(conf), "-p", str(run_dir / "nginx")], args.load_cpus)
    # One nginx, one server block (a port) per stub engine of each kind.
    stub = {mode: [f"http://127.0.0.1:{p}" for p in ports[mode]] for mode in ports}
    deadline = time.monotonic() + 30
    for url in stub["json"] + stub["sse"]:
        while True:
            try:
                httpx.get(url + "/health", timeout=2).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    body = {"model": "stub", "prompt": PROMPT, "max_tokens": 16}
    stream_body = {**body, "max_tokens": 25, "stream": True}
    env = {"PDFLEET_API_KEY": "", "PDFLEET_API_KEY_FILE": ""}

    def start_router(kind: str, mode: str, workers: int = 1, engines: int = 1):
        port = free_port()
        cpus = args.router_cpus if workers == 1 else (args.scale_cpus or args.router_cpus)
        urls = stub[mode][:engines]
        if kind == "pdfleet":
            # With several decode engines the gateway's default routing runs:
            # the prompt analyzed (block hashes), approximate prefix affinity
            # plus load scoring (no KV events from a stub, so no exact index).
            cmd = [
                *python_module("pdfleet.engine.cli"), "gateway",
                "--host", "127.0.0.1", "--port", str(port), "--decode", *urls,
                "--disaggregation-mode", "Disabled",
            ]  # fmt: skip
            if workers != 1:
                cmd += ["--workers", str(workers)]
        else:
            # One worker: round_robin (nothing to choose). Several: cache_aware,
            # its prefix-tree routing, the closest peer of prefix affinity
            # ("vllm-router-rr": round_robin over them, the cheapest reference).
            policy = "round_robin" if engines == 1 or kind == "vllm-router-rr" else "cache_aware"
            cmd = [
                str(router_exe), "--host", "127.0.0.1", "--port", str(port),
                "--worker-urls", *urls, "--policy", policy,
                "--log-level", "error", "--prometheus-port", str(free_port()),
            ]  # fmt: skip
        proc = procs.start(f"{kind}-{mode}-w{workers}-e{engines}", cmd, cpus, env)
        url = f"http://127.0.0.1:{port}"
        wait_serving(url, proc)
        return proc, url, cpus

    kinds = ["pdfleet"] + (["vllm-router", "vllm-router-rr"] if router_exe is not None else [])
    # (kind, mode, workers, engines, connections): the single-engine cells at
    # every --workers, then the general path (several engines) at one worker.
    setups: list[tuple[str, str, int, int, list[int]]] = []
    for mode in ("json", "sse"):
        conns = args.connections if mode == "json" else [args.stream_connections]
        for engines in args.engines:
            if engines == 1:
                setups += [("pdfleet", mode, w, 1, conns) for w in args.workers]
                if router_exe is not None:
                    setups.append(("vllm-router", mode, 1, 1, conns))
            else:
                general = [c for c in conns if c in args.general_connections] or conns[:1]
                setups += [(kind, mode, 1, engines, general) for kind in kinds]
    cells: list[dict] = []
    try:
        for kind, mode, workers, engines, conns in setups:
            proc, url, cpus = start_router(kind, mode, workers, engines)
            try:
                for c in conns:
                    req = body if mode == "json" else stream_body
                    if args.warmup > 0:
                        run_wrk(url, req, c, args.warmup, args.load_cpus, script)
                    runs = []
                    for _ in range(args.repeat):
                        cpu0 = cpu_seconds(proc.pid)
                        run = run_wrk(url, req, c, args.duration, args.load_cpus, script)
                        # CPU per request: the per-core cost, which a loaded
                        # machine's neighbours move far less than req/s.
                        run["cpu_us_per_request"] = (
                            1e6 * (cpu_seconds(proc.pid) - cpu0) / max(1, run["requests"])
                        )
                        runs.append(run)
                    best = sorted(runs, key=lambda r: r["rps"])[len(runs) // 2]
                    cell = {
                        "router": kind,
                        "workers": workers,
                        "engines": engines,
                        "router_cpus": cpus,
                        "mode": "streamed" if mode == "sse" else "non-streamed",
                        "connections": c,
                        **best,
                        "rps_runs": [round(r["rps"]) for r in runs],
                        "cpu_us_runs": [round(r["cpu_us_per_request"], 1) for r in runs],
                    }
                    if mode == "sse":
                        cell["events_per_s"] = best["rps"] * NUM_EVENTS
                    cells.append(cell)
                    print(
                        f"{kind:12s} w{workers} e{engines} cpus={cpus:5s} {cell['mode']:13s} "
                        f"c={c:3d} {best['rps']:9.0f} req/s  p50 {best['p50_ms']:6.2f} ms  "
                        f"p99 {best['p99_ms']:6.2f} ms  "
                        f"{best['cpu_us_per_request']:6.0f} us CPU/req  errors {best['errors']}",
                        flush=True,
                    )
            finally:
                procs.stop(proc)
    finally:
        procs.close()

    def find(kind: str, mode: str, c: int, workers: int = 1, engines: int = 1) -> dict | None:
        for cell in cells:
            if (
                cell["router"],
                cell["mode"],
                cell["connections"],
                cell["workers"],
                cell["engines"],
            ) == (kind, mode, c, workers, engines):
                return cell
        return None

    ratios, cpu_ratios = {}, {}
    for cell in cells:
        if cell["router"] != "pdfleet":
            continue
        ref = find("vllm-router", cell["mode"], cell["connections"], 1, cell["engines"])
        key = f"{cell['mode']}_c{cell['connections']}_w{cell['workers']}"
        if cell["engines"] != 1:
            key += f"_e{cell['engines']}"
        if ref:
            ratios[key] = round(cell["rps"] / ref["rps"], 3)
            # Requests per CPU-second, pdfleet's over the Rust router's.
            cpu_ratios[key] = round(ref["cpu_us_per_request"] / cell["cpu_us_per_request"], 3)
        rr = find("vllm-router-rr", cell["mode"], cell["connections"], 1, cell["engines"])
        if rr:
            ratios[key + "_vs_round_robin"] = round(cell["rps"] / rr["rps"], 3)
            cpu_ratios[key + "_vs_round_robin"] = round(
                rr["cpu_us_per_request"] / cell["cpu_us_per_request"], 3
            )
    scaling = {}
    for mode, c in [("non-streamed", c) for c in args.connections] + [
        ("streamed", args.stream_connections)
    ]:
        one = find("pdfleet", mode, c, 1)
        for w in args.workers:
            cell = find("pdfleet", mode, c, w)
            if one and cell and w != 1:
                scaling[f"{mode}_c{c}_w{w}"] = round(cell["rps"] / one["rps"], 3)
    if ratios:
        print("pdfleet / vllm-router:", json.dumps(ratios))
        print("pdfleet / vllm-router, requests per CPU-second:", json.dumps(cpu_ratios))
    if scaling:
        print("pdfleet --workers N / --workers 1:", json.dumps(scaling))
    result = {
        "benchmark": "gateway_throughput",
        "stub": "nginx canned answers; streamed: 26 SSE events in one body",
        "engines": args.engines,
        "policies": {
            "pdfleet": "one engine: the sole route; several: approximate prefix affinity + load",
            "vllm-router": "one engine: round_robin; several: cache_aware",
            "vllm-router-rr": "several engines: round_robin",
        },
        "events_per_stream": NUM_EVENTS,
        "duration_s": args.duration,
        "repeat": args.repeat,
        "load_cpus": args.load_cpus,
        "loadavg_start": load_start,
        "loadavg_end": os.getloadavg(),
        "vllm_router_version": None if router_exe is None else ROUTER_VERSION,
        "cells": cells,
        "ratio_to_vllm_router": ratios,
        "cpu_ratio_to_vllm_router": cpu_ratios,
        "scaling_vs_workers_1": scaling,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
