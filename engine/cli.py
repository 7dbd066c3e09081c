"""The ``pdfleet`` command: one console script, one module per subcommand.

Each subcommand module defines ``add_parser(subparsers)`` (cheap: no torch at
import) which registers its parser with ``set_defaults(func=...)``. The
function returns the process exit code. A ``ValueError`` from any command is a
user error: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from typing import Any

from .config import FlexibleArgumentParser

COMMANDS = {
    "serve": "pdfleet.engine.entrypoints.serve",
    "gateway": "pdfleet.engine.gateway.cli",
    "up": "pdfleet.operator.local.cli",
    "apply": "pdfleet.operator.local.apply_cmd",
    "bench": "pdfleet.engine.bench.cli",
    "config": "pdfleet.engine.entrypoints.config_cmd",
    "tiny-model": "pdfleet.engine.tiny.cli",
    "fetch-model": "pdfleet.engine.tiny.fetch_cmd",
    "sim": "pdfleet.operator.autoscaling_lab.sim_cmd",
    "crd": "pdfleet.operator.crd_cmd",
    "render": "pdfleet.operator.render_cmd",
    "operator": "pdfleet.operator.operator_cmd",
    "status": "pdfleet.operator.status_cmd",
}
# Commands whose package an image may leave out (the operator image ships no
# autoscaling lab): without it the command is listed and says so when run.
OPTIONAL_COMMANDS = {"sim": "pdfleet.operator.autoscaling_lab"}


def version() -> str:
    try:
        from importlib.metadata import version as dist_version

        return dist_version("pdfleet")
    except Exception:
        return "unknown"


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The ``pdfleet`` parser; ``only``: with that command's parser alone (each
    command's module imports what its parser needs: the others' cost every
    process start about a second of CPU)."""
    parser = FlexibleArgumentParser(
        prog="pdfleet",
        description="Serve LLMs as disaggregated prefill/decode fleets.",
    )
    parser.add_argument("--version", action="version", version=f"pdfleet {version()}")
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="Logging level (default INFO).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands = {only: COMMANDS[only]} if only in COMMANDS else COMMANDS
    for command, module in commands.items():
        try:
            importlib.import_module(module).add_parser(sub)
        except ModuleNotFoundError as e:
            package = OPTIONAL_COMMANDS.get(command)
            if package is None or e.name != package:
                raise
            _add_missing(sub, command, package)
    return parser


def _add_missing(sub: argparse._SubParsersAction[Any], command: str, package: str) -> None:
    """A command whose package is not installed here: it takes any arguments
    and fails with one line naming the package."""

    def missing(args: argparse.Namespace) -> int:
        raise ValueError(
            f"{package} is not installed in this image (the operator image ships no lab)"
        )

    # No option prefix: every argument, "--help" included, is taken as given.
    parser = sub.add_parser(
        command, help=f"(not installed: {package})", add_help=False, prefix_chars="\x00"
    )
    parser.add_argument("rest", nargs=argparse.REMAINDER)
    parser.set_defaults(func=missing)


def _command_of(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names, if it names one before anything else
    (options of ``pdfleet`` itself may come first); else None."""
    rest = iter(argv)
    for arg in rest:
        if arg == "--log-level":
            next(rest, None)
        elif not arg.startswith("-"):
            return arg if arg in COMMANDS else None
        elif not arg.startswith("--log-level="):
            return None  # --help, --version, or a mistake: the whole parser answers
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, args.log_level),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"pdfleet {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
