"""``pdfleet sim``: compare autoscaling strategies on a simulated P/D fleet.

Runs the pdfleet policy, fixed peak provisioning, an HPA-style baseline and a
trace-knowing oracle over the same seeded synthetic trace and prints SLO
attainment, replica-seconds and scale events for each (``--json`` for the
machine-readable form).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from ...engine.config.dataclass_cli import add_dataclass_arguments, dataclass_from_arguments
from .sim_fleet import FleetModel, SimResult
from .traces import TraceConfig

# Short flags for the trace and fleet fields people set most (the rest are
# the field names with dashes).
TRACE_FLAGS = {
    "kind": "trace",
    "duration_seconds": "duration",
    "base_rate": "rate",
    "prompt_tokens_mean": "prompt-tokens",
    "output_tokens_mean": "output-tokens",
    "burst_every_seconds": "burst-every",
    "burst_ramp_seconds": "burst-ramp",
}
MODEL_FLAGS = {
    "cold_start_seconds": "cold-start",
    "ttft_slo_seconds": "ttft-slo",
    "itl_slo_seconds": "itl-slo",
}


@dataclass(frozen=True)
class SimOptions:
    """What to run and how to print it (the trace and the fleet have their own
    dataclasses)."""

    regime: Literal["gpu", "cpu"] = "gpu"
    """The trace, fleet model and spec the run starts from (docs/autoscaling.md,
    "Regimes"): gpu (an 8B model on H100s, 15-75 replicas per role, SLOs that
    bind) or cpu (the simulator's defaults, 3-11 replicas). Trace and
    fleet-model flags that differ from their defaults override its values."""
    seeds: int = 1
    """Run N seeds from --seed on and print means and targets met per seed."""
    strategies: str = "pdfleet,fixed,hpa,oracle"
    """Comma-separated subset of pdfleet, fixed, hpa, oracle, bstar (bstar: the
    cheapest perfect-foresight schedule the simulator shows meets the SLOs,
    found by a search of about fifteen runs)."""
    spec: str | None = None
    """YAML with the autoscaling section (an InferenceService, its spec, or the
    section itself). Default: the regime's."""
    max_replicas: int | None = None
    """maxReplicas of both roles."""
    json: bool = False
    """Print JSON instead of a table."""
    timeline: bool = False
    """With --json: include per-period replica counts and arrival rates."""
    reasons: int = 0
    """Also print the first N scaling decisions of the pdfleet policy with reasons."""
    matrix: int = 0
    """Run the target matrix instead: N seeds (from --seed) of every trace in
    --matrix-traces against B* and HPA tuned per trace, plus the robustness
    cases; exit 1 when a target is missed that the first-surge ceiling
    does not prove infeasible (docs/autoscaling.md)."""
    matrix_traces: str = "burst,diurnal,steady,heavytail"
    """Comma-separated trace kinds the matrix runs."""
    matrix_cases: str = "cold_start_x2,prefill_rate_-30%,prefill_rate_+30%"
    """Comma-separated robustness cases the matrix runs on burst and diurnal
    (its first five seeds); empty for none."""
    hpa_tune_seeds: str = "0-9"
    """Seeds HPA's targets are tuned on, per trace (FIRST-LAST or a comma list),
    whatever seeds the matrix evaluates."""
    jobs: int = 1
    """Processes the matrix runs its cells in."""
    cache: str | None = None
    """Directory of the matrix's cache of B* and HPA runs (they do not depend on
    the policy). Default: $XDG_CACHE_HOME/pdfleet/sim (~/.cache/pdfleet/sim)."""
    no_cache: bool = False
    """Compute everything, keep nothing."""
    reuse: str | None = None
    """With --matrix: comma-separated matrix JSONs of an earlier run. Where the
    cache has no B* for a cell, its B* is replayed from them (the winner, its
    fewest-events schedule and the nearest miss simulated again) and kept
    only if every figure comes out identical; otherwise it is searched."""
    fleet_model: str | None = None
    """Read the fleet model from this JSON (``pdfleet sim calibrate`` writes it);
    fleet-model flags that differ from their defaults still win."""
    plot: str | None = None
    """Write a PNG of the run to this path: request rate, replicas per role for
    each strategy, TTFT p99 against the SLO, the policy's scale events."""
    figure: str | None = None
    """With --matrix: write the matrix's summary figure (replica-seconds of the
    policy, tuned HPA, B* and fixed peak per trace) to this PNG."""
    out: str | None = None
    """With --matrix: also write the whole result as JSON to this file."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "sim",
        help="simulate a prefill/decode fleet under autoscaling strategies",
        description="Discrete-event simulation of a prefill/decode fleet under a seeded "
        "synthetic trace, running the pdfleet autoscaling policy (the same code as the "
        "operator) against fixed peak provisioning, Kubernetes' HPA, an oracle that "
        "knows the trace and B* (the cheapest perfect-foresight schedule that meets the "
        "SLOs). See docs/autoscaling.md.",
    )
    add_dataclass_arguments(
        parser.add_argument_group("trace"),
        TraceConfig,
        flags=TRACE_FLAGS,
        metavars={"burst_factor": ("LOW", "HIGH"), "burst_seconds": ("LOW", "HIGH")},
    )
    add_dataclass_arguments(parser.add_argument_group("fleet model"), FleetModel, flags=MODEL_FLAGS)
    add_dataclass_arguments(parser.add_argument_group("strategies and output"), SimOptions)
    parser.set_defaults(func=run)
    from . import calibrate

    calibrate.add_parser(parser.add_subparsers(dest="sim_command", metavar="{calibrate}"))
    return parser


def _overridden(cls: type, base: Any, args: argparse.Namespace) -> Any:
    """``base`` with the flags of ``cls`` that differ from their defaults."""
    import dataclasses

    flags: Any = dataclass_from_arguments(cls, args)
    default = cls()
    changed = {
        f.name: getattr(flags, f.name)
        for f in dataclasses.fields(cls)
        if getattr(flags, f.name) != getattr(default, f.name)
    }
    return dataclasses.replace(base, **changed)


def fleet_model_from_arguments(
    args: argparse.Namespace, base: FleetModel | None = None
) -> FleetModel:
    """The fleet model: the regime's (``base``), or the ``--fleet-model``
    file's, with the flags that differ from their defaults over it."""
    if getattr(args, "fleet_model", None):
        from .calibrate import load_fleet_model

        try:
            base = FleetModel(**load_fleet_model(args.fleet_model))
        except (TypeError, ValueError) as e:
            raise ValueError(f"--fleet-model: {args.fleet_model}: {e}") from None
    try:
        model: FleetModel = _overridden(FleetModel, base or FleetModel(), args)
    except (TypeError, ValueError) as e:
        if getattr(args, "fleet_model", None):
            raise ValueError(f"--fleet-model: {args.fleet_model}: {e}") from None
        raise
    return model


def regime_from_arguments(args: argparse.Namespace) -> Any:
    """The named regime with the trace and fleet-model flags over it, and
    ``--spec`` / ``--max-replicas`` over its spec."""
    import dataclasses

    from .regimes import regime

    base = regime(args.regime)
    section = base.spec
    if args.spec:
        section = _read_section(args.spec)
    if args.max_replicas is not None:
        for role in ("prefill", "decode"):
            section = {
                **section,
                role: {**(section.get(role) or {}), "maxReplicas": args.max_replicas},
            }
    return dataclasses.replace(
        base,
        trace=_overridden(TraceConfig, base.trace, args),
        model=fleet_model_from_arguments(args, base.model),
        spec=section,
    )


def _read_section(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f) or {}
    except OSError as e:
        raise ValueError(f"--spec: cannot read {path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--spec: {path} is not YAML: {e}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"--spec: {path} must hold a mapping")
    doc = doc.get("spec", doc)
    section = doc.get("autoscaling", doc) if isinstance(doc, dict) else {}
    return dict(section or {})


def run(args: argparse.Namespace) -> int:
    from ..autoscaling.spec import AutoscalingSpec

    base = regime_from_arguments(args)
    spec = AutoscalingSpec.from_spec(base.section())
    trace_config, model = base.trace, base.model
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    if args.plot and (args.seeds > 1 or args.matrix):
        raise ValueError("--plot draws one run: use it without --seeds and --matrix")
    if args.matrix:
        return _run_matrix(args, base)
    if args.figure or args.out:
        raise ValueError("--figure and --out go with --matrix")
    if args.seeds > 1:
        return _run_seeds(args, trace_config, model, spec, strategies)
    from .sim import compare, evaluate_targets
    from .traces import make_trace

    trace = make_trace(trace_config)
    results, found = compare(trace, model, spec, strategies)
    targets = evaluate_targets(results, trace_config.kind)
    if args.plot:
        from .plot import plot_sim

        plot_sim(trace, model, results, args.plot)
    if args.json:
        out = {
            "regime": args.regime,
            "trace": {**vars(trace_config), "requests": len(trace), "bursts": len(trace.bursts)},
            "model": vars(model),
            "spec": spec.to_spec(),
            "results": {k: r.to_dict(timeline=args.timeline) for k, r in results.items()},
            "targets": targets,
        }
        if found is not None:
            out["bstar"] = found.to_dict(schedules=args.timeline)
        json.dump(out, sys.stdout, indent=2, default=list)
        print()
        return 0
    print(format_table(trace, model, results, targets))
    if found is not None and found.best is not None:
        s = found.best.sizing
        print(
            f"\nB*: prefill at {s.prefill_utilization:.3f} of its compute, decode at "
            f"{s.decode_kv_usage:.3f} of its KV ({len(found.candidates)} schedules simulated)"
        )
    elif found is not None:
        print("\nB*: no schedule searched met the SLOs")
    if args.reasons and "pdfleet" in results:
        print()
        for line in results["pdfleet"].reasons[: args.reasons]:
            print(line)
    return 0


def parse_seeds(text: str) -> list[int]:
    """``FIRST-LAST`` or ``A,B,C``."""
    text = text.strip()
    try:
        if "-" in text and "," not in text:
            first, last = (int(x) for x in text.split("-", 1))
            if last < first:
                raise ValueError
            return list(range(first, last + 1))
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"seeds must be FIRST-LAST or a comma list, got {text!r}") from None


def _run_matrix(args: argparse.Namespace, base: Any) -> int:
    from .cache import default_directory
    from .matrix import format_matrix, run_matrix
    from .replay import load_records

    if args.matrix < 1 or args.jobs < 1:
        raise ValueError("--matrix and --jobs must be >= 1")
    kinds = [k.strip() for k in args.matrix_traces.split(",") if k.strip()]
    cases = [c.strip() for c in args.matrix_cases.split(",") if c.strip()]
    cache = None if args.no_cache else str(args.cache or default_directory())
    result = run_matrix(
        base,
        kinds,
        range(args.seed, args.seed + args.matrix),
        parse_seeds(args.hpa_tune_seeds),
        cases,
        jobs=args.jobs,
        cache=cache,
        log=lambda line: print(line, file=sys.stderr, flush=True),
        prior=load_records(args.reuse.split(",")) if args.reuse else None,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
            f.write("\n")
    if args.figure:
        from .plot import plot_matrix

        plot_matrix(result, args.figure)
    if args.json:
        json.dump(result, sys.stdout, indent=2, default=list)
        print()
    else:
        print(format_matrix(result))
    # Nonzero when a target is missed that the first-surge ceiling does not prove
    # infeasible (matrix.misses).
    return 1 if result["unproven_misses"] else 0


def _run_seeds(
    args: argparse.Namespace, trace_config: Any, model: Any, spec: Any, strategies: list[str]
) -> int:
    """Every seed from ``--seed`` on: each strategy's mean over the seeds, and
    how many seeds met each target."""
    import dataclasses

    from .sim import compare, evaluate_targets
    from .traces import make_trace

    runs = []
    for seed in range(args.seed, args.seed + args.seeds):
        config = dataclasses.replace(trace_config, seed=seed)
        results, _ = compare(make_trace(config), model, spec, strategies)
        runs.append((seed, results, evaluate_targets(results, config.kind)))
    summary = summarize(runs)
    if args.json:
        out = {
            "regime": args.regime,
            "trace": vars(trace_config),
            "model": vars(model),
            "spec": spec.to_spec(),
            "seeds": [
                {
                    "seed": seed,
                    "results": {k: r.to_dict() for k, r in results.items()},
                    "targets": targets,
                }
                for seed, results, targets in runs
            ],
            "summary": summary,
        }
        json.dump(out, sys.stdout, indent=2, default=list)
        print()
        return 0
    print(format_summary(trace_config, model, summary))
    return 0


def summarize(runs: list[tuple[int, dict[str, Any], dict[str, Any]]]) -> dict[str, Any]:
    """Mean, min and max of the main figures per strategy, and targets met per seed."""
    figures: dict[str, Callable[[SimResult], float]] = {
        "ttft_attainment": lambda r: r.ttft_attainment,
        "itl_attainment": lambda r: r.itl_attainment,
        "replica_seconds": lambda r: r.replica_seconds["total"],
        "scale_events": lambda r: r.scale_events["total"],
    }
    strategies: dict[str, Any] = {}
    for name in runs[0][1]:
        strategies[name] = {}
        for figure, get in figures.items():
            values = [get(results[name]) for _, results, _ in runs]
            strategies[name][figure] = {
                "mean": sum(values) / len(values),
                "min": min(values),
                "max": max(values),
            }
    targets: dict[str, Any] = {}
    for _, _, seed_targets in runs:
        for name, t in seed_targets.items():
            entry = targets.setdefault(name, {"target": t["target"], "met": 0, "values": []})
            entry["met"] += bool(t["met"])
            entry["values"].append(t["value"])
    return {"seeds": [seed for seed, _, _ in runs], "strategies": strategies, "targets": targets}


def format_summary(trace_config: Any, model: Any, summary: dict[str, Any]) -> str:
    seeds = summary["seeds"]
    lines = [
        f"pdfleet sim: {trace_config.kind} trace, {trace_config.duration_seconds:.0f} s, "
        f"seeds {seeds[0]}..{seeds[-1]}, cold start {model.cold_start_seconds:.0f} s "
        "(mean [min, max] over the seeds)",
        "",
        f"{'strategy':<9} {'TTFT ok [min, max]':>26} {'ITL ok':>8} {'replica-s':>10} {'events':>7}",
    ]
    for name, f in summary["strategies"].items():
        ttft = f["ttft_attainment"]
        lines.append(
            f"{name:<9} {ttft['mean']:>7.2%} [{ttft['min']:>7.2%}, {ttft['max']:>7.2%}] "
            f"{f['itl_attainment']['mean']:>8.2%} {f['replica_seconds']['mean']:>10.0f} "
            f"{f['scale_events']['mean']:>7.1f}"
        )
    if summary["targets"]:
        lines += [
            "",
            "Targets of the pdfleet policy (SLOs met, cost against the baselines), "
            "seeds that met each:",
        ]
        for name, t in summary["targets"].items():
            values = [v for v in t["values"] if isinstance(v, float)]
            shown = f" (mean {sum(values) / len(values):.4g})" if values else ""
            lines.append(f"  {t['met']}/{len(seeds)}  {name}: target {t['target']}{shown}")
    return "\n".join(lines)


def format_table(trace: Any, model: Any, results: dict[str, Any], targets: dict[str, Any]) -> str:
    """The human-readable comparison."""
    cfg = trace.config
    lines = [
        f"pdfleet sim: {cfg.kind} trace, {cfg.duration_seconds:.0f} s, seed {cfg.seed}, "
        f"{len(trace)} requests, cold start {model.cold_start_seconds:.0f} s, SLOs TTFT "
        f"<= {model.ttft_slo_seconds:g} s and ITL <= {model.itl_slo_seconds * 1000:g} ms",
        "",
        f"{'strategy':<9} {'TTFT ok':>8} {'ITL ok':>8} {'TTFT p99':>9} {'replica-s':>10} "
        f"{'mean P+D':>9} {'peak P/D':>9} {'events':>7} {'started':>8} {'wall s':>7}",
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<9} {r.ttft_attainment:>8.2%} {r.itl_attainment:>8.2%} "
            f"{r.ttft_p99:>8.2f}s {r.replica_seconds['total']:>10.0f} "
            f"{r.mean_replicas['prefill']:>4.1f}+{r.mean_replicas['decode']:<4.1f} "
            f"{r.peak_replicas['prefill']:>4}/{r.peak_replicas['decode']:<4} "
            f"{r.scale_events['total']:>7} "
            f"{r.replicas_started['prefill'] + r.replicas_started['decode']:>8} "
            f"{r.wall_seconds:>7.2f}"
        )
    if targets:
        lines += ["", "Targets of the pdfleet policy (SLOs met, cost against the baselines):"]
        for name, t in targets.items():
            value = t["value"]
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            lines.append(
                f"  {'met ' if t['met'] else 'MISS'}  {name}: {shown} (target {t['target']})"
            )
    return "\n".join(lines)
