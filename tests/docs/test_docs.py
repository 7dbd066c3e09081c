"""The docs are tested: every code block of README.md and docs/*.md runs against
a live fleet or is marked illustrative, and the CLI and the docs agree.

Cheap checks over every block, whatever its marks: the info string follows the
convention, every `pdfleet ...` command line (in blocks and in inline code)
parses with the real CLI parser, every Python block compiles, every YAML or
JSON block parses (an InferenceService, or a part of one, through the resource
model; an engines file or a tenants file through the gateway's parser). Then each runnable block
runs against one `pdfleet up` fleet of the tiny model (``doc_fleet``), its
address and model directory substituted for the docs' (docs/testing.md,
"The docs are tested", says how to mark a block).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from helpers import doc_blocks as docs

from pdfleet.engine.cli import build_parser

BLOCKS = docs.all_blocks()
RUNNABLE = [
    b for b in BLOCKS if b.runs and not b.problems and b.lang != "yaml" and b.lang != "json"
]
SLOW_ENV = "PDFLEET_SLOW_DOC_TESTS"
# Seconds one block may run (the tiny fleet answers in well under a second).
BLOCK_TIMEOUT = 180


def report(problems: list[str], what: str) -> str:
    return f"{len(problems)} {what} (fix the docs or the code; {docs.CONVENTION}):\n" + "\n".join(
        f"  {p}" for p in problems
    )


def test_every_block_says_what_it_is():
    problems = [
        f"{b.where}: the ```{b.lang} block {'; '.join(b.problems)}; {b.hint()}"
        for b in BLOCKS
        if b.problems
    ]
    assert not problems, report(problems, "blocks without a valid info string")


def test_every_pdfleet_command_line_parses_with_the_real_cli():
    parser = build_parser()
    problems = []
    for b in BLOCKS:
        if b.lang not in docs.SHELL:
            continue
        for line, command in docs.shell_commands(b):
            for argv in docs.pdfleet_argv(command) or []:
                error = docs.check_command(parser, argv)
                if error:
                    problems.append(f"{b.path}:{line}: `pdfleet {' '.join(argv)}`: {error}")
    for path in docs.doc_files():
        for where, command in docs.inline_commands(path):
            for argv in docs.pdfleet_argv(command) or []:
                error = docs.check_reference(parser, argv)
                if error:
                    problems.append(f"{where}: `{command}`: {error}")
    assert not problems, report(problems, "pdfleet command lines the CLI refuses")


def test_every_python_block_compiles():
    problems = []
    for b in BLOCKS:
        if b.lang == "python":
            try:
                compile(b.text, b.where, "exec")
            except SyntaxError as e:
                problems.append(f"{b.where}: line {e.lineno} of the block: {e.msg}")
    assert not problems, report(problems, "Python blocks that do not compile")


def test_every_yaml_and_json_block_parses_and_resources_validate():
    from pdfleet.engine.gateway.discovery import parse_engines
    from pdfleet.engine.gateway.flow.tenants import Tenants
    from pdfleet.operator.local.cli import default_service
    from pdfleet.operator.resource import InferenceServiceSpec, load_inference_service

    spec_fields = {f.alias or name for name, f in InferenceServiceSpec.model_fields.items()}
    problems = []
    for b in BLOCKS:
        if b.lang not in ("yaml", "json"):
            continue
        try:
            data = json.loads(b.text) if b.lang == "json" else yaml.safe_load(b.text)
        except (ValueError, yaml.YAMLError) as e:
            problems.append(f"{b.where}: does not parse: {str(e).splitlines()[0]}")
            continue
        if not isinstance(data, dict):
            continue
        try:
            if "engines" in data:
                parse_engines(data, b.where)
            elif "tenants" in data and "spec" not in data:
                Tenants.parse(data, b.where)  # a gateway's tenants file
            elif "spec" in data or set(data) <= spec_fields:
                part = data.get("spec", data) if "kind" not in data else data["spec"]
                service = default_service()
                merge(service["spec"], part)
                load_inference_service(service)
        except Exception as e:  # the resource model's or the parser's error, shown as is
            problems.append(f"{b.where}: {type(e).__name__}: {str(e)[:400]}")
    assert not problems, report(problems, "YAML/JSON blocks that do not parse or validate")


def merge(base: dict[str, Any], part: dict[str, Any]) -> None:
    """Mutates: ``part`` laid over ``base`` (mappings merged, anything else replaced)."""
    for key, value in part.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value


OUTPUT_FLAGS = frozenset({"--out", "--json", "--out-file", "--output", "--plot", "-o"})
REPO_FOLDERS = ("benchmarks/", "examples/", "docker/", "charts/")


def test_repository_paths_named_by_commands_exist():
    """A command that runs a benchmark, builds a Dockerfile or reads an example
    names a file that is there (output paths aside)."""
    problems = []
    for b in BLOCKS:
        if b.lang not in docs.SHELL:
            continue
        for line, command in docs.shell_commands(b):
            tokens = command.replace("[", " ").replace("]", " ").split()
            for before, token in zip(["", *tokens], tokens, strict=False):
                if (
                    token.startswith(REPO_FOLDERS)
                    and before not in OUTPUT_FLAGS
                    and not (docs.ROOT / token).exists()
                ):
                    problems.append(f"{b.path}:{line}: {token} does not exist")
    assert not problems, report(problems, "commands naming files that are not there")


# -- runnable blocks, against the live fleet ---------------------------------------------


def substituted(text: str, fleet: Any) -> str:
    for address in docs.DOC_ADDRESSES:
        prefix = "http://" if address.startswith("http") else ""
        text = text.replace(address, prefix + fleet.url.removeprefix("http://"))
    return re.sub(r"\b(MODEL_DIR|MODEL)\b", fleet.model_dir, text)


@pytest.mark.parametrize("block", RUNNABLE, ids=[b.where for b in RUNNABLE])
def test_runnable_block_runs_against_the_test_fleet(block, doc_fleet, tmp_path):
    if "slow" in block.marks and os.environ.get(SLOW_ENV) != "1":
        pytest.skip(f"marked slow: runs with {SLOW_ENV}=1")
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(substituted(block.text, doc_fleet))
        command = [sys.executable, "-P", str(script)]
    else:
        command = ["bash", "-euo", "pipefail", "-c", substituted(docs.run_script(block), doc_fleet)]
    try:
        done = subprocess.run(
            command,
            cwd=doc_fleet.cwd,
            env=doc_fleet.env,
            capture_output=True,
            text=True,
            timeout=BLOCK_TIMEOUT,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"{block.where}: the ```{block.lang} block ran past {BLOCK_TIMEOUT}s; {block.hint()}"
        )
    output = (done.stdout + done.stderr).strip()
    assert done.returncode == 0, (
        f"{block.where}: the ```{block.lang} block failed (exit {done.returncode}) against the "
        f"test fleet at {doc_fleet.url}:\n{output[-2000:]}\n-> fix the docs or the code; "
        f"{block.hint()}"
    )


def test_the_harness_sees_blocks_of_every_kind():
    """The extraction itself: fences in lists, info strings, runnable or not."""
    kinds = {(b.lang, b.runs) for b in BLOCKS}
    assert ("python", True) in kinds and ("text", False) in kinds
    assert any(b.lang in docs.SHELL and b.runs for b in BLOCKS), "no runnable shell block"
    assert Path(docs.ROOT / "docs" / "testing.md").read_text().count("illustrative") >= 1
