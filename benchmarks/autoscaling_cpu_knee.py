"""Why the policy overspends in the CPU regime: three measurements.

1. **The prefill model against the simulator** at fixed counts: the
   simulated share of requests over the TTFT objective with ``c`` prefill
   replicas at a constant rate, beside :func:`.models.queue_miss_share` at
   the trace's own service-time mean and spread (budget: the objective less
   the policy's reserve), on the steady trace's prompts and on the
   heavytail mix (its rate held flat).
2. **Steady load held at 2 prefill and 1 decode replica**, per seed, beside
   B* (from the matrix JSON): the TTFT it attains, and how close B*'s cost
   is to it.
3. **The policy told the true rate**: its runs of every cell again with its
   forecast replaced by the trace's own rate function (the most needed over
   the lead, none of the rate's estimation noise), with and without the
   forecast's noise margin (``rate_z``) and the scale-down headroom,
   scored against the stored B* and tuned HPA. A measurement, not a
   policy: the replacement is patched in for the run.

    .venv/bin/python -P benchmarks/autoscaling_cpu_knee.py \\
        --from benchmarks/results/autoscaling_matrix_cpu.json \\
        --out benchmarks/results/autoscaling_cpu_knee.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

from pdfleet.operator.autoscaling import policy
from pdfleet.operator.autoscaling.models import queue_miss_share
from pdfleet.operator.autoscaling.policy import Forecast, PolicyTuning
from pdfleet.operator.autoscaling_lab.matrix import case_spec, score
from pdfleet.operator.autoscaling_lab.regimes import regime
from pdfleet.operator.autoscaling_lab.sim import Cell, summary
from pdfleet.operator.autoscaling_lab.traces import Trace

# (trace, prefill counts, rates): the counts and rates around the steady
# and heavytail cells' operating points (12 requests/s).
MODEL_CHECKS = (
    ("steady", (1,), (4.0, 5.0, 6.0)),
    ("steady", (2,), (12.0, 12.5, 13.0, 13.5)),
    ("steady", (3,), (18.0, 19.0, 20.0)),
    ("heavytail", (2,), (8.0, 9.0, 10.0, 12.0)),
    ("heavytail", (3,), (12.0, 14.0)),
)
VARIANTS: dict[str, tuple[str | None, dict[str, float]]] = {
    "policy": (None, {}),
    "true rate": ("margin", {}),
    "true rate, no noise margin": ("bare", {}),
    "true rate, no noise margin, no headroom": ("bare", {"scale_down_headroom": 0.0}),
}


def model_check(name: str) -> list[dict[str, Any]]:
    base = regime(name)
    budget = base.model.ttft_slo_seconds * (1 - PolicyTuning().ttft_reserve)
    rows = []
    for kind, counts, rates in MODEL_CHECKS:
        for c in counts:
            for rate in rates:
                spec = case_spec(base, kind, 0, "default")
                trace = dataclasses.replace(spec.trace, base_rate=rate, diurnal_amplitude=0.0)
                cell = Cell(trace, spec.model, spec.spec())
                run = summary(cell.fixed_peak(c, 20))
                service = [spec.model.prefill_seconds(p) for p in cell.trace.prompt_tokens]
                mean = sum(service) / len(service)
                scv = sum((s - mean) ** 2 for s in service) / len(service) / mean**2
                rows.append(
                    {
                        "trace": kind,
                        "prefill": c,
                        "rate": rate,
                        "utilization": rate * mean / c,
                        "scv": scv,
                        "simulated_miss": 1 - run["ttft_attainment"],
                        "modelled_miss": queue_miss_share(c, rate, mean, scv, budget),
                    }
                )
                print(
                    f"{kind:>9} c={c} {rate:5.1f}/s rho {rate * mean / c:.2f}: simulated "
                    f"{rows[-1]['simulated_miss']:.2%}, modelled {rows[-1]['modelled_miss']:.2%}",
                    flush=True,
                )
    return rows


def steady_held(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for c in result["cells"]:
        if c["trace"] != "steady" or c["case"] != "default":
            continue
        spec = case_spec(regime(result["regime"]["name"]), "steady", c["seed"], "default")
        run = summary(Cell(spec.trace, spec.model, spec.spec()).fixed_peak(2, 1))
        bstar = c["bstar"]["best"]
        rows.append(
            {
                "seed": c["seed"],
                "held_ttft": run["ttft_attainment"],
                "held_itl": run["itl_attainment"],
                "bstar_mean_replicas": bstar["mean_replicas"],
                "bstar_x_held": bstar["replica_seconds"]["total"] / run["replica_seconds"]["total"],
                "policy_x_bstar": c["targets"]["vs_bstar"]["value"],
            }
        )
        print(
            f"steady {c['seed']}: 2/1 held TTFT {run['ttft_attainment']:.2%}; B* costs "
            f"{rows[-1]['bstar_x_held']:.3f}x it",
            flush=True,
        )
    return rows


@contextmanager
def true_rate(trace: Trace, margin: bool) -> Iterator[None]:
    """The policy's forecast replaced by the trace's rate function: the rate
    now as the level, the most over the lead as what to size for (plus the
    noise margin where ``margin``)."""
    measured = policy.forecast

    def forecast(
        rates: policy.Series, now: float, lead: float, tuning: PolicyTuning
    ) -> Forecast | None:
        fitted = measured(rates, now, lead, tuning)
        if fitted is None:
            return None
        level = trace.rate(now)
        ahead = max(trace.rate(now + lead * i / 8) for i in range(9))
        extra = tuning.rate_z * math.sqrt(ahead / tuning.noise_horizon_seconds) if margin else 0.0
        rising = ahead > level * 1.001
        return Forecast(
            level,
            ahead + extra,
            ahead,
            lead,
            rising,
            f"true rate {level:.1f}",
            (ahead - level) / lead,
            fitted.falling,
        )

    with mock.patch.object(policy, "forecast", forecast):
        yield


def variants(result: dict[str, Any]) -> dict[str, Any]:
    name = result["regime"]["name"]
    out: dict[str, Any] = {}
    for label, (rate, tuning) in VARIANTS.items():
        scored = copy.deepcopy(result)
        scored["cells"] = [c for c in scored["cells"] if c["case"] == "default"]
        for c in scored["cells"]:
            spec = case_spec(regime(name), c["trace"], c["seed"], "default")
            cell = Cell(spec.trace, spec.model, spec.spec())
            if rate is None:
                run = cell.policy(PolicyTuning(**tuning))
            else:
                with true_rate(cell.trace, rate == "margin"):
                    run = cell.policy(PolicyTuning(**tuning))
            c["results"]["pdfleet"] = summary(run)
        score(scored)
        out[label] = per_trace(scored)
        for kind, row in out[label].items():
            print(
                f"{label}: {kind:>9} x B* {row['x_bstar']:.3f} ({row['x_bstar_min']:.3f}-"
                f"{row['x_bstar_max']:.3f}), SLOs on {row['slo_seeds']}/{row['seeds']}, "
                f"misses {row['misses']} {row['missed']}",
                flush=True,
            )
    return out


def per_trace(result: dict[str, Any]) -> dict[str, Any]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for c in result["cells"]:
        groups.setdefault(c["trace"], []).append(c)
    trace_misses = {
        t["trace"]: [k for k, v in t["targets"].items() if v.get("met") is False]
        for t in result["traces"]
    }
    out = {}
    for kind, cells in groups.items():
        ratios = [c["targets"]["vs_bstar"]["value"] for c in cells]
        missed: dict[str, int] = {}
        for c in cells:
            for key, target in c["targets"].items():
                if target["met"] is False:
                    missed[key] = missed.get(key, 0) + 1
        for key in trace_misses.get(kind, []):
            missed[f"trace:{key}"] = missed.get(f"trace:{key}", 0) + 1
        total = sum(c["results"]["pdfleet"]["replica_seconds"]["total"] for c in cells)
        bstar = sum(c["bstar"]["best"]["replica_seconds"]["total"] for c in cells)
        ttft = [c["results"]["pdfleet"]["ttft_attainment"] for c in cells]
        out[kind] = {
            "seeds": len(cells),
            "x_bstar": total / bstar,
            "x_bstar_min": min(ratios),
            "x_bstar_max": max(ratios),
            "slo_seeds": sum(
                1
                for c in cells
                if c["targets"]["ttft_attainment"]["met"] and c["targets"]["itl_attainment"]["met"]
            ),
            "ttft_min": min(ttft),
            "ttft_max": max(ttft),
            "misses": sum(missed.values()),
            "missed": missed,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    (result,) = json.loads(args.source.read_text()).values()
    out = {
        "source": str(args.source),
        "model_check": model_check(result["regime"]["name"]),
        "steady_held": steady_held(result),
        "variants": variants(result),
    }
    out["wall_seconds"] = time.perf_counter() - started
    if args.out:
        args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
