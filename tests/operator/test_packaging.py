"""The operator's packaging: no torch on its import path, non-root images."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_operator_commands_run_without_torch_installed():
    # Torch, triton and transformers made unimportable, as in the operator image.
    code = (
        "import sys\n"
        "for m in ('torch', 'triton', 'transformers'): sys.modules[m] = None\n"
        "from pdfleet.engine.cli import main\n"
        "assert main(['crd']) == 0\n"
        "assert main(['render', sys.argv[1]]) == 0\n"
        "import pdfleet.operator.handlers\n"
    )
    example = ROOT / "examples" / "inferenceservice-cpu.yaml"
    result = subprocess.run(
        [sys.executable, "-P", "-c", code, str(example)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_images_run_as_a_non_root_user_and_the_operator_image_has_no_engine_extra():
    for name in ("engine.Dockerfile", "operator.Dockerfile"):
        text = (ROOT / "docker" / name).read_text()
        users = re.findall(r"^USER\s+(\S+)", text, re.M)
        assert users and users[-1].split(":")[0] not in ("0", "root"), name
    operator = (ROOT / "docker" / "operator.Dockerfile").read_text()
    assert '".[operator]"' in operator and "[engine" not in operator
    assert "ARG BASE_IMAGE" in (ROOT / "docker" / "engine.Dockerfile").read_text()


def test_make_echoes_no_comments_and_the_install_shows_its_progress():
    # -n prints each recipe line make would echo; -B as if nothing were built yet.
    result = subprocess.run(
        ["make", "-n", "-B", "install", "run", "lint", "test"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert not [line for line in lines if line.lstrip().startswith("#")]
    installs = [line for line in lines if "pip install" in line]
    assert len(installs) == 2
    assert not [line for line in installs if " -q" in line or "--quiet" in line]
    steps = [line for line in lines if line.startswith('echo "==> [')]
    assert len(steps) == 3  # one line per install step
