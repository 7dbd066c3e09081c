"""One live fleet for the doc tests: `pdfleet up` of the tiny model, served
under the default model's name (`smollm2-135m-instruct`) so the docs' requests
run unchanged but for the address (docs/testing.md, "The docs are tested")."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.up import Up, fleet_spec


@dataclass
class DocFleet:
    url: str
    """The gateway, standing in for http://127.0.0.1:8000."""
    model_dir: str
    """The tiny model, standing in for MODEL and MODEL_DIR."""
    cwd: Path
    """Where blocks run: ``runs`` there is the fleet's run directory's parent."""
    env: dict[str, str]


@pytest.fixture(scope="session")
def doc_fleet(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("doc-fleet")
    spec = fleet_spec(tiny_model)
    spec["metadata"]["name"] = "smollm2"
    spec["spec"]["model"]["name"] = "smollm2-135m-instruct"
    fleet = Up(spec, tmp, name="docs")
    try:
        fleet.wait_ready(240)
        cwd = tmp / "cwd"
        cwd.mkdir()
        (cwd / "runs").symlink_to(fleet.run_dir)
        venv_bin = str(Path(os.sys.executable).parent)
        env = {**os.environ, "PATH": f"{venv_bin}:{os.environ.get('PATH', '')}"}
        for name in ("PDFLEET_API_KEY", "PDFLEET_API_KEY_FILE", "OPENAI_API_KEY"):
            env.pop(name, None)
        yield DocFleet(fleet.url, tiny_model, cwd, env)
    finally:
        fleet.stop()
