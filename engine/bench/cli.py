"""``pdfleet bench --url URL``: load an OpenAI-compatible server and report latencies."""

from __future__ import annotations

import argparse

from .config import BenchConfig


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "bench",
        help="benchmark an OpenAI-compatible server (TTFT, ITL, TPOT, E2E, goodput)",
        description="Send a seeded workload (random prompts of given lengths, or a JSONL "
        "file) to an OpenAI-compatible server at fixed concurrency or with Poisson arrivals; "
        "report TTFT, ITL, TPOT and E2E percentiles, throughput and goodput under SLOs. "
        "See docs/bench.md.",
    )
    BenchConfig.add_cli_args(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    import logging

    from . import format_report, run_benchmark

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request
    config = BenchConfig.from_cli_args(args)
    result = run_benchmark(config)
    if not config.quiet:
        print(format_report(result))
        if config.json:
            print(f"wrote {config.json}")
    return 0 if result.completed else 1
