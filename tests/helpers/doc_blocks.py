"""The code blocks and command lines of README.md and docs/*.md, for the doc tests.

The marking convention (docs/testing.md, "The docs are tested"): a fenced
block's info string is its language, then marks::

    ```sh                 runs against the test fleet (its commands)
    ```sh illustrative    shown, never run (placeholders, a cluster, a GPU, minutes)
    ```sh slow            runs only with PDFLEET_SLOW_DOC_TESTS=1
    ```text               not code: output, a formula, a diagram (never run)

Whatever the marks, every ``pdfleet`` command line is parsed by the real CLI
parser, every Python block compiled, every YAML or JSON block parsed (a YAML
InferenceService, or a part of one, checked by the resource model).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL = frozenset({"sh", "bash", "console", "shell"})
LANGUAGES = SHELL | {"python", "yaml", "json", "text"}
MARKS = frozenset({"illustrative", "slow"})
CONVENTION = "docs/testing.md, 'The docs are tested'"
# The test fleet's address and model stand in for the docs' (runnable blocks only).
DOC_ADDRESSES = ("http://127.0.0.1:8000", "http://localhost:8000", "localhost:8000")
PLACEHOLDER = re.compile(r"\b[A-Z][A-Z0-9_]*[A-Z0-9]\b|\b[A-Z]\b")
_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)(?P<info>.*)$")
_INLINE = re.compile(r"(?<!`)`(pdfleet [^`\n]+)`(?!`)")


@dataclass
class Block:
    path: str
    """Relative to the repository root."""
    line: int
    """1-based line of the opening fence."""
    lang: str
    marks: set[str]
    text: str
    problems: list[str] = field(default_factory=list)
    """What is wrong with its info string."""

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.lang != "text" and "illustrative" not in self.marks

    def hint(self) -> str:
        lang = self.lang if self.lang in LANGUAGES and self.lang != "text" else "sh"
        return (
            f"if it cannot run against the test fleet, mark it ```{lang} illustrative "
            f"(or ```text for output and diagrams; {CONVENTION})"
        )


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file (indented fences in lists too)."""
    rel = _name(path)
    lines = path.read_text().split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info").strip()
        start = i
        body: list[str] = []
        i += 1
        while i < len(lines) and not re.match(rf"^\s*{re.escape(fence)}\s*$", lines[i]):
            line = lines[i]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            i += 1
        i += 1
        words = info.split()
        lang = words[0].lower() if words else ""
        block = Block(rel, start + 1, lang, set(words[1:]), "\n".join(body) + "\n")
        if not lang:
            block.problems.append("has no language")
        elif lang not in LANGUAGES:
            block.problems.append(f"has language {lang!r} (known: {', '.join(sorted(LANGUAGES))})")
        unknown = block.marks - MARKS
        if unknown:
            block.problems.append(f"has unknown marks {sorted(unknown)} (known: {sorted(MARKS)})")
        out.append(block)
    return out


def all_blocks() -> list[Block]:
    return [b for path in doc_files() for b in blocks(path)]


