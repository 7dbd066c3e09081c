"""The target matrix: every strategy over seeds x traces, targets per cell.

``pdfleet sim --matrix`` (and ``benchmarks/autoscaling_matrix.py``) run
:func:`run_matrix`: for each trace kind and each seed, the four strategies on
the same trace, and the policy's targets checked against that seed's own
baselines (:func:`cell_targets`), so that no seed is averaged away.
:func:`format_matrix` prints one row per trace and target with the seeds that
met it and the worst value.

Targets (docs/autoscaling.md): TTFT and ITL attainment >= 99%; replica-seconds
<= 1.25x the oracle's and, where the trace varies, <= 0.7x fixed peak; fewer
scale events than the HPA-style baseline; on steady load, no scale-up undone
within one stabilization window (or the reverse).

Where the load varies, each cell also carries the perfect-foresight bound of
:mod:`.bounds`: the fewest replica-seconds any schedule at the oracle's
sizing needs, with any number of scale events and with fewer than HPA's. A
target missed where meeting it would cost another one that is met (fewer
events than HPA only above 0.7x fixed peak, or the reverse) is marked
``traded`` (docs/autoscaling.md, "What any schedule could do").
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

from pdfleet.operator.autoscaling.policy import PolicyTuning
from pdfleet.operator.autoscaling.spec import AutoscalingSpec

from .bounds import ForesightBound, foresight_bound
from .sim import compare, replica_needs
from .sim_fleet import FleetModel, SimResult
from .traces import TRACE_KINDS, TraceConfig, TraceKind, make_trace


@dataclass(frozen=True)
class MatrixTargets:
    min_attainment: float = 0.99
    max_oracle_ratio: float = 1.25
    max_fixed_ratio: float = 0.7


TARGET_NAMES = (
    "ttft_attainment",
    "itl_attainment",
    "vs_oracle",
    "vs_fixed_peak",
    "events_vs_hpa",
    "oscillations",
)


def cell_targets(
    kind: str,
    results: dict[str, SimResult],
    window: float,
    targets: MatrixTargets,
    bound: ForesightBound | None = None,
) -> dict[str, dict[str, Any]]:
    """Each target of one (trace, seed): ``value``, ``met`` (None where it does
    not apply: fixed peak on steady load, oscillation off steady load), and,
    where 0.7x fixed peak is missed and the oracle's own replica-seconds are
    above it too, ``oracle_misses`` (the oracle's ratio): meeting it there
    would take fewer replicas than the oracle provisions for the load.

    ``bound`` (:func:`.bounds.foresight_bound` with fewer events than HPA's,
    within the spec's steps): where no such schedule stays within the
    fixed-peak target, the one of the two targets that is missed while the
    other is met gets ``traded`` (that schedule's ratio to fixed peak): no
    schedule the spec allows meets both."""
    ours = results["pdfleet"]
    rs = ours.replica_seconds["total"]
    out: dict[str, dict[str, Any]] = {
        "ttft_attainment": {
            "value": ours.ttft_attainment,
            "met": ours.ttft_attainment >= targets.min_attainment,
        },
        "itl_attainment": {
            "value": ours.itl_attainment,
            "met": ours.itl_attainment >= targets.min_attainment,
        },
    }
    if "oracle" in results:
        ratio = rs / max(results["oracle"].replica_seconds["total"], 1e-9)
        out["vs_oracle"] = {"value": ratio, "met": ratio <= targets.max_oracle_ratio}
    if "fixed" in results:
        fixed = max(results["fixed"].replica_seconds["total"], 1e-9)
        ratio = rs / fixed
        out["vs_fixed_peak"] = {
            "value": ratio,
            "met": None if kind == "steady" else ratio <= targets.max_fixed_ratio,
        }
        if "oracle" in results and out["vs_fixed_peak"]["met"] is False:
            floor = results["oracle"].replica_seconds["total"] / fixed
            if floor > targets.max_fixed_ratio:
                out["vs_fixed_peak"]["oracle_misses"] = floor
    if "hpa" in results:
        ours_events = ours.scale_events["total"]
        theirs = results["hpa"].scale_events["total"]
        # On steady load both may settle and never scale: a tie at zero is met.
        met = ours_events < theirs or ours_events == theirs == 0
        out["events_vs_hpa"] = {"value": ours_events - theirs, "met": met}
    fixed_cell, events_cell = out.get("vs_fixed_peak"), out.get("events_vs_hpa")
    if bound is not None and fixed_cell and events_cell and fixed_cell["met"] is not None:
        joint = bound.fewer_events / max(results["fixed"].replica_seconds["total"], 1e-9)
        if joint > targets.max_fixed_ratio:
            if fixed_cell["met"] and not events_cell["met"]:
                events_cell["traded"] = joint
            elif events_cell["met"] and not fixed_cell["met"]:
                fixed_cell["traded"] = joint
    flips = ours.oscillations(window)["total"]
    out["oscillations"] = {"value": flips, "met": flips == 0 if kind == "steady" else None}
    return out


# A baseline's figures from an earlier run of the same cell: the totals of
# ``replica_seconds`` and ``scale_events`` that the targets compare against.
Baseline = dict[str, float]


def _cell(
    args: tuple[
        TraceConfig,
        FleetModel,
        AutoscalingSpec,
        tuple[str, ...],
        MatrixTargets,
        PolicyTuning | None,
        dict[str, Baseline],
    ],
) -> dict[str, Any]:
    config, model, spec, strategies, targets, tuning, known = args
    started = time.perf_counter()
    trace = make_trace(config)
    simulated = tuple(s for s in strategies if s != "fixed" and s not in known)
    results = compare(trace, model, spec, simulated, tuning=tuning, seed=config.seed)
    for name, figures in known.items():
        # The baselines do not depend on the policy's tuning: a variant run
        # reuses their totals instead of simulating them again.
        results[name] = dataclasses.replace(
            results["pdfleet"],
            strategy=name,
            replica_seconds={"total": figures["replica_seconds"]},
            scale_events={"total": int(figures["scale_events"])},
            scale_log=[],
            timeline=[],
        )
    needs = replica_needs(trace, model, spec)
    if "fixed" in strategies:
        # Only fixed peak's cost enters a target, and it is known without
        # simulating: the oracle's peak counts, the whole trace long.
        duration = config.duration_seconds
        fixed = {"prefill": max(needs[0]) * duration, "decode": max(needs[1]) * duration}
        results["fixed"] = dataclasses.replace(
            results["pdfleet"],
            strategy="fixed",
            replica_seconds={**fixed, "total": fixed["prefill"] + fixed["decode"]},
            scale_events={"prefill": 0, "decode": 0, "total": 0},
            scale_log=[],
            timeline=[],
        )
    bound = None
    hpa_events = int(results["hpa"].scale_events["total"]) if "hpa" in results else 0
    if config.kind != "steady" and "fixed" in results and hpa_events > 0:
        bound = foresight_bound(trace, model, spec, hpa_events - 1, needs)
    window = spec.prefill.scale_down_stabilization_seconds
    shown: dict[str, Any] = {
        k: r.to_dict() for k, r in results.items() if k != "fixed" and k not in known
    }
    for name in ("fixed", *known):
        if name in results:
            shown[name] = {
                "replica_seconds": results[name].replica_seconds,
                "scale_events": results[name].scale_events,
            }
    return {
        "trace": config.kind,
        "seed": config.seed,
        "targets": cell_targets(config.kind, results, window, targets, bound),
        "results": shown,
        "foresight_bound": None if bound is None else bound.to_dict(),
        "wall_seconds": time.perf_counter() - started,
    }


def run_matrix(
    base: TraceConfig,
    model: FleetModel,
    spec: AutoscalingSpec,
    kinds: Sequence[str] = TRACE_KINDS,
    seeds: Sequence[int] = range(10),
    strategies: Sequence[str] = ("pdfleet", "fixed", "hpa", "oracle"),
    jobs: int = 1,
    targets: MatrixTargets | None = None,
    tuning: PolicyTuning | None = None,
    baselines: dict[tuple[str, int], dict[str, Baseline]] | None = None,
) -> dict[str, Any]:
    """Every (trace kind, seed) cell; ``jobs`` > 1 runs cells in processes.

    ``tuning`` is the policy's (default :class:`PolicyTuning`); ``baselines``
    maps (trace kind, seed) to figures of baselines already run on that cell
    (``{"hpa": {"replica_seconds": ..., "scale_events": ...}}``), which are
    then not simulated again: comparing policy variants costs one strategy
    per cell instead of three."""
    targets = targets or MatrixTargets()
    unknown = [k for k in kinds if k not in TRACE_KINDS]
    if unknown:
        raise ValueError(
            f"unknown trace {', '.join(unknown)}; choose from {', '.join(TRACE_KINDS)}"
        )
    work = [
        (
            dataclasses.replace(base, kind=cast(TraceKind, kind), seed=seed),
            model,
            spec,
            tuple(strategies),
            targets,
            tuning,
            {
                name: figures
                for name, figures in (baselines or {}).get((kind, seed), {}).items()
                if name in strategies and name not in ("pdfleet", "fixed")
            },
        )
        for kind in kinds
        for seed in seeds
    ]
    started = time.perf_counter()
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            cells = list(pool.map(_cell, work))
    else:
        cells = [_cell(w) for w in work]
    return {
        "targets": dataclasses.asdict(targets),
        "model": dataclasses.asdict(model),
        "trace": dataclasses.asdict(base),
        "spec": spec.to_spec(),
        "tuning": dataclasses.asdict(tuning or PolicyTuning()),
        "cells": cells,
        "summary": summarize_matrix(cells),
        "wall_seconds": time.perf_counter() - started,
    }


def summarize_matrix(cells: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per trace and target: seeds that met it, of those where it applies, how
    many of the rest the oracle misses too (``oracle_misses``), how many
    could be met only by missing another target that is met (``traded``),
    and the worst value."""
    out: dict[str, dict[str, Any]] = {}
    for cell in cells:
        row = out.setdefault(cell["trace"], {})
        for name, t in cell["targets"].items():
            entry = row.setdefault(
                name, {"met": 0, "applies": 0, "oracle_misses": 0, "traded": 0, "values": []}
            )
            entry["values"].append(t["value"])
            if t["met"] is not None:
                entry["applies"] += 1
                entry["met"] += bool(t["met"])
                entry["oracle_misses"] += "oracle_misses" in t
                entry["traded"] += "traded" in t
    return out


def all_met(summary: dict[str, dict[str, Any]]) -> bool:
    return all(e["met"] == e["applies"] for row in summary.values() for e in row.values())


def _worst(name: str, values: list[Any]) -> str:
    if name in ("ttft_attainment", "itl_attainment"):
        return f"min {min(values):.2%}"
    if name in ("vs_oracle", "vs_fixed_peak"):
        return f"max {max(values):.3f}x"
    if name == "events_vs_hpa":
        return f"worst {max(values):+d}"
    return f"max {max(values)}"


def format_matrix(result: dict[str, Any]) -> str:
    summary = result["summary"]
    t = result["targets"]
    heads = {
        "ttft_attainment": f"TTFT>={t['min_attainment']:.0%}",
        "itl_attainment": f"ITL>={t['min_attainment']:.0%}",
        "vs_oracle": f"<={t['max_oracle_ratio']}x oracle",
        "vs_fixed_peak": f"<={t['max_fixed_ratio']}x fixed",
        "events_vs_hpa": "events<HPA",
        "oscillations": "no flap (steady)",
    }
    names = [n for n in TARGET_NAMES if any(n in row for row in summary.values())]
    width = 28
    lines = [
        f"pdfleet sim --matrix: {len(result['cells'])} runs, cold start "
        f"{result['model']['cold_start_seconds']:g} s, prefill "
        f"{result['model']['prefill_tokens_per_second']:g} tok/s, "
        f"{result['wall_seconds']:.0f} s; seeds met / seeds (worst value)",
        "",
        f"{'trace':<10}" + "".join(f"{heads[n]:>{width}}" for n in names),
    ]
    for kind, row in summary.items():
        cells = []
        for n in names:
            e = row.get(n)
            if e is None or not e["applies"]:
                cells.append(f"{'-':>{width}}")
                continue
            text = f"{e['met']}/{e['applies']} ({_worst(n, e['values'])})"
            if e.get("oracle_misses"):
                text += f" [{e['oracle_misses']}]"
            if e.get("traded"):
                text += f" {{{e['traded']}}}"
            cells.append(text.rjust(width))
        lines.append(f"{kind:<10}" + "".join(cells))
    notes = []
    if any(e.get("oracle_misses") for row in summary.values() for e in row.values()):
        notes.append(
            "[n]: of the seeds missed, those where the oracle's own replica-seconds "
            "miss the target too"
        )
    if any(e.get("traded") for row in summary.values() for e in row.values()):
        notes.append(
            "{n}: of the seeds missed, those where no schedule within the spec's steps at the "
            "oracle's sizing, even with perfect foresight, makes fewer scale events than HPA "
            f"within {result['targets']['max_fixed_ratio']}x fixed peak, and the other of the "
            "two is met"
        )
    if notes:
        lines += ["", *notes]
    lines += ["", "all targets met" if all_met(summary) else "some targets MISSED"]
    return "\n".join(lines)
