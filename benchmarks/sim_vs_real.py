"""The simulator against the real fleet: short traces through both.

1. Calibrates the simulator's fleet model (``pdfleet sim calibrate``) against
   a real engine started with the fleet's decode engine arguments, timing its
   cold start with ``--cold-start-command``.
2. Chooses the trace's base rate, unless ``--rate`` is given: the lowest of
   a ladder at which the simulator, on that calibration, takes decode to
   ``--decode-peak`` replicas, so that both fleets have scaling to do
   however fast this machine's engines are.
3. Per run (``--runs``, seeds from ``--seed`` on): replays one short burst
   trace (open loop, arrival times from the trace, random-token prompts of
   the trace's lengths, ``ignore_eos`` outputs) through a real ``pdfleet up``
   fleet with autoscaling on, recording each request's TTFT and mean
   inter-token latency, and the fleet's replicas per role from its
   ``fleet.json`` every half second; then the same trace through the
   simulator with the calibrated model and the same autoscaling section.
4. Compares them at SLOs set at the real fleet's own ``--slo-quantile``
   (99th by default) of TTFT and of ITL, where attainment varies: the SLO
   attainment, TTFT and ITL p50 and p99, and replica-seconds of both, against
   the fidelity targets (attainment within 2 points, percentiles within
   25%, replica-seconds within 15%).

It writes everything as JSON with the machine's load average: on a shared
machine the real fleet's engines compete for the CPU while the simulator's
do not (docs/autoscaling.md, "The simulator against the real fleet").

    .venv/bin/python benchmarks/sim_vs_real.py --runs 5 \
        --out benchmarks/results/sim_vs_real_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdfleet.engine.contracts import security
from pdfleet.engine.contracts.launch import python_module
from pdfleet.engine.reports.stats import percentile
from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.autoscaling_lab.calibrate import CalibrateOptions, calibrate
from pdfleet.operator.autoscaling_lab.sim import PolicyStrategy
from pdfleet.operator.autoscaling_lab.sim_fleet import FleetModel, Simulation
from pdfleet.operator.autoscaling_lab.traces import Burst, TraceConfig, make_trace

# The fleet: small decode engines (4 sequences, 48 blocks of 16 tokens) so a
# CPU-sized load needs more than one; every request takes the prefill leg,
# as in the simulator.
ENGINE = {"maxModelLen": 512, "disableLogStats": True}
DECODE_ENGINE = {"maxNumSeqs": 4, "numGpuBlocksOverride": 48}
AUTOSCALING = {
    "periodSeconds": 2,
    "metricsStaleSeconds": 10,
    "prefill": {
        "minReplicas": 1,
        "maxReplicas": 2,
        "scaleDownStabilizationSeconds": 30,
        "ttftTargetSeconds": 2.0,
    },
    "decode": {
        "minReplicas": 1,
        "maxReplicas": 3,
        "targetWaitingPerReplica": 2,
        "scaleDownStabilizationSeconds": 30,
        "maxScaleUpStep": 2,
    },
}
ROLES = ("prefill", "decode")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check: Any, timeout: float, every: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every)
    return False


def stop(proc: subprocess.Popen[bytes], timeout: float = 90) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def tiny_model(directory: Path) -> str:
    from pdfleet.engine.tiny.builder import TinyModelSpec, build_tiny_model

    return build_tiny_model(str(directory), TinyModelSpec(arch="llama"))


def engine_flags(spec: dict[str, Any]) -> list[str]:
    """camelCase engine keys -> ``pdfleet serve`` flags."""
    out = []
    for key, value in spec.items():
        flag = "--" + "".join("-" + c.lower() if c.isupper() else c for c in key)
        if value is True:
            out.append(flag)
        else:
            out += [flag, str(value)]
    return out


def run_calibration(model_dir: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Calibrate against one engine with the decode engine's arguments, timing
    a second one's cold start."""
    serve = [
        *python_module("pdfleet.engine.cli"),
        "serve",
        model_dir,
        "--served-model-name",
        "tiny",
        *engine_flags({**ENGINE, **DECODE_ENGINE}),
    ]
    port = free_port()
    log = open(tmp / "calibrate-engine.log", "wb")  # noqa: SIM115 (closed below)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [*serve, "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        if not wait_until(lambda: _healthy(url), 300):
            raise RuntimeError(
                f"calibration engine not healthy: {(tmp / 'calibrate-engine.log').read_text()[-2000:]}"
            )
        cold_port = free_port()
        options = CalibrateOptions(
            prefill_repeats=3,
            decode_batches=(1, 2, 4),
            decode_prompt_tokens=(32, 192),
            decode_output_tokens=24,
            time_budget_seconds=180,
            cold_start_command=" ".join([*serve, "--port", str(cold_port)]),
            cold_start_url=f"http://127.0.0.1:{cold_port}",
        )
        return calibrate([url], options)
    finally:
        stop(proc)
        log.close()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def fleet_counts(run_dir: Path) -> dict[str, int] | None:
    """Replicas per role that cost (starting, ready, draining) in fleet.json."""
    files = list(run_dir.glob("*/fleet.json"))
    if not files:
        return None
    try:
        doc = json.loads(files[0].read_text())
    except (OSError, json.JSONDecodeError):
        return None
    counts = {role: 0 for role in ROLES}
    live = {role: 0 for role in ROLES}
    for e in doc.get("engines", []):
        if e["role"] in counts and e["state"] in ("starting", "ready", "draining"):
            counts[e["role"]] += 1
            if e["state"] != "draining":
                live[e["role"]] += 1
    return {**counts, **{f"{r}_live": live[r] for r in ROLES}}


