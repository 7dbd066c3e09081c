"""``pdfleet config MODEL [engine flags]``: print the resolved engine configuration."""

from __future__ import annotations

import argparse
import json

from ..config import EngineArgs, parse_human_int
from ..models.sources import create_engine_config


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "config",
        help="print the fully resolved engine configuration as JSON",
        description="Resolve engine flags against a model directory and print the result as "
        "JSON. Exits 2 with a one-line error on an invalid combination. The device may be one "
        "this machine lacks (--device cuda on a CPU node).",
    )
    parser.add_argument(
        "--usage-context",
        choices=["llm", "server"],
        default="server",
        help="Usage context that selects batch defaults: llm (offline LLM class) or server "
        "(API server). Default: server.",
    )
    parser.add_argument(
        "--device-memory",
        type=parse_human_int,
        default=None,
        metavar="BYTES",
        help="Total memory of the target device (e.g. 141G) when it cannot be queried here.",
    )
    parser.add_argument(
        "--device-name", default=None, help="Name of the target device (e.g. 'NVIDIA H200')."
    )
    parser.add_argument(
        "--include-hf-config", action="store_true", help="Also print the model's config.json."
    )
    EngineArgs.add_cli_args(parser, positional_model=True)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    config = create_engine_config(
        engine_args,
        usage_context=args.usage_context,
        device_memory_bytes=args.device_memory,
        device_name=args.device_name,
    )
    print(json.dumps(config.to_dict(args.include_hf_config), indent=2, sort_keys=True))
    return 0
