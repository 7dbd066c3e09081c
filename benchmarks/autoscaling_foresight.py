"""How much foresight the burst trace's TTFT target asks for.

The simulator's oracle provisions, every period, the most replicas the
realized load needs over the next cold start plus one period: its replicas
are ready when the load arrives. This runs the same oracle with less
foresight (it sees the load only ``ahead`` seconds ahead, so its replicas
are ready a cold start plus a period minus ``ahead`` late) on every seed of
a trace, beside the pdfleet policy, and prints TTFT attainment per seed.
A reactive policy's trend projection is a guess at that foresight; the
seeds where even a short-sighted oracle misses 99% are the seeds where the
surge outruns a cold start.

    .venv/bin/python benchmarks/autoscaling_foresight.py --seeds 10 \
        --out benchmarks/results/autoscaling_foresight.json

With a cold start twice as long (the sensitivity case):

    .venv/bin/python benchmarks/autoscaling_foresight.py --seeds 5 --cold-start 120 \
        --ahead 135,105,75,45,15,0 \
        --out benchmarks/results/autoscaling_foresight_cold_start_x2.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.autoscaling_lab.sim import OracleStrategy, PolicyStrategy, Simulation
from pdfleet.operator.autoscaling_lab.sim_cmd import DEFAULT_MAX_REPLICAS
from pdfleet.operator.autoscaling_lab.sim_fleet import FleetModel
from pdfleet.operator.autoscaling_lab.strategies import replica_needs
from pdfleet.operator.autoscaling_lab.traces import TRACE_KINDS, TraceConfig, make_trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--trace", default="burst", choices=TRACE_KINDS)
    parser.add_argument(
        "--ahead",
        default="75,60,45,30,15,0",
        help="the oracle's foresight, seconds, comma-separated",
    )
    parser.add_argument(
        "--cold-start",
        type=float,
        default=None,
        help="the fleet model's cold start, seconds (default: the model's own)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    spec = AutoscalingSpec.from_spec(
        {role: {"maxReplicas": DEFAULT_MAX_REPLICAS} for role in ("prefill", "decode")}
    )
    model = FleetModel()
    if args.cold_start is not None:
        model = dataclasses.replace(model, cold_start_seconds=args.cold_start)
    period = spec.period_seconds
    full = model.cold_start_seconds + period
    aheads = [float(a) for a in args.ahead.split(",") if a]
    print(f"{args.trace}: TTFT attainment per seed; oracle with foresight (s), then pdfleet")
    print("seed " + " ".join(f"{a:>8.0f}" for a in aheads) + "   pdfleet")
    rows = []
    for seed in range(args.seeds):
        trace = make_trace(dataclasses.replace(TraceConfig(), kind=args.trace, seed=seed))
        needs = replica_needs(trace, model, spec)
        start = OracleStrategy(needs, period, full).at(0.0)
        ttft = {}
        for ahead in aheads:
            oracle = OracleStrategy(needs, period, ahead)
            ttft[ahead] = Simulation(trace, model, spec, oracle, start, seed).run().ttft_attainment
        ours = Simulation(trace, model, spec, PolicyStrategy(spec), start, seed).run()
        rows.append(
            {
                "seed": seed,
                "oracle_ttft_by_foresight": {f"{a:g}": v for a, v in ttft.items()},
                "pdfleet_ttft": ours.ttft_attainment,
            }
        )
        cells = " ".join(f"{ttft[a]:8.2%}" for a in aheads)
        print(f"{seed:4d} {cells}  {ours.ttft_attainment:8.2%}", flush=True)
    if args.out:
        doc = {
            "trace": args.trace,
            "cold_start_seconds": model.cold_start_seconds,
            "full_foresight_seconds": full,
            "foresight_seconds": aheads,
            "seeds": rows,
        }
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
