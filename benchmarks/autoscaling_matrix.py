"""The autoscaling target matrix, with its sensitivity runs, as one JSON file.

Runs ``pdfleet sim --matrix`` (every trace kind x seeds, each target checked
per seed against that seed's own baselines) for the default fleet model and
for the sensitivity cases docs/autoscaling.md states: cold start x2, and the
fleet's real prefill tokens/s 30% below and above what the spec was
calibrated to (``prefillTokensPerSecond`` stays at the nominal value).

    .venv/bin/python benchmarks/autoscaling_matrix.py --seeds 10 --jobs 2 \
        --out benchmarks/results/autoscaling_matrix.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from pdfleet.operator.autoscaling.matrix import all_met, format_matrix, run_matrix
from pdfleet.operator.autoscaling.sim_cmd import DEFAULT_MAX_REPLICAS
from pdfleet.operator.autoscaling.sim_fleet import FleetModel
from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.autoscaling.traces import TRACE_KINDS, TraceConfig


def cases(model: FleetModel) -> dict[str, tuple[FleetModel, float | None]]:
    """name -> (the fleet model, the spec's prefillTokensPerSecond)."""
    nominal = model.prefill_tokens_per_second
    return {
        "default": (model, None),
        "cold_start_x2": (
            dataclasses.replace(model, cold_start_seconds=2 * model.cold_start_seconds),
            None,
        ),
        "prefill_rate_-30%": (
            dataclasses.replace(model, prefill_tokens_per_second=0.7 * nominal),
            nominal,
        ),
        "prefill_rate_+30%": (
            dataclasses.replace(model, prefill_tokens_per_second=1.3 * nominal),
            nominal,
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--traces", default=",".join(TRACE_KINDS))
    parser.add_argument(
        "--cases", default="default,cold_start_x2,prefill_rate_-30%,prefill_rate_+30%"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    kinds = [k for k in args.traces.split(",") if k]
    out: dict[str, object] = {"seeds": args.seeds, "traces": kinds, "cases": {}}
    ok = True
    for name, (model, configured) in cases(FleetModel()).items():
        if name not in args.cases.split(","):
            continue
        section = {role: {"maxReplicas": DEFAULT_MAX_REPLICAS} for role in ("prefill", "decode")}
        if configured is not None:
            section["prefill"]["prefillTokensPerSecond"] = configured
        spec = AutoscalingSpec.from_spec(section)
        result = run_matrix(TraceConfig(), model, spec, kinds, range(args.seeds), jobs=args.jobs)
        print(f"== {name}")
        print(format_matrix(result), flush=True)
        ok = ok and all_met(result["summary"])
        out["cases"][name] = {  # type: ignore[index]
            "model": result["model"],
            "summary": result["summary"],
            "cells": [
                {
                    "trace": c["trace"],
                    "seed": c["seed"],
                    "targets": c["targets"],
                    "strategies": {
                        s: {
                            k: r[k]["total"] if isinstance(r[k], dict) else r[k]
                            for k in (
                                "ttft_attainment",
                                "itl_attainment",
                                "replica_seconds",
                                "scale_events",
                            )
                            if k in r
                        }
                        for s, r in c["results"].items()
                    },
                }
                for c in result["cells"]
            ],
            "wall_seconds": result["wall_seconds"],
        }
    if args.out:
        args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
        print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
