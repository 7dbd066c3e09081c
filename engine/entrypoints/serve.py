"""``pdfleet serve MODEL [engine flags]``: the OpenAI-compatible engine server."""

from __future__ import annotations

import argparse

from pdfleet.engine.config import EngineArgs


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Server")
    group.add_argument("--host", default="0.0.0.0", help="Address to listen on.")
    group.add_argument("--port", type=int, default=8000, help="Port to listen on.")


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "serve",
        help="serve a model over the OpenAI-compatible HTTP API",
        description="Start an engine and serve it over the OpenAI-compatible API.",
    )
    add_server_args(parser)
    EngineArgs.add_cli_args(parser, positional_model=True)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(args)
    engine_args.create_engine_config(usage_context="server")
    raise ValueError("the API server is not implemented yet; use `pdfleet config` to check flags")
