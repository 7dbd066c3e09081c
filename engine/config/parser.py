"""An argparse parser that also takes vLLM's flag spellings.

* ``--max_num_seqs`` is the same as ``--max-num-seqs``;
* ``--kv-transfer-config.kv_role kv_producer`` (or ``=kv_producer``) sets one
  key of a JSON flag; several such flags and a whole ``--kv-transfer-config
  JSON`` merge, the dotted keys winning.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from .fields import JSON_METAVAR, expand_json_human_numbers


def _normalize_flag(token: str) -> str:
    if not token.startswith("--") or token == "--":
        return token
    name, eq, value = token[2:].partition("=")
    head, dot, rest = name.partition(".")
    return "--" + head.replace("_", "-") + dot + rest + eq + value


def _parse_scalar(text: str) -> Any:
    try:
        return json.loads(expand_json_human_numbers(text))
    except json.JSONDecodeError:
        return text


def _set_path(target: dict[str, Any], path: list[str], value: Any) -> None:
    for key in path[:-1]:
        nxt = target.setdefault(key, {})
        if not isinstance(nxt, dict):
            raise argparse.ArgumentTypeError(f"cannot set {'.'.join(path)}: {key} is not an object")
        target = nxt
    target[path[-1]] = value


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def fold_dotted_args(argv: Sequence[str], json_flags: set[str]) -> list[str]:
    """Rewrite dotted JSON-flag keys into one ``--flag JSON`` per flag."""
    tokens = [_normalize_flag(t) for t in argv]
    out: list[str] = []
    folded: dict[str, dict[str, Any]] = {}
    whole: dict[str, dict[str, Any]] = {}
    first_pos: dict[str, int] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if tok == "--":
            out += tokens[i:]
            break
        flag, eq, inline = tok.partition("=")
        head, dot, rest = flag.partition(".")
        if tok.startswith("--") and head in json_flags:
            if eq:
                value, step = inline, 1
            elif i + 1 < len(tokens):
                value, step = tokens[i + 1], 2
            else:
                out.append(tok)
                break
            first_pos.setdefault(head, len(out))
            if dot:
                _set_path(folded.setdefault(head, {}), rest.split("."), _parse_scalar(value))
            else:
                parsed = _parse_scalar(value)
                if isinstance(parsed, dict):
                    _merge(whole.setdefault(head, {}), parsed)
                else:  # not JSON: let the flag's own type report it
                    out += [head, value]
                    first_pos.pop(head, None)
            i += step
            continue
        out.append(tok)
        i += 1
    for head, pos in sorted(first_pos.items(), key=lambda kv: -kv[1]):
        merged = _merge(whole.get(head, {}), folded.get(head, {}))
        out[pos:pos] = [head, json.dumps(merged)]
    return out


class FlexibleArgumentParser(argparse.ArgumentParser):
    """ArgumentParser with underscore flags and dotted JSON keys.

    It folds the dotted keys of its JSON flags (``JSON_METAVAR``), which it
    records as they are added: its own ``add_argument`` records them, and a
    flag added to one of its argument groups is recorded by
    ``record_argument`` (argparse gives no public list of a parser's actions).
    Its subcommands' parsers are its class too, and fold their own flags."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # Before argparse's own __init__, which adds --help through add_argument.
        self.json_flags: set[str] = set()
        """The ``--`` spellings of this parser's JSON flags."""
        self._subcommands: list[argparse.Action] = []
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        return self.record(super().add_argument(*args, **kwargs))

    def add_subparsers(self, **kwargs: Any) -> Any:
        action = super().add_subparsers(**kwargs)
        self._subcommands.append(action)
        return action

    def record(self, action: argparse.Action) -> argparse.Action:
        """Note ``action`` if it is a JSON flag; returns it."""
        if action.metavar == JSON_METAVAR:
            self.json_flags.update(s for s in action.option_strings if s.startswith("--"))
        return action

    def _json_flags(self) -> set[str]:
        flags: set[str] = set()
        parsers: list[argparse.ArgumentParser] = [self]
        while parsers:
            p = parsers.pop()
            if isinstance(p, FlexibleArgumentParser):
                flags |= p.json_flags
                for sub in p._subcommands:
                    # A subparsers action's choices: its command name -> parser.
                    parsers.extend(dict(sub.choices or {}).values())
        return flags

    def error(self, message: str) -> NoReturn:
        """One line, exit code 2 (no usage dump)."""
        self.exit(2, f"{self.prog}: error: {message}\n")

    # typeshed overloads parse_known_args on the namespace's type; this one
    # signature serves both (argparse's own is untyped).
    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        argv = sys.argv[1:] if args is None else list(args)
        return super().parse_known_args(fold_dotted_args(argv, self._json_flags()), namespace)


def record_argument(parser: argparse.ArgumentParser, action: argparse.Action) -> argparse.Action:
    """Record ``action``, added to one of ``parser``'s argument groups, with
    ``parser`` (a ``FlexibleArgumentParser`` folds the dotted keys of the JSON
    flags it knows); returns it. Flags added through the parser itself are
    recorded already."""
    if isinstance(parser, FlexibleArgumentParser):
        parser.record(action)
    return action
