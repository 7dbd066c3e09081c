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
from typing import Any

from .sim_fleet import FleetModel
from .traces import TraceConfig

DEFAULT_MAX_REPLICAS = 64
# Flag defaults come from the dataclasses, so the CLI and the library agree.
TRACE = TraceConfig()
MODEL = FleetModel()


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "sim",
        help="simulate a prefill/decode fleet under autoscaling strategies",
        description="Discrete-event simulation of a prefill/decode fleet under a seeded "
        "synthetic trace, running the pdfleet autoscaling policy (the same code as the "
        "operator) against fixed peak provisioning, an HPA-style baseline and an oracle "
        "that knows the trace.",
    )
    trace = parser.add_argument_group("trace")
    trace.add_argument("--trace", choices=["steady", "diurnal", "burst"], default="burst")
    trace.add_argument("--seed", type=int, default=0, help="Trace and simulation seed.")
    trace.add_argument("--duration", type=float, default=TRACE.duration_seconds, metavar="SECONDS")
    trace.add_argument(
        "--rate",
        type=float,
        default=TRACE.base_rate,
        help="Base request rate per second (default %(default)s).",
    )
    trace.add_argument(
        "--prompt-tokens", type=float, default=TRACE.prompt_tokens_mean, help="Mean prompt length."
    )
    trace.add_argument(
        "--output-tokens", type=float, default=TRACE.output_tokens_mean, help="Mean output length."
    )
    trace.add_argument(
        "--burst-every",
        type=float,
        default=TRACE.burst_every_seconds,
        metavar="SECONDS",
        help="Mean surge gap.",
    )
    trace.add_argument(
        "--burst-factor",
        type=float,
        nargs=2,
        default=list(TRACE.burst_factor),
        metavar=("LOW", "HIGH"),
        help="Surge rate as a multiple of the base rate, drawn from [LOW, HIGH].",
    )
    trace.add_argument(
        "--burst-seconds",
        type=float,
        nargs=2,
        default=list(TRACE.burst_seconds),
        metavar=("LOW", "HIGH"),
        help="Seconds a surge holds its peak, drawn from [LOW, HIGH].",
    )
    trace.add_argument(
        "--burst-ramp",
        type=float,
        default=TRACE.burst_ramp_seconds,
        metavar="SECONDS",
        help="Seconds a surge takes to rise (and to fall).",
    )
    trace.add_argument("--diurnal-amplitude", type=float, default=TRACE.diurnal_amplitude)

    fleet = parser.add_argument_group("fleet model")
    fleet.add_argument(
        "--cold-start", type=float, default=MODEL.cold_start_seconds, metavar="SECONDS"
    )
    fleet.add_argument(
        "--prefill-tokens-per-second", type=float, default=MODEL.prefill_tokens_per_second
    )
    fleet.add_argument("--kv-capacity-tokens", type=int, default=MODEL.kv_capacity_tokens)
    fleet.add_argument("--max-num-seqs", type=int, default=MODEL.max_num_seqs)
    fleet.add_argument(
        "--decode-step",
        type=float,
        nargs=3,
        default=[
            MODEL.decode_step_seconds,
            MODEL.decode_step_seconds_per_seq,
            MODEL.decode_step_seconds_per_token,
        ],
        metavar=("A", "B", "C"),
        help="Decode step seconds = A + B * batch + C * context tokens.",
    )
    fleet.add_argument("--ttft-slo", type=float, default=MODEL.ttft_slo_seconds, metavar="SECONDS")
    fleet.add_argument("--itl-slo", type=float, default=MODEL.itl_slo_seconds, metavar="SECONDS")
    fleet.add_argument(
        "--scrape-failure-rate",
        type=float,
        default=0.0,
        help="Probability that a replica's scrape fails in a period.",
    )

    policy = parser.add_argument_group("strategies")
    trace.add_argument(
        "--seeds",
        type=int,
        default=1,
        metavar="N",
        help="Run N seeds from --seed on and print means and targets met per seed.",
    )
    policy.add_argument(
        "--strategies",
        default="pdfleet,fixed,hpa,oracle",
        help="Comma-separated subset of pdfleet, fixed, hpa, oracle.",
    )
    policy.add_argument(
        "--spec",
        metavar="FILE",
        help="YAML with the autoscaling section (an InferenceService, its spec, or the "
        "section itself). Default: the spec's defaults with maxReplicas "
        f"{DEFAULT_MAX_REPLICAS} per role.",
    )
    policy.add_argument("--max-replicas", type=int, default=None, help="maxReplicas of both roles.")
    policy.add_argument(
        "--hpa-prefill-metric",
        choices=["utilization", "waiting"],
        default="utilization",
        help="The HPA baseline's prefill metric (decode uses KV-cache usage).",
    )

    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="Print JSON instead of a table.")
    out.add_argument(
        "--timeline",
        action="store_true",
        help="With --json: include per-period replica counts and arrival rates.",
    )
    out.add_argument(
        "--reasons",
        type=int,
        default=0,
        metavar="N",
        help="Also print the first N scaling decisions of the pdfleet policy with reasons.",
    )
    parser.set_defaults(func=run)
    return parser


def _load_spec(path: str | None, max_replicas: int | None) -> Any:
    from .spec import AutoscalingSpec

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
    from .sim import FleetModel, compare, evaluate_targets
    from .traces import TraceConfig, make_trace

    spec = _load_spec(args.spec, args.max_replicas)
    trace_config = TraceConfig(
        kind=args.trace,
        duration_seconds=args.duration,
        base_rate=args.rate,
        seed=args.seed,
        prompt_tokens_mean=args.prompt_tokens,
        output_tokens_mean=args.output_tokens,
        diurnal_amplitude=args.diurnal_amplitude,
        burst_every_seconds=args.burst_every,
        burst_factor=tuple(args.burst_factor),
        burst_seconds=tuple(args.burst_seconds),
        burst_ramp_seconds=args.burst_ramp,
    )
    a, b, c = args.decode_step
    model = FleetModel(
        prefill_tokens_per_second=args.prefill_tokens_per_second,
        decode_step_seconds=a,
        decode_step_seconds_per_seq=b,
        decode_step_seconds_per_token=c,
        kv_capacity_tokens=args.kv_capacity_tokens,
        max_num_seqs=args.max_num_seqs,
        cold_start_seconds=args.cold_start,
        ttft_slo_seconds=args.ttft_slo,
        itl_slo_seconds=args.itl_slo,
        scrape_failure_rate=args.scrape_failure_rate,
    )
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if args.seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {args.seeds}")
    if args.seeds > 1:
        return _run_seeds(args, trace_config, model, spec, strategies)
    trace = make_trace(trace_config)
    results = compare(
        trace, model, spec, strategies, hpa_prefill_metric=args.hpa_prefill_metric, seed=args.seed
    )
    targets = evaluate_targets(results)
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
    figures = {
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
        lines += ["", "issue 8 targets (pdfleet policy), seeds that met each:"]
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
        lines += ["", "issue 8 targets (pdfleet policy):"]
        for name, t in targets.items():
            value = t["value"]
            shown = f"{value:.4g}" if isinstance(value, float) else str(value)
            lines.append(
                f"  {'met ' if t['met'] else 'MISS'}  {name}: {shown} (target {t['target']})"
            )
    return "\n".join(lines)
