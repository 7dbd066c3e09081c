"""The Helm chart, checked with a real helm binary (lint + template)."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml
from helpers.helm_tool import ROOT, helm
from helpers.kube_schema import validate

from pdfleet.engine.cli import build_parser

CHART = ROOT / "charts" / "pdfleet"


def render(*flags: str) -> list[dict]:
    out = helm("template", "demo", str(CHART), "--namespace", "ops", *flags)
    return [d for d in yaml.safe_load_all(out) if d]


def test_helm_lint_passes_in_both_modes():
    helm("lint", "--strict", str(CHART))
    helm("lint", "--strict", str(CHART), "--set", "namespaced=true")


@pytest.mark.parametrize(
    "flags", [(), ("--set", "namespaced=true", "--set", "watchNamespaces={a,b}")]
)
def test_rendered_objects_are_valid_kubernetes(flags):
    objects = render("--include-crds", *flags)
    assert objects
    for obj in objects:
        validate(obj)


def test_operator_runs_one_replica_recreated_with_kopf_liveness():
    deployment = next(o for o in render() if o["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["securityContext"]["runAsNonRoot"] is True
    # The command is a valid pdfleet command line.
    args = build_parser().parse_args(container["command"][1:])
    assert args.command == "operator" and args.namespace == []
    assert args.default_image == "pdfleet:0.1.0"


def test_rbac_is_least_privilege_and_namespaced_mode_needs_no_cluster_role():
    cluster = render()
    (role,) = [o for o in cluster if o["kind"] == "ClusterRole"]
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert "delete" not in rule["verbs"]  # children go by garbage collection
    namespaced = render("--set", "namespaced=true", "--set", "watchNamespaces={a,b}")
    kinds = [(o["kind"], o["metadata"].get("namespace")) for o in namespaced]
    assert ("Role", "a") in kinds and ("RoleBinding", "b") in kinds
    assert not any(k in ("ClusterRole", "ClusterRoleBinding") for k, _ in kinds)
    deployment = next(o for o in namespaced if o["kind"] == "Deployment")
    args = build_parser().parse_args(
        deployment["spec"]["template"]["spec"]["containers"][0]["command"][1:]
    )
    assert args.namespace == ["a", "b"]


def test_every_values_key_has_a_comment():
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[A-Za-z]\w*:", line):
            assert i > 0 and lines[i - 1].startswith("#"), f"values.yaml: no comment above {line!r}"


def test_chart_templates_use_the_namespaced_helpers():
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    for name in ("name", "fullname", "chart", "labels", "selectorLabels"):
        assert f'define "pdfleet.{name}"' in helpers


def test_notes_render(tmp_path):
    # helm renders NOTES.txt only on install (which needs a cluster): render a copy.
    chart = tmp_path / "pdfleet"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
    (chart / "templates" / "notes.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
        'data: {notes: {{ tpl (.Files.Get "notes.txt") . | quote }}}\n'
    )
    out = helm("template", "demo", str(chart), "--show-only", "templates/notes.yaml")
    out = yaml.safe_load(out)["data"]["notes"]
    assert "watches InferenceServices in every namespace" in out
    assert "kubectl wait pdsvc/tiny" in out
