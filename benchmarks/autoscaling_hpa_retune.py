"""The tuned HPA of committed matrix JSONs, tuned again on more seeds.

The matrix tunes HPA per trace: the hottest targets on its grid that meet
>= 99% TTFT and ITL on every tuning seed (``matrix.tune_hpa``). The
committed GPU matrices were tuned on seed 0 alone, to save time; a tuning
that must hold on seeds 0-9 is cooler where a hot one misses some seed, so
dearer. This tunes HPA again on ``--tune-seeds`` for each trace of the given
matrix JSONs' regime, runs the tuned HPA on every default cell with its new
targets, and scores the cells again (:func:`.matrix.score`); B*, the policy
and untuned HPA stay as stored (the policy does not depend on HPA):

    .venv/bin/python -P benchmarks/autoscaling_hpa_retune.py \\
        --from benchmarks/results/autoscaling_matrix_gpu.json \\
               benchmarks/results/autoscaling_matrix_gpu_heldout.json \\
        --tune-seeds 0-9 --jobs 1 --suffix _hpa09

Each input's result goes beside it, its name with ``--suffix``. The HPA runs
go through the matrix's cache (``--cache``), so a rerun computes nothing new.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pdfleet.operator.autoscaling_lab.cache import default_directory
from pdfleet.operator.autoscaling_lab.matrix import _hpa_run, case_spec, score, tune_hpa
from pdfleet.operator.autoscaling_lab.regimes import regime
from pdfleet.operator.autoscaling_lab.sim_cmd import parse_seeds
from pdfleet.operator.autoscaling_lab.strategies import HPATargets


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="sources", type=Path, nargs="+", required=True)
    parser.add_argument("--tune-seeds", default="0-9")
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--cache", default=str(default_directory()))
    parser.add_argument("--suffix", default="_hpa_retuned")
    args = parser.parse_args()
    tune_seeds = parse_seeds(args.tune_seeds)
    loaded = [(path, json.loads(path.read_text())) for path in args.sources]
    regimes = {
        section["regime"]["name"]
        for _, data in loaded
        for section in data.values()
        if isinstance(section, dict) and "regime" in section
    }
    if len(regimes) != 1:
        print(f"the inputs must share one regime, got {sorted(regimes)}", file=sys.stderr)
        return 2
    base = regime(regimes.pop())
    kinds = sorted(
        {c["trace"] for _, data in loaded for section in data.values() for c in section["cells"]}
    )
    pool = ProcessPoolExecutor(max_workers=args.jobs) if args.jobs > 1 else None

    def runs(batch: list[tuple[Any, HPATargets]]) -> list[dict[str, Any]]:
        work = [(c, t, args.cache) for c, t in batch]
        return list(pool.map(_hpa_run, work)) if pool is not None else [_hpa_run(w) for w in work]

    started = time.perf_counter()
    try:
        tuned = {}
        for kind in kinds:
            tuned[kind] = tune_hpa(base, kind, tune_seeds, runs, batch=max(args.jobs, 2))
            print(f"{kind}: {tuned[kind]['targets']} (met {tuned[kind]['met']})", flush=True)
        for path, data in loaded:
            for section in data.values():
                cells = [c for c in section["cells"] if c["case"] == "default"]
                work = [
                    (
                        case_spec(base, c["trace"], c["seed"], "default"),
                        HPATargets(**tuned[c["trace"]]["targets"]),
                    )
                    for c in cells
                ]
                for c, result in zip(cells, runs(work), strict=True):
                    c["results"]["hpa_tuned"] = result
                    c["hpa_tuned_targets"] = tuned[c["trace"]]["targets"]
                section["hpa_tuning"] = {
                    k: v for k, v in tuned.items() if any(c["trace"] == k for c in cells)
                }
                section["tune_seeds"] = list(tune_seeds)
                score(section)
            out = path.with_name(path.stem + args.suffix + path.suffix)
            out.write_text(json.dumps(data, sort_keys=True) + "\n")
            print(f"wrote {out} ({time.perf_counter() - started:.0f} s)", flush=True)
    finally:
        if pool is not None:
            pool.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
