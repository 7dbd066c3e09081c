"""Guards of the repository layout: wheel contents, import contracts, no shadowing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"engine": "pdfleet/engine", "kernels": "pdfleet/kernels", "operator": "pdfleet/operator"}


def test_no_operator_folder_has_an_init_file():
    offenders = [
        str(p.relative_to(ROOT))
        for p in ROOT.rglob("operator/__init__.py")
        if ".venv" not in p.parts and "build" not in p.parts
    ]
    assert offenders == []


def test_operator_import_does_not_shadow_the_stdlib():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import operator, pdfleet.operator.engine_spec; print(operator.add)",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "built-in function add" in out.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(out),
            str(ROOT),
        ],
        check=True,
        timeout=300,
        capture_output=True,
    )
    (path,) = out.glob("pdfleet-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_contains_every_module(wheel):
    names = set(wheel.namelist())
    expected = set()
    for folder, pkg in FOLDERS.items():
        for path in (ROOT / folder).rglob("*"):
            if "__pycache__" in path.parts or not path.is_file():
                continue
            if path.suffix in (".py", ".txt", ".json", ".jinja", ".yaml"):
                expected.add(f"{pkg}/{path.relative_to(ROOT / folder).as_posix()}")
    missing = sorted(expected - names)
    assert not missing, f"missing from the wheel: {missing}"
    assert not any(n.startswith("pdfleet/operator/__init__") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "pdfleet = pdfleet.engine.cli:main" in wheel.read(entry).decode()


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    lint = shutil.which("lint-imports", path=os.path.dirname(sys.executable))
    assert lint, "import-linter is not installed"
    return subprocess.run(
        [lint, "--config", str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )


def _tree(tmp_path: Path, operator_dir: Path | None = None) -> Path:
    pkg = tmp_path / "pdfleet"
    pkg.mkdir()
    for folder in FOLDERS:
        src = ROOT / folder if folder != "operator" or operator_dir is None else operator_dir
        (pkg / folder).symlink_to(src, target_is_directory=True)
    return tmp_path


def test_import_contracts_hold(tmp_path):
    out = _lint_imports(_tree(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert out.stdout.count("KEPT") == len(contracts["contracts"])


def test_import_contracts_catch_an_operator_importing_torch(tmp_path):
    # The contract must be able to fail: an operator module importing torch breaks it.
    op = tmp_path / "operator_copy"
    shutil.copytree(ROOT / "operator", op, ignore=shutil.ignore_patterns("__pycache__"))
    (op / "bad_module.py").write_text("import torch\n")
    tree = tmp_path / "tree"
    tree.mkdir()
    out = _lint_imports(_tree(tree, op))
    assert out.returncode != 0
    assert "pdfleet.operator.bad_module -> torch" in out.stdout


def test_engine_config_imports_without_torch(tmp_path):
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'triton', 'transformers'):\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, _Block())\n"
    )
    code = (
        "import pdfleet.engine.config as c, pdfleet.operator.engine_spec, sys;"
        "assert 'torch' not in sys.modules;"
        "print(c.EngineArgs(max_num_seqs=3).to_cli_args())"
    )
    out = subprocess.run(
        [sys.executable, "-P", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
    )
    assert out.returncode == 0, out.stderr
    assert "--max-num-seqs" in out.stdout


def _tool(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_architecture_doc_draws_the_layers_the_contracts_check():
    tool = _tool("layers_picture")
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert tool.embedded(doc) == tool.picture(), "run tools/layers_picture.py --write"


def test_the_relative_import_rewrite_finds_nothing_left_to_rewrite(tmp_path):
    tool = _tool("relative_imports")
    src = ROOT / "engine" / "gateway" / "x.py"
    new, bare = tool.rewrite(
        src, "from pdfleet.engine.config import A\nfrom pdfleet.engine.gateway.app import B\n"
    )
    assert new == "from ..config import A\nfrom .app import B\n" and bare == []
    assert tool.main(["--check"]) == 0, "run tools/relative_imports.py"


# Modules no layers contract names, each with why that is right. A new module
# lands under a contract (or here, with its reason): this list only shrinks.
UNLAYERED = {
    # The package's docstring, importing nothing: its modules are in the
    # engine's layers one by one.
    "pdfleet.engine.loop": "the engine loop's __init__ (a docstring)",
}

_UNCOVERED = r"""
import re, sys, tomllib
import grimp
contracts = tomllib.load(open(sys.argv[1], "rb"))["tool"]["importlinter"]["contracts"]
named = set()
for c in contracts:
    # The three-package contract names whole packages: it layers nothing inside them.
    if c["type"] != "layers" or len(c["layers"]) == 3 and c["layers"][0] == "pdfleet.operator":
        continue
    for layer in c["layers"]:
        for part in re.split(r"[|:]", layer):
            for container in c.get("containers") or [""]:
                named.add(f"{container}.{part.strip()}" if container else part.strip())
graph = grimp.build_graph("pdfleet", include_external_packages=False)
def covered(module):
    parts = module.split(".")
    return any(".".join(parts[:i]) in named for i in range(2, len(parts) + 1))
print("\n".join(sorted(m for m in graph.modules if m.count(".") >= 2 and not covered(m))))
"""


def test_every_module_is_under_a_layers_contract(tmp_path):
    out = subprocess.run(
        [sys.executable, "-P", "-c", _UNCOVERED, str(ROOT / "pyproject.toml")],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(_tree(tmp_path))},
    )
    assert out.returncode == 0, out.stderr
    uncovered = set(out.stdout.split())
    assert uncovered == set(UNLAYERED), (
        f"modules under no layers contract: {sorted(uncovered - set(UNLAYERED))}; "
        f"covered now, drop from UNLAYERED: {sorted(set(UNLAYERED) - uncovered)}"
    )