def inline_commands(path: Path) -> Iterator[tuple[str, str]]:
    """(``path:line``, command) of every inline code span that starts with ``pdfleet ``,
    outside fenced blocks."""
    rel = _name(path)
    fenced = False
    for n, line in enumerate(path.read_text().split("\n"), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            for m in _INLINE.finditer(line):
                yield f"{rel}:{n}", m.group(1)


# -- shell text -------------------------------------------------------------------------


def shell_commands(block: Block) -> list[tuple[int, str]]:
    """(line, command) of a shell block: continuations joined, ``$ `` prompts
    taken (a console block's other lines are output), comments kept."""
    lines = block.text.rstrip("\n").split("\n")
    console = block.lang == "console" or any(ln.startswith("$ ") for ln in lines)
    out: list[tuple[int, str]] = []
    pending: list[str] = []
    first = 0
    for n, raw in enumerate(lines, block.line + 1):
        line = raw
        if not pending:
            if console:
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            first = n
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            pending.append(stripped[:-1])
            continue
        pending.append(line)
        command = " ".join(p.strip() for p in pending).strip()
        pending = []
        if command:
            out.append((first, command))
    return out


def run_script(block: Block) -> str:
    """The block as a bash script (a console block: its ``$ `` commands)."""
    if block.lang == "console" or block.text.startswith("$ "):
        return "\n".join(cmd for _, cmd in shell_commands(block)) + "\n"
    return block.text


def pdfleet_argv(command: str) -> list[list[str]] | None:
    """The argument lists of the ``pdfleet`` invocations of one shell command line
    (pipes and ``&&`` split it; env assignments and ``&`` dropped); None when
    it names no ``pdfleet`` command."""
    found: list[list[str]] = []
    for segment in _segments(command):
        try:
            tokens = shlex.split(segment, comments=True)
        except ValueError:
            tokens = segment.split()
        while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", tokens[0]):
            tokens = tokens[1:]
        if tokens and tokens[-1] == "&":
            tokens = tokens[:-1]
        if tokens and tokens[0] in ("$",):
            tokens = tokens[1:]
        if tokens and (tokens[0] == "pdfleet" or tokens[0].endswith("/bin/pdfleet")):
            found.append(tokens[1:])
    return found or None


def _segments(command: str) -> list[str]:
    """``command`` split at `` | ``, `` || ``, `` && `` and `` ; `` outside ``[...]``
    (inside, ``|`` separates a usage line's alternatives)."""
    out, depth, start, i = [], 0, 0, 0
    while i < len(command):
        ch = command[i]
        depth += ch == "["
        depth -= ch == "]"
        if depth == 0:
            m = re.match(r"\s(\|\||&&|\||;)\s", command[i:])
            if m:
                out.append(command[start:i])
                i += m.end()
                start = i
                continue
        i += 1
    out.append(command[start:])
    return out


# -- parsing with the real CLI -------------------------------------------------------------


def _parser_for(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)parser the leading subcommand words of ``argv`` select."""
    current = parser
    for token in argv:
        subs = [a for a in current._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or token not in subs[0].choices:
            break
        current = subs[0].choices[token]
    return current


def _sample(action: argparse.Action, value: str) -> str:
    """A valid stand-in for a placeholder value (``N``, ``SECONDS``, ``FILE.yaml``)."""
    if action.choices:
        return str(next(iter(action.choices)))
    kind = action.type
    for candidate in ("1", "1.0", value):
        if kind is None or not callable(kind):
            return value
        try:
            kind(candidate)
            return candidate
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            continue
    return value


def _expand_synopsis(tokens: list[str]) -> list[list[str]]:
    """A usage line's variants: ``[...]`` groups opened, ``a | b`` inside a group
    giving one variant each, an optional value (``[SECONDS]``) both given and
    left out, prose groups (``[engine flags]``) and ``...`` dropped."""
    text = " ".join(tokens)
    variants = [text]
    group = re.compile(r"\[([^\[\]]*)\]")
    for _ in range(20):  # innermost groups first
        new: list[str] = []
        changed = False
        for v in variants:
            m = group.search(v)
            if not m:
                new.append(v)
                continue
            changed = True
            inner = m.group(1).strip()
            if re.fullmatch(r"[a-z][a-z ]*", inner) and " " in inner:
                new.append(v[: m.start()] + v[m.end() :])  # prose: "engine flags"
                continue
            if PLACEHOLDER.fullmatch(inner):
                # An optional value ("--watch [SECONDS]"): the bare flag is a
                # documented form too, so it is parsed as well.
                new.append(v[: m.start()] + v[m.end() :])
            for alternative in re.split(r"\s\|\s", inner):
                new.append(v[: m.start()] + alternative + v[m.end() :])
        variants = new
        if not changed:
            break
    out = []
    for v in variants:
        split = [t for t in v.split() if t not in ("...", "…")]
        out.append(split)
    return out


def check_command(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """Parse ``argv`` (after ``pdfleet``) with the real parser, placeholders replaced
    by valid values of the flag they stand for and ``a|b`` choices checked one by
    one; the parser's error, or None."""
    for variant in _expand_synopsis(argv):
        problem = _check_variant(parser, variant)
        if problem is not None:
            return problem
    return None


def _check_variant(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    sub = _parser_for(parser, argv)
    actions = sub._option_string_actions
    fixed: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        flag, eq, inline = token.partition("=")
        action = actions.get(flag) if token.startswith("-") else None
        takes = action is not None and action.nargs != 0
        if action is not None and takes and not eq and i + 1 < len(argv):
            value = argv[i + 1]
            if not value.startswith("--"):
                i += 1
                alternatives = value.split("|") if "|" in value and "://" not in value else [value]
                if action.choices:
                    bad = [a for a in alternatives if a not in action.choices]
                    if bad and all(not PLACEHOLDER.fullmatch(a) for a in bad):
                        return (
                            f"{flag}: {bad[0]!r} is not one of {sorted(map(str, action.choices))}"
                        )
                value = alternatives[0]
                if PLACEHOLDER.search(value) and value != value.lower():
                    value = _sample(action, value)
                fixed += [flag, value]
                i += 1
                continue
        if (
            action is not None
            and takes
            and not eq
            and i + 1 == len(argv)
            and action.nargs in ("?", "*")
        ):
            # A flag named without its value (a usage line "--watch [SECONDS]").
            fixed.append(token)
            i += 1
            continue
        if "|" in token and not token.startswith("-") and "://" not in token.split("|")[0]:
            token = token.split("|")[0]
        fixed.append(token if not eq else f"{flag}={inline}")
        i += 1
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(fixed)
    except SystemExit as e:
        if e.code in (0, None):  # --help
            return None
        message = err.getvalue().strip().splitlines()
        return message[-1] if message else f"exit {e.code}"
    return None


def check_reference(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """An inline mention (`pdfleet sim --matrix`): the subcommand exists and
    every ``--flag`` named is one of its flags."""
    sub = _parser_for(parser, argv)
    if sub is parser:
        return f"no subcommand {argv[0]!r}" if argv else "no subcommand"
    for token in argv:
        flag = token.partition("=")[0]
        if flag.startswith("--") and flag not in sub._option_string_actions:
            return f"{sub.prog}: no flag {flag}"
    return None
