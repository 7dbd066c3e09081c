"""The autoscaling target matrix, both regimes, tuned and held-out seeds.

Runs ``pdfleet sim --matrix`` (:func:`run_matrix`) for each regime and each
seed range: every trace's cells against B* and HPA tuned per trace on seeds
0-9 (whatever range is evaluated), the robustness cases on burst and
diurnal, and writes one JSON (with B*'s schedules: the simulated schedules
every claim rests on) and the summary figure per regime.

    .venv/bin/python benchmarks/autoscaling_matrix.py --jobs 2 \\
        --out benchmarks/results/autoscaling_matrix.json --figures docs

On a shared machine, run one trace at a time (``--traces burst --out
burst.json``, ...) and merge them (``--merge burst.json steady.json ...
--out all.json --figures docs``): each run's JSON lands as it ends, and
the merge scores the cells again with this version's targets.

B* and the HPA runs come from the matrix's cache (~/.cache/pdfleet/sim by
default) when they were computed before: a first run on one core takes
hours (about fifteen simulations per cell), a rerun after a change to the
policy only minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pdfleet.operator.autoscaling_lab.cache import default_directory
from pdfleet.operator.autoscaling_lab.matrix import CASES, format_matrix, merge, run_matrix
from pdfleet.operator.autoscaling_lab.plot import plot_matrix
from pdfleet.operator.autoscaling_lab.replay import load_records
from pdfleet.operator.autoscaling_lab.sim_cmd import parse_seeds
from pdfleet.operator.autoscaling_lab.traces import TRACE_KINDS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regimes", default="gpu,cpu")
    parser.add_argument("--seeds", default="0-9;100-109", help="seed ranges, ';'-separated")
    parser.add_argument("--tune-seeds", default="0-9")
    parser.add_argument("--traces", default=",".join(TRACE_KINDS))
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--cache", default=str(default_directory()))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--reuse",
        type=Path,
        nargs="+",
        default=None,
        help="matrix JSONs of an earlier run: where the cache has no B* for a cell, replay its "
        "B* from these (the winner, its fewest-events schedule and the nearest miss simulated "
        "again) and keep it only if every figure comes out identical, else search again",
    )
    parser.add_argument("--figures", type=Path, default=None, help="directory for the PNGs")
    parser.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="instead of running: merge these outputs (runs of one regime over different traces "
        "or seeds; one result per regime), score them again with this version's targets and "
        "print them",
    )
    args = parser.parse_args(argv)
    out: dict[str, object] = {}
    ok = True
    if args.merge:
        runs: dict[str, list[dict[str, Any]]] = {}
        for path in args.merge:
            for key, result in json.loads(path.read_text()).items():
                runs.setdefault(key.split("/")[0], []).append(result)
        for name, results in runs.items():
            merged = merge(results)
            seeds = merged["seeds"]
            span = (
                f"{seeds[0]}-{seeds[-1]}" if seeds == list(range(seeds[0], seeds[-1] + 1)) else None
            )
            key = f"{name}/{span or ','.join(map(str, seeds))}"
            print(f"== {key} (merged from {len(results)})")
            print(format_matrix(merged), flush=True)
            ok = ok and not merged["unproven_misses"]
            out[key] = merged
            if args.figures is not None:
                suffix = (span or "merged").replace("-", "_")
                plot_matrix(merged, str(args.figures / f"autoscaling_matrix_{name}_{suffix}.png"))
        if args.out:
            args.out.write_text(json.dumps(out, sort_keys=True) + "\n")
            print(f"wrote {args.out}")
        return 0 if ok else 1
    for name in filter(None, args.regimes.split(",")):
        for seeds in filter(None, args.seeds.split(";")):
            result = run_matrix(
                name,
                [k for k in args.traces.split(",") if k],
                parse_seeds(seeds),
                parse_seeds(args.tune_seeds),
                [c for c in args.cases.split(",") if c],
                jobs=args.jobs,
                cache=args.cache,
                prior=load_records(args.reuse) if args.reuse else None,
                log=lambda line: print(line, file=sys.stderr, flush=True),
            )
            print(f"== {name}, seeds {seeds}")
            print(format_matrix(result), flush=True)
            ok = ok and not result["unproven_misses"]
            out[f"{name}/{seeds}"] = result
            if args.figures is not None:
                suffix = seeds.replace("-", "_")
                plot_matrix(result, str(args.figures / f"autoscaling_matrix_{name}_{suffix}.png"))
    if args.out:
        args.out.write_text(json.dumps(out, sort_keys=True) + "\n")
        print(f"wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
