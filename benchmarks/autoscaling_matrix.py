"""The autoscaling target matrix, with its sensitivity runs, as one JSON file.

Runs ``pdfleet sim --matrix`` (every trace kind x seeds, each target checked
per seed against that seed's own baselines) for the default fleet model and
for the sensitivity cases docs/autoscaling.md states: cold start x2, and the
fleet's real prefill tokens/s 30% below and above what the spec was
calibrated to (``prefillTokensPerSecond`` stays at the nominal value).

    .venv/bin/python benchmarks/autoscaling_matrix.py --seeds 10 --jobs 2 \
        --out benchmarks/results/autoscaling_matrix.json

A policy variant (``--tuning`` sets :class:`PolicyTuning` fields) against the
baselines of an earlier run (``--baselines``: HPA's and the oracle's figures
per cell are read from that file, not simulated again):

    .venv/bin/python benchmarks/autoscaling_matrix.py --seeds 10 --jobs 2 \
        --cases default --tuning scale_down_headroom=0.2 \
        --baselines benchmarks/results/autoscaling_matrix.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from pdfleet.operator.autoscaling.policy import PolicyTuning
from pdfleet.operator.autoscaling.spec import AutoscalingSpec
from pdfleet.operator.autoscaling_lab.matrix import all_met, format_matrix, run_matrix
from pdfleet.operator.autoscaling_lab.sim_cmd import DEFAULT_MAX_REPLICAS
from pdfleet.operator.autoscaling_lab.sim_fleet import FleetModel
from pdfleet.operator.autoscaling_lab.traces import TRACE_KINDS, TraceConfig


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


def parse_tuning(text: str) -> PolicyTuning:
    """``name=value,...`` -> PolicyTuning (``none`` for a None field)."""
    fields = {f.name for f in dataclasses.fields(PolicyTuning)}
    values: dict[str, float | None] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = item.partition("=")
        if not sep or name not in fields:
            raise ValueError(
                f"--tuning: {item!r} is not NAME=VALUE with NAME one of {', '.join(sorted(fields))}"
            )
        values[name] = None if value.lower() == "none" else float(value)
    return PolicyTuning(**values)  # type: ignore[arg-type]


def load_baselines(path: Path, case: str) -> dict[tuple[str, int], dict[str, dict[str, float]]]:
    """(trace, seed) -> {"hpa"|"oracle": {"replica_seconds", "scale_events"}} of one case."""
    doc = json.loads(path.read_text())
    out: dict[tuple[str, int], dict[str, dict[str, float]]] = {}
    for cell in doc.get("cases", {}).get(case, {}).get("cells", []):
        out[(cell["trace"], cell["seed"])] = {
            name: {"replica_seconds": r["replica_seconds"], "scale_events": r["scale_events"]}
            for name, r in cell["strategies"].items()
            if name in ("hpa", "oracle") and "scale_events" in r
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--traces", default=",".join(TRACE_KINDS))
    parser.add_argument(
        "--cases", default="default,cold_start_x2,prefill_rate_-30%,prefill_rate_+30%"
    )
    parser.add_argument("--tuning", default="", help="PolicyTuning fields, NAME=VALUE,...")
    parser.add_argument(
        "--baselines", type=Path, default=None, help="reuse HPA's and the oracle's figures"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    tuning = parse_tuning(args.tuning)
    kinds = [k for k in args.traces.split(",") if k]
    out: dict[str, object] = {
        "seeds": args.seeds,
        "traces": kinds,
        "tuning": dataclasses.asdict(tuning),
        "cases": {},
    }
    ok = True
    for name, (model, configured) in cases(FleetModel()).items():
        if name not in args.cases.split(","):
            continue
        section = {role: {"maxReplicas": DEFAULT_MAX_REPLICAS} for role in ("prefill", "decode")}
        if configured is not None:
            section["prefill"]["prefillTokensPerSecond"] = configured
        spec = AutoscalingSpec.from_spec(section)
        known = load_baselines(args.baselines, name) if args.baselines else None
        result = run_matrix(
            TraceConfig(),
            model,
            spec,
            kinds,
            range(args.seeds),
            jobs=args.jobs,
            tuning=tuning,
            baselines=known,
        )
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
                    "foresight_bound": c["foresight_bound"],
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
