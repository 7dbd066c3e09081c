"""The doc-test harness itself (tests/helpers/doc_blocks.py): what it reads of
Markdown, and that it refuses what the CLI refuses."""

from __future__ import annotations

import pytest
from helpers import doc_blocks as docs

from pdfleet.engine.cli import build_parser

PAGE = """# A page

```sh
pdfleet up --port 8001 \\
    --run-dir runs   # a comment
curl -sf localhost:8000/health
```

1. In a list:

   ```python illustrative
   print("hi")
   ```

```console
$ pdfleet status --run-dir runs
ENGINE  ROLE
```

```
no language
```

```sh someday
echo
```

Inline: `pdfleet sim --matrix 10` and `pdfleet sim --no-such-flag`.
"""


@pytest.fixture(scope="module")
def parser():
    return build_parser()


def test_blocks_their_lines_languages_and_marks(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    found = docs.blocks(page)
    assert [(b.line, b.lang, b.marks) for b in found] == [
        (3, "sh", set()),
        (11, "python", {"illustrative"}),
        (15, "console", set()),
        (20, "", set()),
        (24, "sh", {"someday"}),
    ]
    sh, python, console, bare, marked = found
    assert sh.runs and not python.runs and python.text == 'print("hi")\n'
    assert docs.shell_commands(sh) == [
        (4, "pdfleet up --port 8001 --run-dir runs   # a comment"),
        (6, "curl -sf localhost:8000/health"),
    ]
    assert docs.run_script(console) == "pdfleet status --run-dir runs\n"
    assert bare.problems == ["has no language"] and "illustrative" in bare.hint()
    assert "unknown marks" in marked.problems[0]
    assert list(docs.inline_commands(page)) == [
        (f"{page}:28", "pdfleet sim --matrix 10"),
        (f"{page}:28", "pdfleet sim --no-such-flag"),
    ]


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("pdfleet up [FILE.yaml] [--port N] [--stall-timeout S]", None),
        ("pdfleet bench --url URL [--concurrency N | --request-rate R] [--json out.json]", None),
        ("pdfleet status [--run-dir DIR | --namespace NS] [--watch [SECONDS]]", None),
        ("pdfleet status [--watch [SECONDS]] [--run-dir DIR]", None),
        ("pdfleet status --watch", None),
        ("pdfleet status --watch inf", "not a finite number"),
        ("pdfleet status --watch 0", "out of range"),
        ("pdfleet sim --trace burst|steady|diurnal|heavytail", None),
        ("pdfleet crd | kubectl apply -f -", None),
        ("OTEL_X=1 pdfleet serve MODEL_DIR [engine flags] --port 8101 &", None),
        ("pdfleet status --whatch 2", "unrecognized arguments: --whatch"),
        ("pdfleet sim --trace burst|sometimes", "'sometimes' is not one of"),
        ("pdfleet bench --url U --concurrency many", "invalid literal for int()"),
        ("pdfleet gateway --decode http://e --served-model-names x", "unrecognized"),
        ("pdfleet launch", "invalid choice: 'launch'"),
    ],
)
def test_command_lines_are_parsed_by_the_real_cli(parser, line, error):
    problems = [docs.check_command(parser, argv) for argv in docs.pdfleet_argv(line) or []]
    if error is None:
        assert problems and problems == [None] * len(problems)
    else:
        assert any(p and error in p for p in problems), problems


def test_inline_mentions_name_real_subcommands_and_flags(parser):
    assert docs.check_reference(parser, ["sim", "--matrix"]) is None
    assert docs.check_reference(parser, ["serve"]) is None  # a name, not a command line
    assert "no flag --interval-s" in docs.check_reference(parser, ["status", "--interval-s"])
    assert "no subcommand" in docs.check_reference(parser, ["deploy"])


def test_a_bare_optional_value_is_checked_as_documented(parser):
    """``--watch [SECONDS]`` documents the bare ``--watch`` too: both forms are
    parsed, so a flag whose bare form the CLI refuses is caught."""
    import argparse

    variants = docs._expand_synopsis(["status", "[--watch", "[SECONDS]]", "[--run-dir", "DIR]"])
    assert ["status", "--watch", "--run-dir", "DIR"] in variants
    assert ["status", "--watch", "SECONDS", "--run-dir", "DIR"] in variants
    broken = argparse.ArgumentParser(prog="pdfleet")
    sub = broken.add_subparsers().add_parser("status")
    sub.add_argument("--watch", nargs="?", type=float, const="interval")
    sub.add_argument("--run-dir")
    assert "invalid float value" in (
        docs.check_command(broken, ["status", "[--watch", "[SECONDS]]", "[--run-dir", "DIR]"]) or ""
    )
