"""``pdfleet serve MODEL [engine flags]``: the OpenAI-compatible engine server."""

from __future__ import annotations

import argparse
import os

from pdfleet.engine.config import EngineArgs


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Server")
    group.add_argument("--host", default="0.0.0.0", help="Address to listen on.")
    group.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=4096,
        help="Answer 503 to new requests while this many are waiting (0: no limit).",
    )
    group.add_argument(
        "--api-key",
        default=os.environ.get("PDFLEET_API_KEY"),
        help="Require 'Authorization: Bearer KEY' (default: $PDFLEET_API_KEY, else none).",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
    )


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI-compatible HTTP API",
        description="Start an engine and serve it over the OpenAI-compatible API: "
        "/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize, "
        "/detokenize.",
    )
    add_server_args(parser)
    EngineArgs.add_cli_args(parser, positional_model=True)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from pdfleet.engine.entrypoints.openai.api_server import run_server

    engine_args = EngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config(usage_context="server")
    if args.max_waiting_requests < 0:
        raise ValueError("--max-waiting-requests must be >= 0")
    return run_server(
        config,
        args.host,
        args.port,
        args.max_waiting_requests,
        args.api_key,
        args.uvicorn_log_level,
    )