async def replay(url: str, trace: Any, headers: dict[str, str], timeout: float) -> list[dict]:
    """Every request of the trace at its arrival time; TTFT and mean ITL each."""
    rng = random.Random(trace.config.seed)
    results: list[dict[str, Any]] = []
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        start = time.monotonic() + 1.0

        async def one(i: int) -> None:
            arrival = start + trace.arrivals[i]
            await asyncio.sleep(max(arrival - time.monotonic(), 0.0))
            body = {
                "model": "tiny",
                "prompt": [rng.randrange(5, 250) for _ in range(trace.prompt_tokens[i])],
                "max_tokens": trace.output_tokens[i],
                "min_tokens": trace.output_tokens[i],
                "ignore_eos": True,
                "stream": True,
            }
            times: list[float] = []
            error = None
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        error = f"status {r.status_code}"
                    else:
                        async for line in r.aiter_lines():
                            if line.startswith("data: ") and line != "data: [DONE]":
                                chunk = json.loads(line[6:])
                                if any(c.get("text") for c in chunk.get("choices", [])):
                                    times.append(time.monotonic())
            except httpx.HTTPError as e:
                error = repr(e)
            results.append(
                {
                    "arrival": trace.arrivals[i],
                    "ttft": times[0] - arrival if times else None,
                    "itl": (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0,
                    "tokens": len(times),
                    "error": error,
                }
            )

        await asyncio.gather(*(one(i) for i in range(len(trace))))
    return results


def probe_ttft(url: str, headers: dict[str, str], prompt_tokens: int, count: int) -> list[float]:
    """TTFTs of ``count`` requests sent one at a time through the fleet's
    gateway to an idle fleet (2 output tokens each): what the path around
    prefill costs (the gateway hop, the KV handover, the first decode step),
    which the simulator's model of an engine alone does not see."""
    rng = random.Random(12345)
    out = []
    with httpx.Client(base_url=url, headers=headers, timeout=60) as client:
        for _ in range(count):
            body = {
                "model": "tiny",
                "prompt": [rng.randrange(5, 250) for _ in range(prompt_tokens)],
                "max_tokens": 2,
                "stream": True,
            }
            start = time.monotonic()
            with client.stream("POST", "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        out.append(time.monotonic() - start)
                        break
    return out


def run_real(
    model_dir: str, trace: Any, args: argparse.Namespace, tmp: Path
) -> tuple[list[dict], list[tuple[float, dict[str, int]]], str, list[float]]:
    spec = {
        "apiVersion": "pdfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "simvsreal"},
        "spec": {
            "model": {"name": "tiny", "uri": f"file://{model_dir}"},
            "engine": ENGINE,
            "kvTransfer": {"connector": "NixlConnector", "leaseSeconds": 20},
            "prefill": {"replicas": 1},
            "decode": {"replicas": 1, "engine": DECODE_ENGINE},
            "disaggregation": {"mode": "Always"},
            "autoscaling": {
                **AUTOSCALING,
                "prefill": {**AUTOSCALING["prefill"], "ttftTargetSeconds": args.ttft_slo},
                "decode": {**AUTOSCALING["decode"], "itlTargetSeconds": args.itl_slo},
            },
        },
    }
    tmp.mkdir(parents=True, exist_ok=True)
    file = tmp / "fleet.yaml"
    file.write_text(yaml.safe_dump(spec))
    port, run_dir, out_path = free_port(), tmp / "run", tmp / "up.out"
    out = open(out_path, "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [
            *python_module("pdfleet.engine.cli"),
            "up",
            str(file),
            "--port",
            str(port),
            "--run-dir",
            str(run_dir),
            "--timeout",
            "300",
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    samples: list[tuple[float, dict[str, int]]] = []
    try:
        ok = wait_until(
            lambda: "ready: " in out_path.read_text(errors="replace") or proc.poll() is not None,
            400,
        )
        if not ok or proc.poll() is not None:
            raise RuntimeError(f"pdfleet up not ready:\n{out_path.read_text()[-3000:]}")
        keys = security.api_keys_from_env()
        headers = {"authorization": f"Bearer {next(iter(keys))}"} if keys else {}
        probes = probe_ttft(
            f"http://127.0.0.1:{port}", headers, round(args.prompt_tokens), args.probes
        )
        done = threading.Event()
        started = time.monotonic() + 1.0  # replay's start

        def watch() -> None:
            while not done.is_set():
                counts = fleet_counts(run_dir)
                if counts is not None:
                    samples.append((time.monotonic() - started, counts))
                done.wait(0.5)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        results = asyncio.run(
            asyncio.wait_for(
                replay(f"http://127.0.0.1:{port}", trace, headers, args.request_timeout),
                trace.config.duration_seconds + 4 * args.request_timeout,
            )
        )
        # Until the end of the trace (requests may finish earlier).
        wait_until(lambda: time.monotonic() - started >= trace.config.duration_seconds, 600, 0.5)
        done.set()
        watcher.join(5)
        return results, samples, out_path.read_text(errors="replace"), probes
    finally:
        stop(proc)
        out.close()


def real_figures(
    results: list[dict],
    samples: list[tuple[float, dict[str, int]]],
    model: FleetModel,
    duration: float,
) -> dict[str, Any]:
    ok = [r for r in results if r["error"] is None and r["ttft"] is not None]
    n = len(results)
    replica_seconds = {role: 0.0 for role in ROLES}
    events = {role: 0 for role in ROLES}
    scale_log = []
    inside = [(t, c) for t, c in samples if 0 <= t <= duration]
    for (t0, c0), (t1, c1) in itertools.pairwise(inside):
        for role in ROLES:
            replica_seconds[role] += c0[role] * (t1 - t0)
            if c1[f"{role}_live"] != c0[f"{role}_live"]:
                events[role] += 1
                scale_log.append((round(t1, 1), role, c0[f"{role}_live"], c1[f"{role}_live"]))
    return {
        "requests": n,
        "failed": n - len(ok),
        **slo_figures(results, model.ttft_slo_seconds, model.itl_slo_seconds),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
        "replica_seconds": {**replica_seconds, "total": sum(replica_seconds.values())},
        "scale_events": {**events, "total": sum(events.values())},
        "peak_replicas": {role: max((c[role] for _, c in inside), default=0) for role in ROLES},
        "scale_log": scale_log,
        "timeline": [(round(t, 1), c["prefill"], c["decode"]) for t, c in inside[::4]],
    }


def gap(sim: float, real: float) -> float | None:
    """|sim - real| / real."""
    return abs(sim - real) / real if real else None


def make_run_trace(args: argparse.Namespace, rate: float) -> tuple[TraceConfig, Burst, Any]:
    """The short burst trace at ``rate`` base requests/s: one surge that ramps
    up from a fifth in, holds for a third, and ramps down."""
    config = TraceConfig(
        kind="burst",
        duration_seconds=args.duration,
        base_rate=rate,
        seed=args.seed,
        prompt_tokens_mean=args.prompt_tokens,
        prompt_tokens_sigma=0.3,
        prompt_tokens_max=256,
        output_tokens_mean=args.output_tokens,
        output_tokens_sigma=0.3,
        output_tokens_max=256,
    )
    d = args.duration
    surge = Burst(start=0.2 * d, factor=args.burst_factor, hold=d / 3, ramp=0.1 * d)
    return config, surge, make_trace(config, bursts=[surge])


def simulate(trace: Any, model: FleetModel, spec: AutoscalingSpec, seed: int) -> Any:
    return run_sim(trace, model, spec, seed)[0]


def run_sim(trace: Any, model: FleetModel, spec: AutoscalingSpec, seed: int) -> tuple[Any, Any]:
    """The policy over ``trace`` in the simulator: (its result, the
    simulation, whose requests hold every TTFT and ITL)."""
    sim = Simulation(trace, model, spec, PolicyStrategy(spec), (1, 1), seed)
    return sim.run(), sim


def sim_latencies(sim: Any) -> list[dict[str, Any]]:
    """Per request, in :func:`replay`'s shape: TTFT and mean ITL (None and an
    error where it was not served)."""
    out = []
    for q in sim.requests:
        served = q.first >= 0 and q.done >= 0
        out.append(
            {
                "ttft": q.first - q.arrival if q.first >= 0 else None,
                "itl": (q.done - q.first) / (q.output - 1) if served and q.output > 1 else 0.0,
                "tokens": q.output if served else 0,
                "error": None if served else "not served",
            }
        )
    return out


def slo_figures(results: list[dict], ttft_slo: float, itl_slo: float) -> dict[str, Any]:
    """Attainment at the given SLOs (a failed request misses both) and the
    latency percentiles of the served requests."""
    ok = [r for r in results if r["error"] is None and r["ttft"] is not None]
    n = len(results)
    ttfts = sorted(r["ttft"] for r in ok)
    itls = sorted(r["itl"] for r in ok if r["tokens"] > 1)
    return {
        "ttft_attainment": sum(r["ttft"] <= ttft_slo for r in ok) / n if n else 0.0,
        "itl_attainment": sum(r["itl"] <= itl_slo for r in ok) / n if n else 0.0,
        "ttft_p50": percentile(ttfts, 50) if ttfts else None,
        "ttft_p99": percentile(ttfts, 99) if ttfts else None,
        "itl_p50": percentile(itls, 50) if itls else None,
        "itl_p99": percentile(itls, 99) if itls else None,
    }


# Fidelity targets, per run: attainment within 2 points, the latency
# percentiles within 25%, replica-seconds within 15%.
ATTAINMENT_POINTS = 0.02
PERCENTILE_GAP = 0.25
REPLICA_SECONDS_GAP = 0.15


def fidelity(real: dict[str, Any], sim: dict[str, Any]) -> dict[str, Any]:
    """Each fidelity target of one run: the gap and whether it holds."""
    out: dict[str, Any] = {}
    for key in ("ttft_attainment", "itl_attainment"):
        diff = abs(sim[key] - real[key])
        out[key] = {"gap_points": diff, "met": diff <= ATTAINMENT_POINTS}
    for key in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
        g = gap(sim[key], real[key]) if sim[key] is not None and real[key] else None
        out[key] = {"gap": g, "met": g is not None and g <= PERCENTILE_GAP}
    g = gap(sim["replica_seconds"]["total"], real["replica_seconds"]["total"])
    out["replica_seconds"] = {"gap": g, "met": g is not None and g <= REPLICA_SECONDS_GAP}
    return out


def sim_figures(result: Any) -> dict[str, Any]:
    return {
        "requests": result.requests,
        "ttft_attainment": result.ttft_attainment,
        "itl_attainment": result.itl_attainment,
        "ttft_p50": result.ttft_p50,
        "ttft_p99": result.ttft_p99,
        "itl_p50": result.itl_p50,
        "itl_p99": result.itl_p99,
        "replica_seconds": result.replica_seconds,
        "scale_events": result.scale_events,
        "peak_replicas": result.peak_replicas,
        "scale_log": result.scale_log,
    }


def choose_rate(
    args: argparse.Namespace, model: FleetModel, spec: AutoscalingSpec
) -> tuple[float, list[dict[str, Any]]]:
    """The lowest base rate of a geometric ladder at which the simulator,
    on the calibrated model, takes decode to ``--decode-peak`` replicas: a
    comparison that scales, whatever the machine's engines measure. The
    ladder's top if none does."""
    tried = []
    rate = args.min_rate
    while True:
        result = simulate(make_run_trace(args, rate)[2], model, spec, args.seed)
        peak = result.peak_replicas["decode"]
        tried.append({"rate": round(rate, 3), "decode_peak": peak, "events": result.scale_events})
        if peak >= args.decode_peak or rate * 1.25 > args.max_rate:
            return rate, tried
        rate *= 1.25


def one_run(
    model_dir: str,
    fleet_model: FleetModel,
    spec: AutoscalingSpec,
    args: argparse.Namespace,
    rate: float,
    seed: int,
    tmp: Path,
) -> dict[str, Any]:
    """One trace through the real fleet and the simulator, compared at SLOs
    set at the real fleet's own ``--slo-quantile`` of TTFT and ITL (so that
    its attainment sits near the SLO and the simulator's can differ)."""
    run_args = argparse.Namespace(**{**vars(args), "seed": seed})
    config, surge, trace = make_run_trace(run_args, rate)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    results, samples, log, probes = run_real(model_dir, trace, run_args, tmp / f"run-{seed}")
    real_wall = time.monotonic() - t0
    load_after = os.getloadavg()
    real = real_figures(results, samples, fleet_model, args.duration)
    served = [r for r in results if r["error"] is None and r["ttft"] is not None]
    ttft_slo = percentile(sorted(r["ttft"] for r in served), args.slo_quantile)
    itl_slo = percentile(sorted(r["itl"] for r in served if r["tokens"] > 1), args.slo_quantile)
    # The path around prefill that the idle fleet's TTFT shows beyond the
    # calibrated prefill, given to the simulator as its KV transfer time
    # (per prompt token, at the trace's mean prompt).
    path = statistics.median(probes) - fleet_model.prefill_seconds(args.prompt_tokens)
    model = dataclasses.replace(
        fleet_model, transfer_seconds_per_token=max(path, 0.0) / args.prompt_tokens
    )
    result, sim_run = run_sim(trace, model, spec, seed)
    sim = {**sim_figures(result), **slo_figures(sim_latencies(sim_run), ttft_slo, itl_slo)}
    real = {**real, **slo_figures(results, ttft_slo, itl_slo)}
    return {
        "seed": seed,
        "rate": rate,
        "trace": {**vars(config), "bursts": [vars(surge)], "requests": len(trace)},
        "slo": {"quantile": args.slo_quantile, "ttft_seconds": ttft_slo, "itl_seconds": itl_slo},
        "idle_ttft_probes": probes,
        "path_seconds": path,
        "real": real,
        "sim": sim,
        "fidelity": fidelity(real, sim),
        "real_wall_seconds": real_wall,
        "load_average": {"before": load_before, "after": load_after, "cores": os.cpu_count()},
        "autoscaler_lines": [ln for ln in log.splitlines() if "->" in ln][:40],
    }


def print_run(run: dict[str, Any]) -> None:
    real, sim, fid = run["real"], run["sim"], run["fidelity"]
    slo = run["slo"]
    print(
        f"run seed {run['seed']}: {run['trace']['requests']} requests at {run['rate']:.2f}/s, "
        f"SLOs at the real p{slo['quantile']:g}: TTFT {slo['ttft_seconds'] * 1e3:.0f} ms, "
        f"ITL {slo['itl_seconds'] * 1e3:.1f} ms; load {run['load_average']['before'][0]:.1f}"
    )
    print(f"  {'':<18}{'real':>12}{'sim':>12}   target")
    rows = (
        ("TTFT attainment", "ttft_attainment", 1, "%", "within 2 points"),
        ("ITL attainment", "itl_attainment", 1, "%", "within 2 points"),
        ("TTFT p50 ms", "ttft_p50", 1e3, "", "within 25%"),
        ("TTFT p99 ms", "ttft_p99", 1e3, "", "within 25%"),
        ("ITL p50 ms", "itl_p50", 1e3, "", "within 25%"),
        ("ITL p99 ms", "itl_p99", 1e3, "", "within 25%"),
    )
    for label, key, scale, unit, target in rows:
        r, s = real[key], sim[key]
        shown = (
            (f"{r:>12.2%}{s:>12.2%}" if unit == "%" else f"{r * scale:>12.2f}{s * scale:>12.2f}")
            if r is not None and s is not None
            else f"{'-':>12}{'-':>12}"
        )
        print(f"  {label:<18}{shown}   {target}: {'met' if fid[key]['met'] else 'MISSED'}")
    r, s = real["replica_seconds"]["total"], sim["replica_seconds"]["total"]
    print(
        f"  {'replica-seconds':<18}{r:>12.1f}{s:>12.1f}   within 15%: "
        f"{'met' if fid['replica_seconds']['met'] else 'MISSED'}"
    )
    print(
        f"  {real['failed']} of {real['requests']} failed; scale events real "
        f"{real['scale_log']}, sim {sim['scale_log']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=180.0, help="trace seconds")
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        help="base requests/s; default: chosen after calibrating (--decode-peak)",
    )
    parser.add_argument(
        "--decode-peak",
        type=int,
        default=2,
        help="without --rate: the lowest rate at which the simulated decode reaches this many "
        "replicas",
    )
    parser.add_argument("--min-rate", type=float, default=0.5, help="the rate ladder's bottom")
    parser.add_argument("--max-rate", type=float, default=6.0, help="the rate ladder's top")
    parser.add_argument("--burst-factor", type=float, default=3.0, help="surge: x base rate")
    parser.add_argument("--prompt-tokens", type=float, default=128.0)
    parser.add_argument("--output-tokens", type=float, default=96.0)
    parser.add_argument(
        "--ttft-slo", type=float, default=2.0, help="the autoscaler's TTFT target (both sides)"
    )
    parser.add_argument(
        "--itl-slo", type=float, default=0.1, help="the autoscaler's ITL target (both sides)"
    )
    parser.add_argument(
        "--slo-quantile",
        type=float,
        default=99.0,
        help="attainment is compared at SLOs set at the real fleet's own percentile of TTFT "
        "and ITL: near the SLO, where attainment varies",
    )
    parser.add_argument("--runs", type=int, default=1, help="runs (seeds from --seed on)")
    parser.add_argument(
        "--probes",
        type=int,
        default=8,
        help="requests sent one at a time to the idle fleet before each run: the TTFT of the "
        "path around prefill, given to the simulator",
    )
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    section = {
        **AUTOSCALING,
        "prefill": {**AUTOSCALING["prefill"], "ttftTargetSeconds": args.ttft_slo},
        "decode": {**AUTOSCALING["decode"], "itlTargetSeconds": args.itl_slo},
    }
    spec = AutoscalingSpec.from_spec(section)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="sim-vs-real-") as tmp_name:
        tmp = Path(tmp_name)
        model_dir = tiny_model(tmp / "model")
        t0 = time.monotonic()
        calibration = run_calibration(model_dir, args, tmp)
        fleet_model = FleetModel(
            **{
                **calibration["fleet_model"],
                "max_num_seqs": DECODE_ENGINE["maxNumSeqs"],
                "ttft_slo_seconds": args.ttft_slo,
                "itl_slo_seconds": args.itl_slo,
            }
        )
        print(
            f"calibrated in {time.monotonic() - t0:.0f} s: {calibration['fleet_model']}", flush=True
        )
        ladder: list[dict[str, Any]] = []
        rate = args.rate
        if rate is None:
            rate, ladder = choose_rate(args, fleet_model, spec)
            print(f"rate {rate:.3f} requests/s (ladder {ladder})", flush=True)
        for seed in range(args.seed, args.seed + args.runs):
            (tmp / f"run-{seed}").mkdir()
            run = one_run(model_dir, fleet_model, spec, args, rate, seed, tmp)
            runs.append(run)
            print_run(run)
    held = {key: sum(bool(r["fidelity"][key]["met"]) for r in runs) for key in runs[0]["fidelity"]}
    print(f"targets met over {len(runs)} runs: {held}")
    if args.out:
        doc = {
            "what": "short burst traces through a real pdfleet up fleet and through the simulator "
            "with the fleet model calibrated from a real engine (benchmarks/sim_vs_real.py)",
            "command": "benchmarks/sim_vs_real.py " + " ".join(argv or sys.argv[1:]),
            "rate_ladder": ladder,
            "autoscaling": section,
            "engines": {"all": ENGINE, "decode": DECODE_ENGINE, "disaggregation": "Always"},
            "calibration": calibration,
            "fleet_model": vars(fleet_model),
            "targets": {
                "attainment_points": ATTAINMENT_POINTS,
                "percentile_gap": PERCENTILE_GAP,
                "replica_seconds_gap": REPLICA_SECONDS_GAP,
            },
            "runs": runs,
            "met_over_runs": held,
        }
        args.out.write_text(json.dumps(doc, indent=1, default=list) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
