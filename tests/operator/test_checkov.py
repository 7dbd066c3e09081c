"""Security posture of what pdfleet puts in a cluster, checked with a real checkov.

Both the Helm chart (the operator) and the fleets the operator renders for the
examples must pass every checkov Kubernetes check except the few below,
each skipped for a stated reason (docs/operator.md repeats them).
"""

from __future__ import annotations

import subprocess

import pytest
from helpers.checkov_tool import checkov, failed
from helpers.helm_tool import ROOT

from pdfleet.engine.contracts.launch import python_module

# Check id -> why it does not apply. Anything else that fails is a regression.
NOT_APPLICABLE = {
    "CKV_K8S_21": "the namespace is the release's or the resource's; a render has to pick one",
    "CKV_K8S_43": "images are the user's choice (values.image, spec.image); a digest works there",
    "CKV_K8S_15": "pull policy IfNotPresent keeps locally loaded images (kind) usable",
    "CKV_K8S_38": "the operator and the gateway call the Kubernetes API, so they need a token "
    "(engine pods mount none)",
}
# Every pod of a fleet, engines included, is covered by a NetworkPolicy
# (CKV2_K8S_6): the fleets get no skip beyond the chart's.
FLEET_NOT_APPLICABLE = NOT_APPLICABLE


EXAMPLES = [
    "inferenceservice-cpu.yaml",
    "inferenceservice-llama-3.1-8b.yaml",
    "inferenceservice-hf.yaml",
    "inferenceservice-tp.yaml",
]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[str, dict]:
    """One checkov run over the chart (helm) and the fleets of every example
    (kubernetes, a file each): framework -> report."""
    folder = tmp_path_factory.mktemp("fleets")
    renders = {
        example: subprocess.Popen(
            [*python_module("pdfleet.engine.cli"), "render", str(ROOT / "examples" / example)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for example in EXAMPLES
    }
    for example, render in renders.items():
        stdout, stderr = render.communicate(timeout=120)
        assert render.returncode == 0, stderr
        (folder / example).write_text(stdout)
    assert FLEET_NOT_APPLICABLE == NOT_APPLICABLE  # one run: one skip list
    return checkov({"helm": ROOT / "charts" / "pdfleet", "kubernetes": folder}, NOT_APPLICABLE)


def test_the_chart_passes_checkov(reports):
    report = reports["helm"]
    assert failed(report) == []
    assert report["summary"]["passed"] >= 90


def _of_file(checks: list[dict], example: str) -> list[dict]:
    return [c for c in checks if c["file_path"].endswith("/" + example)]


@pytest.mark.parametrize("example", EXAMPLES)
def test_rendered_fleets_pass_checkov(example, reports):
    results = reports["kubernetes"]["results"]
    report = {"results": {"failed_checks": _of_file(results["failed_checks"], example)}}
    assert failed(report) == []
    assert len(_of_file(results["passed_checks"], example)) >= 200
