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

from pdfleet.engine.config.dataclass_cli import add_dataclass_arguments, dataclass_from_arguments

from .sim_fleet import FleetModel, SimResult
from .traces import TraceConfig

DEFAULT_MAX_REPLICAS = 64
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

    seeds: int = 1
    """Run N seeds from --seed on and print means and targets met per seed."""
    strategies: str = "pdfleet,fixed,hpa,oracle"
    """Comma-separated subset of pdfleet, fixed, hpa, oracle."""
    spec: str | None = None
    """YAML with the autoscaling section (an InferenceService, its spec, or the
    section itself). Default: the spec's defaults with maxReplicas 64 per role."""
    max_replicas: int | None = None
    """maxReplicas of both roles."""
    hpa_prefill_metric: Literal["utilization", "waiting"] = "utilization"
    """The HPA baseline's prefill metric (decode uses KV-cache usage)."""
    json: bool = False
    """Print JSON instead of a table."""
    timeline: bool = False
    """With --json: include per-period replica counts and arrival rates."""
    reasons: int = 0
    """Also print the first N scaling decisions of the pdfleet policy with reasons."""
    matrix: int = 0
    """Run the target matrix instead: N seeds (from --seed) of every trace in
    --matrix-traces, each target checked per seed (docs/autoscaling.md)."""
    matrix_traces: str = "burst,diurnal,steady,heavytail"
    """Comma-separated trace kinds the matrix runs."""
    jobs: int = 1
    """Processes the matrix runs its cells in."""
    fleet_model: str | None = None
    """Read the fleet model from this JSON (``pdfleet sim calibrate`` writes it);
    fleet-model flags that differ from their defaults still win."""
    plot: str | None = None
    """Write a PNG of the run to this path: request rate, replicas per role for
    each strategy, TTFT p99 against the SLO, the policy's scale events."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "sim",
        help="simulate a prefill/decode fleet under autoscaling strategies",
        description="Discrete-event simulation of a prefill/decode fleet under a seeded "
        "synthetic trace, running the pdfleet autoscaling policy (the same code as the "
        "operator) against fixed peak provisioning, an HPA-style baseline and an oracle "
        "that knows the trace. See docs/autoscaling.md.",
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


def fleet_model_from_arguments(args: argparse.Namespace) -> FleetModel:
    """The fleet-model flags, over the ``--fleet-model`` file's values where one
    is given (a flag left at its default takes the file's value)."""
    import dataclasses

    flags = dataclass_from_arguments(FleetModel, args)
    if not getattr(args, "fleet_model", None):
        return flags
    from .calibrate import load_fleet_model

    values = load_fleet_model(args.fleet_model)
    default = FleetModel()
    for f in dataclasses.fields(FleetModel):
        if getattr(flags, f.name) != getattr(default, f.name):
            values[f.name] = getattr(flags, f.name)
    try:
        return FleetModel(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"--fleet-model: {args.fleet_model}: {e}") from None


def _load_spec(path: str | None, max_replicas: int | None) -> Any:
    from pdfleet.operator.autoscaling.spec import AutoscalingSpec

    section: dict[str, Any] = {}
    if path:
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
        section = section or {}
    elif max_replicas is None:
        max_replicas = DEFAULT_MAX_REPLICAS
    if max_replicas is not None:
        for role in ("prefill", "decode"):
            section = {**section, role: {**(section.get(role) or {}), "maxReplicas": max_replicas}}
    return AutoscalingSpec.from_spec(section)


def run(args: argparse.Namespace) -> int:
    spec = _load_spec(args.spec, args.max_replicas)
    trace_config = dataclass_from_arguments(TraceConfig, args)
    model = fleet_model_from_arguments(args)
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    if args.plot and (args.seeds > 1 or args.matrix):
        raise ValueError("--plot draws one run: use it without --seeds and --matrix")
    if args.matrix:
        return _run_matrix(args, trace_config, model, spec, strategies)
    if args.seeds > 1:
        return _run_seeds(args, trace_config, model, spec, strategies)
    from .sim import compare, evaluate_targets
    from .traces import make_trace

    trace = make_trace(trace_config)
    results = compare(
        trace, model, spec, strategies, hpa_prefill_metric=args.hpa_prefill_metric, seed=args.seed
    )
    targets = evaluate_targets(results)
    if args.plot:
        from .plot import plot_sim

        plot_sim(trace, model, results, args.plot)
    if args.json:
        out = {
            "trace": {**vars(trace_config), "requests": len(trace), "bursts": len(trace.bursts)},
            "model": vars(model),
            "spec": spec.to_spec(),
            "results": {k: r.to_dict(timeline=args.timeline) for k, r in results.items()},
            "targets": targets,
        }
        json.dump(out, sys.stdout, indent=2, default=list)
        print()
        return 0
    print(format_table(trace, model, results, targets))
    if args.reasons and "pdfleet" in results:
        print()
        for line in results["pdfleet"].reasons[: args.reasons]:
            print(line)
    return 0


def _run_matrix(
    args: argparse.Namespace, trace_config: Any, model: Any, spec: Any, strategies: list[str]
) -> int:
    from .matrix import all_met, format_matrix, run_matrix

    if args.matrix < 1 or args.jobs < 1:
        raise ValueError("--matrix and --jobs must be >= 1")
    kinds = [k.strip() for k in args.matrix_traces.split(",") if k.strip()]
    result = run_matrix(
        trace_config,
        model,
        spec,
        kinds,
        range(args.seed, args.seed + args.matrix),
        strategies,
        jobs=args.jobs,
    )
    if args.json:
        json.dump(result, sys.stdout, indent=2, default=list)
        print()
    else:
        print(format_matrix(result))
    return 0 if all_met(result["summary"]) else 1


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
        results = compare(
            make_trace(config),
            model,
            spec,
            strategies,
            hpa_prefill_metric=args.hpa_prefill_metric,
            seed=seed,
        )
        runs.append((seed, results, evaluate_targets(results)))
    summary = summarize(runs)
    if args.json:
        out = {
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
