"""The cost-bounded surge ceiling on each burst seed: what meeting >= 99%
TTFT and ITL costs against B* when no surge is seen before it begins.

Per seed, B*'s schedule is read from a matrix JSON (``--from``, no B*
search) and played again (its replayed replica-seconds are the ratio's
denominator); then the family of :mod:`pdfleet.operator.autoscaling_lab.cost_ceiling`
is searched for its cheapest member meeting both SLOs, every candidate
simulated. One process; the JSON is written after each seed, and a seed
already in ``--out`` is not run again.

    .venv/bin/python benchmarks/autoscaling_burst_cost_ceiling.py --seeds 0-9,100-109 \\
        --from benchmarks/results/autoscaling_matrix_gpu_burst.json \\
        --from benchmarks/results/autoscaling_matrix_gpu_heldout.json \\
        --out benchmarks/results/autoscaling_burst_cost_ceiling.json

``--blind 1``: every surge acted on only once one whole period of it was
measured (a section of its own in the same JSON).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from pdfleet.operator.autoscaling_lab.cost_ceiling import (
    MOST_HOLD,
    ROOMS_LATER,
    Shape,
    cheapest,
    family_schedule,
    paid,
)
from pdfleet.operator.autoscaling_lab.matrix import case_spec
from pdfleet.operator.autoscaling_lab.regimes import regime
from pdfleet.operator.autoscaling_lab.sim import COST_TARGETS, Cell, summary
from pdfleet.operator.autoscaling_lab.strategies import Sizing


def parse_seeds(text: str) -> list[int]:
    """``A-B`` ranges and single seeds, comma-separated."""
    out: list[int] = []
    for part in text.split(","):
        if "-" in part:
            a, b = (int(x) for x in part.split("-", 1))
            out.extend(range(a, b + 1))
        elif part.strip():
            out.append(int(part))
    return out


def stored_cells(paths: list[Path], reg: str) -> dict[int, dict[str, Any]]:
    cells: dict[int, dict[str, Any]] = {}
    for path in paths:
        for key, section in json.loads(path.read_text()).items():
            if not key.startswith(f"{reg}/"):
                continue
            for c in section["cells"]:
                if c["trace"] == "burst" and c["case"] == "default" and c["bstar"]["best"]:
                    cells.setdefault(c["seed"], c)
    return cells


def one(reg: str, seed: int, stored: dict[str, Any], blind: int) -> dict[str, Any]:
    started = time.perf_counter()
    spec = case_spec(regime(reg), "burst", seed, "default")
    cell = Cell(spec.trace, spec.model, spec.spec())
    best_b = stored["bstar"]["best"]
    sizing = Sizing(**best_b["sizing"])
    replay = summary(cell.schedule(best_b["schedule"]["prefill"], best_b["schedule"]["decode"]))
    bstar = float(replay["replica_seconds"]["total"])
    search = cheapest(cell, sizing, blind=blind)
    best = search.best
    limit = COST_TARGETS["burst"]
    out: dict[str, Any] = {
        "seed": seed,
        "bstar": {
            "sizing": best_b["sizing"],
            "replica_seconds_stored": best_b["replica_seconds"]["total"],
            "replica_seconds": bstar,
            "ttft_attainment": replay["ttft_attainment"],
            "itl_attainment": replay["itl_attainment"],
            "reproduces": abs(bstar - best_b["replica_seconds"]["total"]) < 1e-6 * bstar
            and replay["ttft_attainment"] == best_b["ttft_attainment"],
        },
        "tried": [{**t.to_dict(), "vs_bstar": t.replica_seconds / bstar} for t in search.tried],
        "best": None,
        "within_target": False,
    }
    if best is not None:
        shape = best.shape
        built = family_schedule(cell, sizing, shape)
        bare = family_schedule(cell, sizing, Shape(0.0, shape.room_later, shape.hold, shape.blind))
        period = cell.period
        # The count paid at the climb's last period, per surge.
        tops = {
            role: [
                built["schedule"][role][min(int(t // period) + blind + shape.hold, len(counts) - 1)]
                for t in built["onsets"]
            ]
            for role, counts in built["schedule"].items()
        }
        out["best"] = {
            **best.to_dict(schedule=True),
            "vs_bstar": best.replica_seconds / bstar,
            "onsets": built["onsets"],
            "base": built["base"],
            "room_fraction": built["room"],
            "before": built["before"],
            "climb_top": tops,
            # The most a smaller room before the first surge could save
            # (room 0 there, same schedule after it; paid replica-seconds).
            "first_room_saving_at_most": paid(built["schedule"], period)
            - paid(bare["schedule"], period),
        }
        out["within_target"] = best.replica_seconds / bstar <= limit
    out["wall_seconds"] = time.perf_counter() - started
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regime", default="gpu")
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--from", dest="source", type=Path, action="append", required=True)
    parser.add_argument(
        "--blind", type=int, default=0, help="periods after a surge's own before it is acted on"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    cells = stored_cells(args.source, args.regime)
    # One section per blind; a seed already in its section is not run again.
    whole: dict[str, Any] = json.loads(args.out.read_text()) if args.out.exists() else {}
    result: dict[str, Any] = whole.setdefault(
        f"blind_{args.blind}",
        {
            "regime": args.regime,
            "family": {
                "rooms_later": list(ROOMS_LATER),
                "most_hold": MOST_HOLD,
                "room_before_first": 1.0,
                "blind": args.blind,
            },
            "seeds": {},
        },
    )
    for seed in parse_seeds(args.seeds):
        if str(seed) in result["seeds"]:
            continue
        if seed not in cells:
            print(f"seed {seed}: no stored B*", flush=True)
            continue
        r = one(args.regime, seed, cells[seed], args.blind)
        result["seeds"][str(seed)] = r
        args.out.write_text(json.dumps(whole, indent=1) + "\n")
        b = r["best"]
        print(
            f"seed {seed}: {len(r['tried'])} runs, "
            + (
                f"best room_later {b['room_later']} hold {b['hold']}: "
                f"{b['vs_bstar']:.3f}x B*, TTFT {b['ttft_attainment']:.4f}, "
                f"ITL {b['itl_attainment']:.4f}"
                if b
                else "none met"
            )
            + f" ({r['wall_seconds']:.0f} s)",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
