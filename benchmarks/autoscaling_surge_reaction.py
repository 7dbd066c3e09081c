"""How early and how far schedules react to a burst trace's first surge.

Per burst seed of a regime: the first surge's onset; when B* (foresight)
starts adding replicas and how many it runs a minute after the onset; the
same for the policy (what it first saw of the surge, and when it acted);
the arrival rate of the first whole period of the surge against the rate
before it, in standard deviations of one period's Poisson noise (how well a
causal policy can tell the surge from noise then); and the first-surge
ceiling's TTFT / ITL attainment when it climbs from the first period a
policy could act in (blind 0, the matrix's proof) and when it waits for one
or two whole periods of the surge to be measured (blind 1, 2: not proofs,
the cost of needing evidence before reacting).

B*'s sizing comes from a matrix result (``--from``, the JSON of
``benchmarks/autoscaling_matrix.py``: no B* search) or from the matrix's
cache; the ceiling of blind 0 repeats the matrix's own and checks that the
stored figures still reproduce.

    .venv/bin/python benchmarks/autoscaling_surge_reaction.py --seeds 0-9 \\
        --from benchmarks/results/autoscaling_matrix_gpu.json \\
        --out benchmarks/results/autoscaling_surge_reaction_gpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from pdfleet.operator.autoscaling_lab.cache import Cache, default_directory
from pdfleet.operator.autoscaling_lab.ceiling import first_surge_ceiling
from pdfleet.operator.autoscaling_lab.matrix import case_spec
from pdfleet.operator.autoscaling_lab.regimes import regime
from pdfleet.operator.autoscaling_lab.sim import Cell, summary
from pdfleet.operator.autoscaling_lab.sim_cmd import parse_seeds
from pdfleet.operator.autoscaling_lab.strategies import Sizing

BLIND = (0, 1, 2)


def _first_rise(times: list[float], counts: list[int], after: float) -> tuple[float, int] | None:
    """(time, count) of the first period from ``after - 120 s`` on at which a
    schedule's count rose by more than one replica (a step up, not noise)."""
    for i in range(1, len(counts)):
        if times[i] >= after - 120 and counts[i] > counts[i - 1] + 1:
            return times[i], counts[i]
    return None


def _at(times: list[float], counts: list[int], t: float) -> int:
    """The count of the period holding time ``t``."""
    best = counts[0]
    for x, c in zip(times, counts, strict=True):
        if x <= t:
            best = c
    return best


