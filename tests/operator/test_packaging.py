"""The operator's packaging: no torch on its import path, non-root images."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile

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
    assert ")[operator]" in operator and "[engine" not in operator
    assert "ARG BASE_IMAGE" in (ROOT / "docker" / "engine.Dockerfile").read_text()


def test_the_operator_image_ships_no_autoscaling_lab_and_runs_without_it(tmp_path):
    # The wheel stage of docker/operator.Dockerfile, run here on a copy of the
    # sources (pip without build isolation: no network in tests).
    dockerfile = (ROOT / "docker" / "operator.Dockerfile").read_text()
    stage = dockerfile.split(" AS wheel", 1)[1].split("\nFROM ", 1)[0]
    (build,) = [line[4:] for line in stage.splitlines() if line.startswith("RUN ")]
    assert "rm -rf operator/autoscaling_lab" in build
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py"):
        shutil.copy(ROOT / name, src / name)
    for name in ("engine", "kernels", "operator"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    build = build.replace("pip wheel", f"{sys.executable} -m pip wheel --no-build-isolation -q")
    build = build.replace("/wheels", str(tmp_path / "wheels"))
    subprocess.run(build, shell=True, cwd=src, check=True, timeout=300)  # noqa: S602 (runs the Dockerfile's own build line)
    (wheel,) = (tmp_path / "wheels").glob("pdfleet-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "pdfleet/operator/autoscaling/policy.py" in names
    assert not [n for n in names if "autoscaling_lab" in n]
    installed = tmp_path / "installed"
    zipfile.ZipFile(wheel).extractall(installed)
    # Only the wheel and the third-party packages on the path (python -S: no
    # .pth, so not the checkout the development install maps pdfleet to).
    code = (
        "import sys\n"
        "sys.path[:0] = sys.argv[1:3]\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('pdfleet.operator.autoscaling_lab') is None\n"
        "import pdfleet.operator.handlers, pdfleet.operator.operator_cmd\n"
        "import pdfleet.operator.local.cli, pdfleet.operator.cluster_autoscaler\n"
        "from pdfleet.engine.cli import main\n"
        "assert main(['crd']) == 0\n"
        "assert main(['sim', '--matrix', '2']) == 2\n"
    )
    site = sysconfig.get_paths()["purelib"]
    result = subprocess.run(
        [sys.executable, "-S", "-c", code, str(installed), site],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "pdfleet sim: error: pdfleet.operator.autoscaling_lab is not installed" in result.stderr


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
