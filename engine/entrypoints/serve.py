"""``pdfleet serve MODEL [engine flags]``: the OpenAI-compatible engine server."""

from __future__ import annotations

import argparse

from ..config import EngineArgs
from ..config.serving_defaults import (
    SERVING_DEFAULTS_FILE,
    TOOL_CALL_PARSERS,
    read_serving_defaults,
    resolve_tool_flags,
)
from ..contracts import security
from ..contracts.http_limits import RequestLimits
from ..models.sources import create_engine_config
from .auth import EngineAuth, keys_from_sources


def add_server_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Server")
    group.add_argument("--host", default="0.0.0.0", help="Address to listen on.")  # noqa: S104 (an engine serves every interface of its pod)
    group.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=4096,
        help="Answer 503 to new requests while this many are waiting (0: no limit).",
    )
    group.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="Accept 'Authorization: Bearer KEY' (repeatable, or comma-separated). A key on "
        "the command line shows in `ps`: prefer --api-key-file or $PDFLEET_API_KEY_FILE. "
        "Default: $PDFLEET_API_KEY, else the file $PDFLEET_API_KEY_FILE names. The fleet "
        "token derived from $PDFLEET_FLEET_SECRET is always accepted.",
    )
    group.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        metavar="PATH",
        help="Read API keys from a file (one per line, or comma-separated); repeatable.",
    )
    group.add_argument(
        "--internal-api-key-file",
        action="append",
        default=[],
        metavar="PATH",
        help="Read internal API keys from a file: keys of internal callers that are not "
        "fleet members (vLLM's P/D router), which, like the fleet token, may send "
        "kv_transfer_params; client API keys never may. Repeatable. Default: "
        "$PDFLEET_INTERNAL_API_KEY, else the file $PDFLEET_INTERNAL_API_KEY_FILE names.",
    )
    limits = RequestLimits()
    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=limits.max_body_bytes,
        help="Refuse (413) a request body larger than this, before reading it.",
    )
    group.add_argument(
        "--max-chunk-bytes",
        type=int,
        default=limits.max_chunk_bytes,
        help="Refuse (413) and close a chunked body whose chunk announces more than this.",
    )
    group.add_argument(
        "--header-timeout",
        type=float,
        default=limits.header_timeout,
        help="Close a connection that has not sent complete request headers within this "
        "many seconds of its first byte.",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=limits.body_timeout,
        help="Answer 408 and close when a request body has not fully arrived this many "
        "seconds after its headers.",
    )
    group.add_argument(
        "--large-prompt-chars",
        type=int,
        default=1 << 16,
        help="Prompts of at least this many characters are tokenized in their own lane, so "
        "that large prompts cannot hold up short ones.",
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="A Jinja chat template (a file's path, or the template itself) to use instead "
        "of the tokenizer's; it receives `messages` and, with tools, `tools`.",
    )
    group.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(TOOL_CALL_PARSERS),
        help="How tool calls are read from the model's text (vLLM's parser names). Default: "
        f"the model directory's ({SERVING_DEFAULTS_FILE}; pdfleet's built-in models name "
        "theirs), when no --chat-template is given.",
    )
    group.add_argument(
        "--reasoning-parser",
        default=None,
        choices=["qwen3", "deepseek_r1"],
        help="Split a thinking model's <think>...</think> text from its answer: chat "
        "answers carry it as message.reasoning (and reasoning_content), streamed as "
        "their own deltas (vLLM's parser names).",
    )
    group.add_argument(
        "--enable-auto-tool-choice",
        action=argparse.BooleanOptionalAction,
        default=None,
        help='Let the model decide when to call tools (tool_choice "auto"); needs a tool '
        "parser. Default: on when the model directory names its parser, else off.",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
    )


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
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
    from ..contracts.chat_template import load_chat_template
    from .openai.api_server import run_server
    from .openai.serving_base import ChatOptions

    engine_args = EngineArgs.from_cli_args(args)
    config = create_engine_config(engine_args, usage_context="server")
    if config.parallel_config.headless:
        from ..worker.tp_executor import run_headless

        return run_headless(config)
    if args.max_waiting_requests < 0:
        raise ValueError("--max-waiting-requests must be >= 0")
    if args.large_prompt_chars < 1:
        raise ValueError("--large-prompt-chars must be >= 1")
    parser, auto = resolve_tool_flags(
        args.chat_template,
        args.tool_call_parser,
        args.enable_auto_tool_choice,
        read_serving_defaults(config.model_config.model_dir),
    )
    if auto and not parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    options = ChatOptions(
        chat_template=load_chat_template(args.chat_template),
        tool_call_parser=parser,
        enable_auto_tool_choice=auto,
        reasoning_parser=args.reasoning_parser,
    )
    limits = RequestLimits(
        max_body_bytes=args.max_request_body_bytes,
        max_chunk_bytes=args.max_chunk_bytes,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
    )
    internal = keys_from_sources(
        (), args.internal_api_key_file, environ={}, flag="--internal-api-key-file"
    )
    auth = EngineAuth(
        keys_from_sources(args.api_key, args.api_key_file),
        security.fleet_secret_from_env(),
        internal or security.internal_api_keys_from_env(),
    )
    return run_server(
        config,
        args.host,
        args.port,
        args.max_waiting_requests,
        auth,
        args.uvicorn_log_level,
        limits,
        args.large_prompt_chars,
        options,
    )
