"""The engine image has what Triton needs at run time (a C compiler and the
Python headers) and checks it at build time. No Docker daemon runs here: the
Dockerfile is parsed, and its build-time check is run on this machine."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "engine.Dockerfile"
CHECK = ROOT / "docker" / "check_triton_toolchain.py"


def run_instructions(text: str) -> list[str]:
    """The Dockerfile's RUN instructions, continuation lines joined."""
    joined = re.sub(
        r"\\\n",
        " ",
        "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")),
    )
    return [line[4:] for line in joined.splitlines() if line.startswith("RUN ")]


def apt_packages(text: str) -> set[str]:
    packages: set[str] = set()
    for run in run_instructions(text):
        for command in re.split(r"&&|;", run):
            words = command.split()
            if words[:2] == ["apt-get", "install"]:
                packages |= {w for w in words[2:] if not w.startswith("-")}
    return packages


def test_engine_image_installs_a_c_compiler_and_the_python_headers():
    packages = apt_packages(DOCKERFILE.read_text())
    assert {"gcc", "libc6-dev", "python3-dev", "python3-venv"} <= packages, packages


def test_engine_image_checks_the_triton_toolchain_after_installing_pdfleet():
    text = DOCKERFILE.read_text()
    assert "COPY docker/check_triton_toolchain.py docker/" in text
    (install,) = [r for r in run_instructions(text) if '".[engine]"' in r]
    assert install.index('".[engine]"') < install.index("python docker/check_triton_toolchain.py")


def test_toolchain_check_passes_here_and_fails_without_a_compiler(tmp_path):
    pytest.importorskip("triton")
    ok = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert "toolchain: ok" in ok.stdout
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc")}
    bad = subprocess.run(
        [sys.executable, str(CHECK)], capture_output=True, text=True, timeout=120, env=env
    )
    assert bad.returncode == 1
    assert "cannot build its launchers" in bad.stderr
