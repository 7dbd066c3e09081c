"""``pdfleet gateway``: the OpenAI-compatible front of a prefill/decode fleet."""

from __future__ import annotations

import argparse

from ..config.gateway import GatewayConfig


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "gateway",
        help="route OpenAI requests over prefill and decode engines",
        description="OpenAI-compatible gateway (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics) that runs the two-leg prefill/decode protocol over "
        "pdfleet (or vLLM) engines, with load- and prefix-aware routing, health checks, "
        "retries and decode-only fallback. See docs/gateway.md.",
    )
    GatewayConfig.add_cli_args(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    config = GatewayConfig.from_cli_args(args)
    from .prompt import check_chat_template
    from .workers import serve

    # Refused once here, before any worker starts, rather than by each.
    check_chat_template(config.chat_template)

    return serve(config)
