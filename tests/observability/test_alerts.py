"""The chart's alert rules: valid for promtool, unit-tested with `promtool test
rules`, each with a severity and a runbook section in docs/observability.md,
naming only metrics that pdfleet (or kube-state-metrics) exports."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml
from promql import CHART, RULES, metric_names, promtool, rule_exprs

HERE = Path(__file__).parent
DOC = CHART.parents[1] / "docs" / "observability.md"
# Crash loops are seen by kube-state-metrics, not by the crashing process.
KUBE_STATE_METRICS = {
    "kube_pod_container_status_restarts_total",
    "kube_pod_container_status_waiting_reason",
}
ALERTS = {
    "PdfleetPDDegraded",
    "PdfleetKVPullSlow",
    "PdfleetKVLeaseExpiries",
    "PdfleetKVCacheSaturated",
    "PdfleetAutoscalerAtMaxMissingSLO",
    "PdfleetEngineCrashLooping",
}


def test_rules_file_passes_promtool_check():
    out = subprocess.run(
        [promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_alert_rules_pass_their_promtool_unit_tests(tmp_path):
    tests = yaml.safe_load((HERE / "alerts.test.yaml").read_text())
    tests["rule_files"] = [str(RULES)]
    path = tmp_path / "alerts.test.yaml"
    path.write_text(yaml.safe_dump(tests))
    out = subprocess.run(
        [promtool(), "test", "rules", str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    # Every alert is exercised, firing at least once.
    fired = {
        t["alertname"]
        for case in tests["tests"]
        for t in case["alert_rule_test"]
        if t["exp_alerts"]
    }
    assert fired == ALERTS


def test_every_alert_has_severity_and_a_runbook_section():
    doc = DOC.read_text()
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", doc, re.M)
    }
    groups = yaml.safe_load(RULES.read_text())["groups"]
    alerts = [r for g in groups for r in g["rules"] if "alert" in r]
    assert {r["alert"] for r in alerts} == ALERTS
    for rule in alerts:
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        runbook = rule["annotations"]["runbook"]
        page, _, anchor = runbook.partition("#")
        assert page == "docs/observability.md" and anchor in anchors, (rule["alert"], runbook)


def test_alert_rules_name_only_exported_metrics(exported):
    known = set().union(*exported.values()) | KUBE_STATE_METRICS
    for alert, expr in rule_exprs():
        names = metric_names(expr)
        assert names and not names - known, f"{alert}: {sorted(names - known)}"
