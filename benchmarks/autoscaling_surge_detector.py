"""The surge detector's false alarms on steady load and its delay on burst surges.

No simulation: the policy's forecast phases read per-period arrival rates,
so this feeds them the rates a fleet would measure (each period's arrivals
over its length), period by period, with the level window the policy keeps:

* steady: ``--hours`` seeded hours of Poisson arrivals at the regime's base
  rate; per hour, whether :func:`.policy.detect_surge` fires in any period
  (and how many separate firings), and the same for
  :func:`.policy.forecast`'s rise (the committed rise test);
* burst: each seed's trace (the matrix's, drawn again): per surge, the
  seconds from its onset to the first period at which the detector fires
  and at which the forecast reads a rise, and the ramp's slope the
  detector fitted then against the trace's own;
* ``--grid``: the same false alarms and first-surge delays for other CUSUM
  settings (reference and threshold), the forecast's rise as committed.

    .venv/bin/python -P benchmarks/autoscaling_surge_detector.py \\
        --seeds 0-9,100-101 --hours 100 --grid 0.5:1.5,0.5:2.5,1:2,1:2.5,1.5:2.5,1.5:3,2:2.5 \\
        --out benchmarks/results/autoscaling_surge_detector_gpu.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any

from pdfleet.operator.autoscaling.policy import PolicyTuning, detect_surge, forecast
from pdfleet.operator.autoscaling_lab.regimes import regime
from pdfleet.operator.autoscaling_lab.sim_cmd import parse_seeds
from pdfleet.operator.autoscaling_lab.traces import make_trace

LEAD = 90.0  # the GPU regime's lead: a 60 s startup and two 15 s periods


def _rates(arrivals: list[float], period: float, duration: float) -> list[tuple[float, float]]:
    counts = [0] * int(duration // period)
    for a in arrivals:
        k = int(a // period)
        if k < len(counts):
            counts[k] += 1
    return [((k + 1) * period, c / period) for k, c in enumerate(counts)]


def _walk(rates: list[tuple[float, float]], tuning: PolicyTuning) -> list[dict[str, Any]]:
    """Per period: what the detector and the forecast say, with the level
    window the policy keeps."""
    out = []
    for i, (now, _) in enumerate(rates):
        window = tuple(p for p in rates[: i + 1] if now - p[0] < tuning.level_window_seconds)
        surge = detect_surge(window, now, tuning)
        f = forecast(window, now, LEAD, tuning)
        out.append(
            {
                "time": now,
                "surge": None if surge is None else dataclasses.asdict(surge),
                "rise": bool(f and f.rising),
            }
        )
    return out


def _alarms(rates: list[tuple[float, float]], tuning: PolicyTuning) -> list[float]:
    """The periods at which the detector fires."""
    out = []
    for i, (now, _) in enumerate(rates):
        window = tuple(p for p in rates[: i + 1] if now - p[0] < tuning.level_window_seconds)
        if detect_surge(window, now, tuning) is not None:
            out.append(now)
    return out


def _episodes(times: list[float], period: float) -> int:
    return sum(1 for j, t in enumerate(times) if j == 0 or t - times[j - 1] > period + 1e-9)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regime", default="gpu")
    parser.add_argument(
        "--seeds",
        default="0-9",
        help="burst seeds: FIRST-LAST or a list, ranges and seeds by commas",
    )
    parser.add_argument("--hours", type=int, default=100, help="seeded steady hours")
    parser.add_argument("--period", type=float, default=15.0)
    parser.add_argument(
        "--grid",
        default="",
        help="CUSUM settings to sweep, 'reference:threshold' by commas (z units)",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    tuning = PolicyTuning()
    base = regime(args.regime).trace
    rate, period = base.base_rate, args.period
    steady = []
    steady_rates: list[list[tuple[float, float]]] = []
    for hour in range(args.hours):
        rng = random.Random(hour)
        arrivals, t = [], 0.0
        while True:
            t += rng.expovariate(rate)
            if t >= 3600.0:
                break
            arrivals.append(t)
        series = _rates(arrivals, period, 3600.0)
        steady_rates.append(series)
        walk = _walk(series, tuning)
        fired = [w["time"] for w in walk if w["surge"] is not None]
        rose = [w["time"] for w in walk if w["rise"]]
        steady.append(
            {
                "hour": hour,
                "surge_periods": len(fired),
                "surge_episodes": _episodes(fired, period),
                "surge_first": fired[0] if fired else None,
                "surge_slopes": [w["surge"]["slope"] for w in walk if w["surge"] is not None],
                "rise_periods": len(rose),
                "rise_episodes": _episodes(rose, period),
            }
        )
    hours = len(steady)
    summary = {
        "hours": hours,
        "surge_hours": sum(1 for s in steady if s["surge_periods"]),
        "surge_episodes": sum(s["surge_episodes"] for s in steady),
        "rise_hours": sum(1 for s in steady if s["rise_periods"]),
        "rise_episodes": sum(s["rise_episodes"] for s in steady),
    }
    print(
        f"steady ({hours} hours at {rate:g} requests/s, {period:g} s periods): the detector fires "
        f"in {summary['surge_hours']} hours ({summary['surge_episodes']} firings); the forecast "
        f"reads a rise in {summary['rise_hours']} ({summary['rise_episodes']})"
    )
    burst = []
    burst_rates: list[tuple[list[tuple[float, float]], float]] = []
    seeds = [seed for part in args.seeds.split(",") for seed in parse_seeds(part)]
    for seed in seeds:
        trace = make_trace(dataclasses.replace(base, kind="burst", seed=seed))
        series = _rates(trace.arrivals, period, trace.config.duration_seconds)
        burst_rates.append((series, trace.bursts[0].start))
        walk = _walk(series, tuning)
        surges = []
        for b in trace.bursts:
            after = [w for w in walk if b.start - period < w["time"] <= b.start + b.ramp]
            first = next((w for w in after if w["surge"] is not None), None)
            rise = next((w for w in after if w["rise"]), None)
            surges.append(
                {
                    "onset": b.start,
                    "slope": rate * (b.factor - 1) / b.ramp,
                    "surge_delay": None if first is None else first["time"] - b.start,
                    "surge_fit": None if first is None else first["surge"],
                    "rise_delay": None if rise is None else rise["time"] - b.start,
                }
            )
        burst.append({"seed": seed, "surges": surges})

        def delay(x: float | None) -> str:
            return "-" if x is None else f"+{x:.1f} s"

        for i, s in enumerate(surges):
            fit = s["surge_fit"]
            print(
                f"burst {seed} surge {i + 1} at {s['onset']:.1f} s (slope {s['slope']:.2f}): "
                f"detector {delay(s['surge_delay'])}"
                + (f" (fitted slope {fit['slope']:.2f})" if fit else "")
                + f", forecast's rise {delay(s['rise_delay'])}"
            )
    every = [s for b in burst for s in b["surges"]]
    both = [s for s in every if s["surge_delay"] is not None and s["rise_delay"] is not None]
    summary["burst_surges"] = len(every)
    summary["detector_earlier"] = sum(1 for s in both if s["surge_delay"] < s["rise_delay"] - 1e-6)
    summary["detector_later"] = sum(1 for s in both if s["surge_delay"] > s["rise_delay"] + 1e-6)
    print(
        f"burst: of {len(every)} surges the detector fires before the forecast's rise on "
        f"{summary['detector_earlier']}, after it on {summary['detector_later']}"
    )
    grid = []
    for setting in (x for x in args.grid.split(",") if x):
        k, h = (float(v) for v in setting.split(":"))
        swept = dataclasses.replace(tuning, surge_reference_z=k, surge_threshold_z=h)
        alarms = [_alarms(series, swept) for series in steady_rates]
        delays, earliest = [], []
        for (series, onset), b in zip(burst_rates, burst, strict=True):
            first = next((t for t in _alarms(series, swept) if t > onset - period), None)
            rise = b["surges"][0]["rise_delay"]
            delays.append(None if first is None else first - onset)
            both = [x for x in (delays[-1], rise) if x is not None]
            earliest.append(min(both) if both else None)
        row = {
            "reference_z": k,
            "threshold_z": h,
            "steady_hours": sum(1 for a in alarms if a),
            "steady_firings": sum(_episodes(a, period) for a in alarms),
            "first_surge_delay": delays,
            "first_surge_earliest_with_rise": earliest,
        }
        grid.append(row)
        print(
            f"k {k:g}, h {h:g}: fires in {row['steady_hours']} steady hours "
            f"({row['steady_firings']} firings); first surge, earliest of it and the rise: "
            + " ".join("-" if x is None else f"{x:.1f}" for x in earliest),
            flush=True,
        )
    if args.out:
        result = {
            "regime": args.regime,
            "period": period,
            "tuning": dataclasses.asdict(tuning),
            "steady_summary": summary,
            "steady": steady,
            "burst": burst,
            "grid": grid,
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