def one(args: tuple[str, int, dict[str, Any] | None, str | None]) -> dict[str, Any]:
    name, seed, stored, cache_dir = args
    spec = case_spec(regime(name), "burst", seed, "default")
    cell = Cell(spec.trace, spec.model, spec.spec())
    if stored is None:
        found = Cache(cache_dir).get_or_compute("bstar", spec.key, lambda: cell.bstar().to_dict())
    else:
        found = stored["bstar"]
    best = found["best"]
    sizing = Sizing(**best["sizing"])
    onset = cell.trace.bursts[0].start
    period = cell.period
    # The rate of the surge's first whole period against the rate before it.
    first_full = (math.floor(onset / period) + 1) * period
    before = [t for t in cell.trace.arrivals if first_full - 15 * period <= t < onset]
    base = len(before) / (onset - (first_full - 15 * period))
    seen = sum(1 for t in cell.trace.arrivals if first_full <= t < first_full + period) / period
    noise = math.sqrt(base / period)
    policy = cell.policy()
    times = [t for t, *_ in policy.timeline]
    out: dict[str, Any] = {
        "seed": seed,
        "onset": onset,
        "bstar_sizing": best["sizing"],
        "first_full_period": {
            "start": first_full,
            "rate": seen,
            "rate_before": base,
            "z": (seen - base) / noise,
        },
        "policy": {
            "ttft_attainment": policy.ttft_attainment,
            "itl_attainment": policy.itl_attainment,
        },
        "bstar": {},
        "ceiling": [],
    }
    schedule = best["schedule"]
    for i, role in enumerate(("prefill", "decode")):
        counts = [row[1 + i] for row in policy.timeline]
        rise = _first_rise(times, counts, onset)
        b_counts = schedule[role]
        b_times = [k * period for k in range(len(b_counts))]
        b_rise = _first_rise(b_times, b_counts, onset)
        out["policy"][role] = {
            "before": _at(times, counts, onset),
            "first_step_up": None if rise is None else {"time": rise[0], "to": rise[1]},
            "at_onset_plus_60": _at(times, counts, onset + 60),
            "at_onset_plus_120": _at(times, counts, onset + 120),
        }
        out["bstar"][role] = {
            "before": _at(b_times, b_counts, onset - 120),
            "first_step_up": None if b_rise is None else {"time": b_rise[0], "to": b_rise[1]},
            "at_onset_plus_60": _at(b_times, b_counts, onset + 60),
            "at_onset_plus_120": _at(b_times, b_counts, onset + 120),
        }
    for blind in BLIND:
        c = first_surge_ceiling(cell, sizing, blind)
        if c is None:
            continue
        c.pop("schedule")
        out["ceiling"].append(c)
    if stored is not None and stored.get("first_surge_ceiling") and out["ceiling"]:
        was = stored["first_surge_ceiling"]["ttft_attainment"]
        out["ceiling_blind0_reproduces"] = abs(out["ceiling"][0]["ttft_attainment"] - was) < 1e-12
    out["policy_result"] = summary(policy)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regime", default="gpu")
    parser.add_argument("--seeds", default="0-9")
    parser.add_argument("--from", dest="source", type=Path, action="append", default=[])
    parser.add_argument("--cache", default=str(default_directory()))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    stored: dict[int, dict[str, Any]] = {}
    for path in args.source:
        for block in json.loads(path.read_text()).values():
            for c in block.get("cells", []):
                if c["trace"] == "burst" and c["case"] == "default":
                    stored[c["seed"]] = c
    work = [(args.regime, s, stored.get(s), args.cache) for s in parse_seeds(args.seeds)]
    with ProcessPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        rows = list(pool.map(one, work))
    print(
        "seed  onset  z(1st period)  B* up (s vs onset, to)  policy up  "
        "policy TTFT/ITL  ceiling TTFT blind 0 / 1 / 2"
    )
    for r in rows:
        b, p = r["bstar"]["prefill"], r["policy"]["prefill"]
        bu = b["first_step_up"] or {"time": math.nan, "to": 0}
        pu = p["first_step_up"] or {"time": math.nan, "to": 0}
        ceil = " / ".join(f"{c['ttft_attainment'] * 100:.2f}%" for c in r["ceiling"])
        print(
            f"{r['seed']:4d} {r['onset']:6.0f} {r['first_full_period']['z']:8.1f}"
            f"   {bu['time'] - r['onset']:+5.0f} s {b['before']}->{bu['to']}"
            f"   {pu['time'] - r['onset']:+5.0f} s {p['before']}->{pu['to']}"
            f"   {r['policy']['ttft_attainment'] * 100:.2f}%/{r['policy']['itl_attainment'] * 100:.2f}%"
            f"   {ceil}"
        )
    met = {
        blind: sum(
            1
            for r in rows
            for c in r["ceiling"]
            if c["blind_periods"] == blind and c["ttft_attainment"] >= 0.99
        )
        for blind in BLIND
    }
    print(
        f"ceiling >= 99% TTFT: {', '.join(f'blind {k}: {v}/{len(rows)}' for k, v in met.items())}"
    )
    zs = [r["first_full_period"]["z"] for r in rows]
    print(
        f"first whole period of the surge: z median {statistics.median(zs):.1f}, min {min(zs):.1f}"
    )
    if args.out:
        args.out.write_text(json.dumps({"regime": args.regime, "seeds": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
