"""The policy with changed tuning against B*, per seed: attainment, cost, events.

Runs only the policy (B* is read from a matrix JSON, where the matrix has
computed or replayed it with the same simulator), so a variant of the
policy's constants is measured in one simulation per seed:

    .venv/bin/python benchmarks/autoscaling_variants.py --trace burst --seeds 0-9 \\
        --from benchmarks/results/autoscaling_matrix_gpu.json \\
        --variant current= --variant 'z2={"rise_z": 2.0}' --out variants.json

Each variant is ``name=JSON`` of :class:`PolicyTuning` fields (empty: the
defaults). The table prints TTFT / ITL attainment, replica-seconds over
B*'s, scale events per role and reversals within 10 minutes.
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pdfleet.operator.autoscaling.policy import PolicyTuning
from pdfleet.operator.autoscaling_lab.matrix import case_spec
from pdfleet.operator.autoscaling_lab.regimes import regime
from pdfleet.operator.autoscaling_lab.sim import FLAP_WINDOW_SECONDS, Cell, PolicyStrategy, summary
from pdfleet.operator.autoscaling_lab.sim_cmd import parse_seeds
from pdfleet.operator.autoscaling_lab.sim_fleet import Simulation


def _run(job: tuple[str, str, int, str, dict[str, Any]]) -> dict[str, Any]:
    name, kind, seed, regime_name, overrides = job
    spec = case_spec(regime(regime_name), kind, seed, "default")
    cell = Cell(spec.trace, spec.model, spec.spec())
    sim = Simulation(
        cell.trace,
        cell.model,
        cell.spec,
        PolicyStrategy(cell.spec, PolicyTuning(**overrides)),
        cell.start,
        spec.trace.seed,
    )
    result = sim.run()
    out = summary(result)
    out["flips"] = result.oscillations(FLAP_WINDOW_SECONDS)["total"]
    # TTFT misses by the surge they arrived in (from one onset to the next;
    # index 0: before the first), as shares of all requests.
    onsets = [b.start for b in cell.trace.bursts]
    missed = [0] * (len(onsets) + 1)
    for req in sim.requests:
        late = req.first < 0 or req.first - req.arrival > cell.model.ttft_slo_seconds
        if late:
            missed[bisect.bisect_right(onsets, req.arrival)] += 1
    out["ttft_misses_by_surge"] = [m / max(len(sim.requests), 1) for m in missed]
    return {"variant": name, "seed": seed, **out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regime", default="gpu")
    parser.add_argument("--trace", default="burst")
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--from", dest="source", type=Path, required=True)
    parser.add_argument("--variant", action="append", default=[])
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    data = json.loads(args.source.read_text())
    bstar = {
        c["seed"]: c["bstar"]["best"]["replica_seconds"]["total"]
        for result in data.values()
        for c in result["cells"]
        if c["trace"] == args.trace and c["case"] == "default" and c["bstar"]["best"]
    }
    variants = {}
    for text in args.variant or ["current="]:
        name, _, overrides = text.partition("=")
        variants[name] = json.loads(overrides) if overrides else {}
    seeds = [s for s in parse_seeds(args.seeds) if s in bstar]
    jobs = [(n, args.trace, s, args.regime, o) for n, o in variants.items() for s in seeds]
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(_run, jobs))
    for r in rows:
        r["vs_bstar"] = r["replica_seconds"]["total"] / bstar[r["seed"]]
    print(
        f"{args.trace}: variant, seed, TTFT, ITL, cost x B*, events p/d, reversals, "
        "TTFT misses by surge (before the first, then from each onset)"
    )
    for r in rows:
        print(
            f"{r['variant']:>12} {r['seed']:>4} {r['ttft_attainment']:.2%} "
            f"{r['itl_attainment']:.2%} {r['vs_bstar']:.3f} "
            f"{r['scale_events']['prefill']}/{r['scale_events']['decode']} {r['flips']} "
            f"misses by surge {' '.join(f'{m:.2%}' for m in r['ttft_misses_by_surge'])}",
            flush=True,
        )
    for name in variants:
        mine = [r for r in rows if r["variant"] == name]
        total = sum(r["replica_seconds"]["total"] for r in mine) / sum(
            bstar[r["seed"]] for r in mine
        )
        met = sum(r["ttft_attainment"] >= 0.99 and r["itl_attainment"] >= 0.99 for r in mine)
        print(
            f"{name}: TTFT {min(r['ttft_attainment'] for r in mine):.2%}-"
            f"{max(r['ttft_attainment'] for r in mine):.2%}, ITL min "
            f"{min(r['itl_attainment'] for r in mine):.2%}, sum x B* {total:.3f}, worst "
            f"{max(r['vs_bstar'] for r in mine):.3f}, SLOs met on {met}/{len(mine)}"
        )
    if args.out:
        args.out.write_text(
            json.dumps({"trace": args.trace, "variants": variants, "rows": rows}) + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
