"""pdfleet's own Python processes, started from the checkout's root, import
installed packages, not the checkout's top-level folders (engine/contracts/launch.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

from pdfleet.engine.contracts.launch import python_module

ROOT = Path(__file__).resolve().parents[2]


def _where(tmp_path: Path, module: str) -> subprocess.CompletedProcess[str]:
    """Run, with python_module() from the checkout's root, a probe that
    imports ``module`` and prints its file."""
    (tmp_path / "probe_import.py").write_text(
        f"import {module}\nprint({module}.__file__)\n", encoding="utf-8"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run(
        python_module("probe_import"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_child_started_from_the_checkout_imports_the_installed_kernels_package(tmp_path):
    # The checkout's kernels/ (pdfleet.kernels once installed) is what `python
    # -m` from here would put first; transformers imports the installed one.
    assert (ROOT / "kernels" / "__init__.py").is_file()
    if importlib.util.find_spec("kernels") is None:
        pytest.skip("no installed `kernels` package for the checkout to hide")
    done = _where(tmp_path, "kernels")
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()).resolve() != (ROOT / "kernels" / "__init__.py"), done.stdout


def test_a_child_started_from_the_checkout_loads_transformers_models(tmp_path):
    """transformers 5.25 imports `kernels` with its model classes: with the
    checkout first on sys.path every engine's model load failed ("cannot
    import name 'CUDAProperties' from 'kernels'")."""
    done = _where(tmp_path, "transformers.models.llama.modeling_llama")
    assert done.returncode == 0, done.stderr[-2000:]


def test_pdfleet_starts_no_python_child_without_the_helper():
    # Every `sys.executable` argv in the shipped code goes through
    # python_module() (or names -P itself): a new bare `python -m` would bring
    # the shadowing back for whoever runs pdfleet from a checkout.
    offenders = []
    for folder in ("engine", "operator"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            for number, line in enumerate(text.splitlines(), 1):
                if "sys.executable" in line and "-P" not in line:
                    offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert offenders == []
