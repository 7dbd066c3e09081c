"""The pdfleet command: help, config printing and one-line errors."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from pdfleet.engine.contracts.launch import python_module

PDFLEET = python_module("pdfleet.engine.cli")


def run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*PDFLEET, *argv], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize(
    "argv", [["--help"], ["serve", "--help"], ["config", "--help"], ["tiny-model", "--help"]]
)
def test_help(argv):
    out = run(*argv)
    assert out.returncode == 0, out.stderr
    assert "usage: pdfleet" in out.stdout


def test_a_named_command_gets_its_parser_alone_and_every_other_argv_the_whole_one():
    from pdfleet.engine import cli

    for argv, command in [
        (["serve", "m", "--port", "1"], "serve"),
        (["--log-level", "DEBUG", "gateway", "--decode", "x"], "gateway"),
        (["--log-level=DEBUG", "up"], "up"),
        (["--help"], None),
        (["--version", "serve"], None),
        (["nonsense", "serve"], None),
        ([], None),
    ]:
        assert cli._command_of(argv) == command, argv

    def commands(parser) -> set[str]:
        return set(next(a for a in parser._actions if a.dest == "command").choices)

    assert commands(cli.build_parser("serve")) == {"serve"}
    assert commands(cli.build_parser()) >= set(cli.COMMANDS)


def test_serve_help_documents_engine_flags():
    out = run("serve", "--help").stdout
    assert "--max-num-batched-tokens" in out and "--kv-transfer-config" in out
    assert "chunked prefill budget" in out  # the field docstring is the help text


def test_config_prints_resolved_json_for_an_absent_device(tiny_model):
    out = run(
        "config",
        tiny_model,
        "--device",
        "cuda",
        "--max-num-seqs",
        "256",
        "--max-num-batched-tokens",
        "8K",
        "--usage-context",
        "server",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["device_config"]["device"] == "cuda"
    assert data["scheduler_config"]["max_num_batched_tokens"] == 8192
    assert data["compilation_config"]["cudagraph_capture_sizes"][-1] == 512
    assert len(data["compute_hash"]) == 10


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--max-num-batched-tokens", "8", "--max-num-seqs", "16"], "max_num_seqs (16)"),
        (["--max-loras", "2"], "--max-loras needs --enable-lora"),
        (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype"),
        (["--kv-transfer-config", "{oops"], "invalid JSON"),
    ],
)
def test_config_errors_are_one_line_with_exit_code_2(tiny_model, argv, needle):
    out = run("config", tiny_model, *argv)
    assert out.returncode == 2
    assert needle in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_config_without_torch_importable(tiny_model, tmp_path):
    # The operator image has no torch; config resolution must still work.
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'triton'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [*PDFLEET, "config", tiny_model, "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["model_config"]["dtype"] == "bfloat16"
