"""A real checkov (the security-posture scanner) in its own virtual environment.

checkov pins many packages of its own, so it never goes into the project's
venv: it is installed once into build/tools/checkov-<version>/ with pip and
reused. Without network the tests that need it skip, saying why.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from .helm_tool import TOOLS, helm_binary

VERSION = "3.3.30"
VENV = TOOLS / f"checkov-{VERSION}"
READY = VENV / ".installed"


def checkov_python() -> pathlib.Path:
    python = VENV / "bin" / "python"
    if READY.exists():
        return python
    shutil.rmtree(VENV, ignore_errors=True)  # a half-made one from an interrupted run
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(VENV)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        # The project venv's pip installs into the tool venv (it has no pip of its own).
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "--python",
                str(python),
                "install",
                "--quiet",
                # Byte-compiling all of checkov's dependencies costs more than the
                # install itself; the modules a scan imports compile on first use.
                "--no-compile",
                f"checkov=={VERSION}",
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        output = getattr(e, "stderr", b"") or b""
        shutil.rmtree(VENV, ignore_errors=True)
        pytest.skip(f"cannot install checkov {VERSION}: {output.decode()[-300:]}")
    READY.write_text(VERSION)
    return python


def helm_on_path() -> pathlib.Path:
    """A folder holding ``helm`` (checkov runs it by that name)."""
    folder = VENV / "helm-bin"
    folder.mkdir(exist_ok=True)
    link = folder / "helm"
    if not link.exists():
        link.symlink_to(helm_binary())
    return folder


def checkov(scans: dict[str, pathlib.Path], skip: dict[str, str]) -> dict[str, dict]:
    """Run one checkov over ``scans``: framework -> the directory it scans
    (``helm``: a chart; ``kubernetes``: a folder of manifests).

    One process for every scan: checkov's start alone takes seconds. Each
    framework only picks up what it understands (the helm runner charts, the
    kubernetes runner manifests), and its results are those of a run of it
    alone. ``skip`` maps check ids to the reason they do not apply; returns
    framework -> checkov's JSON report (summary and results).
    """
    args = [str(checkov_python()), "-m", "checkov.main", "--framework", *scans]
    for target in scans.values():
        args += ["-d", str(target)]
    args += ["--output", "json", "--skip-download", "--compact"]
    if skip:
        args += ["--skip-check", ",".join(sorted(skip))]
    env = {
        **os.environ,
        # helm for the helm framework: the same binary the chart tests use.
        "PATH": f"{helm_on_path()}{os.pathsep}{os.environ.get('PATH', '')}",
        "BC_SKIP_MAPPING": "TRUE",  # no attempt to fetch guideline links
    }
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    if out.returncode not in (0, 1):  # 1: some check failed
        raise RuntimeError(f"checkov exited {out.returncode}: {out.stderr[-2000:]}")
    # stdout holds one JSON document per report, or lists of them (the helm
    # runner can print its report once more on its own): the last one of
    # each framework is the run's.
    reports: dict[str, dict] = {}
    decoder, text, at = json.JSONDecoder(), out.stdout, 0
    while text[at:].strip():
        at += len(text[at:]) - len(text[at:].lstrip())
        doc, at = decoder.raw_decode(text, at)
        for report in doc if isinstance(doc, list) else [doc]:
            reports[report["check_type"]] = report
    missing = set(scans) - set(reports)
    assert not missing, f"checkov reported nothing for {missing}: {out.stderr[-2000:]}"
    return reports


def failed(report: dict) -> list[str]:
    return [f"{c['check_id']} {c['resource']}" for c in report["results"]["failed_checks"]]
