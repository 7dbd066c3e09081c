"""The simulator against the real fleet: one short trace through both.

1. Calibrates the simulator's fleet model (``pdfleet sim calibrate``) against
   a real engine started with the fleet's decode engine arguments, timing its
   cold start with ``--cold-start-command``.
2. Chooses the trace's base rate, unless ``--rate`` is given: the lowest of
   a ladder at which the simulator, on that calibration, takes decode to
   ``--decode-peak`` replicas, so that both fleets have scaling to do
   however fast this machine's engines are.
3. Replays one short burst trace (open loop, arrival times from the trace,
   random-token prompts of the trace's lengths, ``ignore_eos`` outputs)
   through a real ``pdfleet up`` fleet with autoscaling on, recording each
   request's TTFT and mean inter-token latency, and the fleet's replicas per
   role from its ``fleet.json`` every half second.
4. Runs the same trace through the simulator with the calibrated model and
   the same autoscaling section.

It prints both side by side (SLO attainment, replica-seconds, scale events)
and the relative gap, and writes them as JSON with the machine's load
average, since on a shared machine the real fleet's engines compete for the
CPU while the simulator's do not (docs/autoscaling.md, "The simulator
against the real fleet").

    .venv/bin/python benchmarks/sim_vs_real.py --out benchmarks/results/sim_vs_real_cpu.json
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
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from pdfleet.engine.config import security
from pdfleet.engine.config.launch import python_module
from pdfleet.engine.config.stats import percentile
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
# Decode step times, relative to the calibration's, of the simulator's
# sensitivity band.
STEP_FACTORS = (0.8, 0.9, 1.0, 1.1, 1.25, 1.5)


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


def run_real(
    model_dir: str, trace: Any, args: argparse.Namespace, tmp: Path
) -> tuple[list[dict], list[tuple[float, dict[str, int]]], str]:
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
            "autoscaling": AUTOSCALING,
        },
    }
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
        return results, samples, out_path.read_text(errors="replace")
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
    ttft_ok = sum(1 for r in ok if r["ttft"] <= model.ttft_slo_seconds)
    itl_ok = sum(1 for r in ok if r["itl"] <= model.itl_slo_seconds)
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
    ttfts = sorted(r["ttft"] for r in ok)
    itls = sorted(r["itl"] for r in ok if r["tokens"] > 1)
    return {
        "requests": n,
        "failed": n - len(ok),
        "ttft_p50": percentile(ttfts, 50),
        "ttft_p99": percentile(ttfts, 99),
        "itl_p50": percentile(itls, 50),
        "itl_p99": percentile(itls, 99),
        "errors": sorted({r["error"] for r in results if r["error"]})[:5],
        "ttft_attainment": ttft_ok / n if n else 0.0,
        "itl_attainment": itl_ok / n if n else 0.0,
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
    return Simulation(trace, model, spec, PolicyStrategy(spec), (1, 1), seed).run()


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


def decode_steps_times(model: FleetModel, factor: float) -> FleetModel:
    """The calibrated model with every term of its decode step times ``factor``."""
    return dataclasses.replace(
        model,
        decode_step_seconds=model.decode_step_seconds * factor,
        decode_step_seconds_per_seq=model.decode_step_seconds_per_seq * factor,
        decode_step_seconds_per_token=model.decode_step_seconds_per_token * factor,
    )


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
    parser.add_argument("--ttft-slo", type=float, default=2.0)
    parser.add_argument("--itl-slo", type=float, default=0.1)
    parser.add_argument("--request-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    spec = AutoscalingSpec.from_spec(AUTOSCALING)
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
        config, surge, trace = make_run_trace(args, rate)
        t0 = time.monotonic()
        results, samples, log = run_real(model_dir, trace, args, tmp)
        real_wall = time.monotonic() - t0
    load_after = os.getloadavg()
    real = real_figures(results, samples, fleet_model, args.duration)
    sim = sim_figures(simulate(trace, fleet_model, spec, args.seed))
    # Stretched so that the simulated median ITL becomes the real fleet's:
    # the engines calibrated alone against the engines beside the gateway,
    # the load generator and each other on the same cores.
    measured = sim["itl_p50"] > 0 and real["itl_p50"] > 0  # False on NaN (no ITL)
    itl_factor = real["itl_p50"] / sim["itl_p50"] if measured else 1.0
    stretched = decode_steps_times(fleet_model, itl_factor)
    sim_at_real_itl = sim_figures(simulate(trace, stretched, spec, args.seed))
    # How much the simulated figures move with the decode step alone: on a
    # short trace one scale-up's timing is a threshold crossing of a noisy
    # KV series, so the band says what one comparison's gap can mean.
    band = []
    for factor in STEP_FACTORS:
        r = simulate(trace, decode_steps_times(fleet_model, factor), spec, args.seed)
        band.append(
            {
                "decode_step_factor": factor,
                "replica_seconds": r.replica_seconds["total"],
                "ttft_attainment": r.ttft_attainment,
                "scale_log": r.scale_log,
            }
        )
    gaps = {
        "ttft_attainment": gap(sim["ttft_attainment"], real["ttft_attainment"]),
        "itl_attainment": gap(sim["itl_attainment"], real["itl_attainment"]),
        "replica_seconds": gap(sim["replica_seconds"]["total"], real["replica_seconds"]["total"]),
        "scale_events": gap(sim["scale_events"]["total"], real["scale_events"]["total"]),
    }
    print(f"{'':<18}{'real':>12}{'sim':>12}{'gap':>8}")
    for key, r_value, s_value in (
        ("TTFT attainment", real["ttft_attainment"], sim["ttft_attainment"]),
        ("ITL attainment", real["itl_attainment"], sim["itl_attainment"]),
        ("replica-seconds", real["replica_seconds"]["total"], sim["replica_seconds"]["total"]),
        ("scale events", real["scale_events"]["total"], sim["scale_events"]["total"]),
    ):
        g = gap(s_value, r_value)
        print(f"{key:<18}{r_value:>12.3f}{s_value:>12.3f}{'' if g is None else f'{g:>7.1%}'}")
    print(
        f"real fleet: {real['failed']} of {real['requests']} failed; peaks {real['peak_replicas']}; "
        f"sim peaks {sim['peak_replicas']}; load average {load_before} -> {load_after}"
    )
    print(f"scale events real {real['scale_log']}\n             sim  {sim['scale_log']}")
    print(
        f"median ITL real {real['itl_p50'] * 1e3:.2f} ms, sim {sim['itl_p50'] * 1e3:.2f} ms; "
        f"the sim with decode steps x{itl_factor:.2f} "
        f"(the real median ITL): replica-seconds {sim_at_real_itl['replica_seconds']['total']:.1f} "
        f"(gap {gap(sim_at_real_itl['replica_seconds']['total'], real['replica_seconds']['total']):.1%}), "
        f"TTFT {sim_at_real_itl['ttft_attainment']:.3f}, events {sim_at_real_itl['scale_log']}"
    )
    seconds = [b["replica_seconds"] for b in band]
    print(
        f"sim replica-seconds with decode steps x{STEP_FACTORS[0]:g}-{STEP_FACTORS[-1]:g}: "
        f"{min(seconds):.0f}-{max(seconds):.0f}"
    )
    if args.out:
        doc = {
            "what": "one burst trace through a real pdfleet up fleet and through the simulator "
            "with the fleet model calibrated from a real engine (benchmarks/sim_vs_real.py)",
            "command": "benchmarks/sim_vs_real.py " + " ".join(argv or sys.argv[1:]),
            "trace": {**vars(config), "bursts": [vars(surge)], "requests": len(trace)},
            "rate_ladder": ladder,
            "autoscaling": AUTOSCALING,
            "engines": {"all": ENGINE, "decode": DECODE_ENGINE, "disaggregation": "Always"},
            "calibration": calibration,
            "fleet_model": vars(fleet_model),
            "real": real,
            "sim": sim,
            "sim_at_real_itl": {
                "decode_step_factor": itl_factor,
                **sim_at_real_itl,
            },
            "gap": gaps,
            "sim_decode_step_band": band,
            "real_wall_seconds": real_wall,
            "load_average": {"before": load_before, "after": load_after, "cores": os.cpu_count()},
            "autoscaler_lines": [ln for ln in log.splitlines() if "->" in ln][:40],
        }
        args.out.write_text(json.dumps(doc, indent=1, default=list) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
