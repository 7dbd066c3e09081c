"""The policy's columns of committed matrix JSONs, run again with this code.

After a change to the policy only, B* and the HPA runs of a matrix need not
be computed again: this runs the policy alone on every default cell of the
given matrix JSONs (one simulation a cell; ``--cases`` adds the robustness
cases), puts its run in place of the stored one, scores the cells again
(:func:`.matrix.score`) and writes a matrix JSON of the same shape. With ``--compare``, it also writes each
cell's targets before (the ``--from`` JSONs' policy) and after, side by side:

    .venv/bin/python -P benchmarks/autoscaling_policy_rerun.py \\
        --from benchmarks/results/autoscaling_matrix_gpu.json \\
        --traces steady,diurnal --jobs 2 --out rerun.json

B*, the HPA runs and the first-surge ceiling are taken as stored: valid
only while the simulator's code is the one they were made with (the
matrix's ``--reuse`` checks that by replaying; this does not).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pdfleet.operator.autoscaling.policy import PolicyTuning
from pdfleet.operator.autoscaling_lab.matrix import case_spec, score
from pdfleet.operator.autoscaling_lab.regimes import regime
from pdfleet.operator.autoscaling_lab.sim import Cell, summary


def _run(job: tuple[str, str, int, str]) -> dict[str, Any]:
    name, kind, seed, case = job
    spec = case_spec(regime(name), kind, seed, case)
    started = time.perf_counter()
    out = summary(Cell(spec.trace, spec.model, spec.spec()).policy())
    out["wall_seconds"] = time.perf_counter() - started
    return out


def _row(cell: dict[str, Any]) -> dict[str, Any]:
    t = cell["targets"]
    # A robustness case's cell is scored on the SLOs and cost only.
    events = t.get("events", {"policy": {}, "fewest": {}})
    return {
        "ttft": t["ttft_attainment"]["value"],
        "itl": t["itl_attainment"]["value"],
        "x_bstar": t["vs_bstar"]["value"],
        "cost_limit": t["vs_bstar"]["limit"],
        "events": events["policy"],
        "fewest_events": events["fewest"],
        "reversals": t.get("no_flap", {}).get("value"),
        "x_hpa_tuned": t.get("vs_hpa_tuned", {}).get("value"),
        "missed": sorted(k for k, v in t.items() if v["met"] is False),
    }


def _events(events: dict[str, int]) -> str:
    return f"{events['prefill']}/{events['decode']}" if events else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="sources", type=Path, nargs="+", required=True)
    parser.add_argument("--traces", default="burst,diurnal,steady,heavytail")
    parser.add_argument(
        "--cases",
        default="default",
        help="the cases to run, ','-separated (default, or the robustness cases of matrix.CASES)",
    )
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="the matrix JSON, rerun")
    parser.add_argument(
        "--compare", type=Path, default=None, help="per cell: targets before and after"
    )
    args = parser.parse_args(argv)
    kinds = [k for k in args.traces.split(",") if k]
    cases = [c for c in args.cases.split(",") if c]
    out: dict[str, Any] = {}
    rows = []
    with ProcessPoolExecutor(args.jobs) as pool:
        for source in args.sources:
            for key, result in json.loads(source.read_text()).items():
                name = key.split("/")[0]
                before = copy.deepcopy(result)
                result["cells"] = [
                    c for c in result["cells"] if c["case"] in cases and c["trace"] in kinds
                ]
                if not result["cells"]:
                    continue
                jobs = [(name, c["trace"], c["seed"], c["case"]) for c in result["cells"]]
                for cell, run in zip(result["cells"], pool.map(_run, jobs), strict=True):
                    cell["results"]["pdfleet"] = run
                result["tuning"] = dataclasses.asdict(PolicyTuning())
                score(result)
                out[key] = result
                old = {(c["case"], c["trace"], c["seed"]): c for c in before["cells"]}
                for cell in result["cells"]:
                    was = _row(old[cell["case"], cell["trace"], cell["seed"]])
                    now = _row(cell)
                    rows.append(
                        {
                            "case": cell["case"],
                            "trace": cell["trace"],
                            "seed": cell["seed"],
                            "before": was,
                            "after": now,
                        }
                    )
                    changed = "" if was == now else " *"
                    case = "" if cell["case"] == "default" else f" {cell['case']}"
                    print(
                        f"{name} {cell['trace']:>9} {cell['seed']:>3}{case}: "
                        f"TTFT {was['ttft']:.2%} -> {now['ttft']:.2%}, ITL {was['itl']:.2%} -> "
                        f"{now['itl']:.2%}, x B* {was['x_bstar']:.3f} -> {now['x_bstar']:.3f}, "
                        f"events {_events(was['events'])} -> {_events(now['events'])} "
                        f"(fewest {_events(now['fewest_events'])}), "
                        f"reversals {was['reversals']} -> {now['reversals']}, missed "
                        f"{','.join(was['missed']) or '-'} -> {','.join(now['missed']) or '-'}{changed}",
                        flush=True,
                    )
    if args.out:
        args.out.write_text(json.dumps(out, sort_keys=True) + "\n")
    if args.compare:
        args.compare.write_text(json.dumps({"cells": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
