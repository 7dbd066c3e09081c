"""The chart's monitoring objects: dashboards ConfigMap for the Grafana sidecar,
PrometheusRule only where the Prometheus Operator is, PodMonitors off by default."""

from __future__ import annotations

import json

import yaml
from helpers.helm_tool import helm
from promql import CHART, DASHBOARDS, RULES

PROMETHEUS_OPERATOR = (
    "--api-versions",
    "monitoring.coreos.com/v1/PrometheusRule",
    "--api-versions",
    "monitoring.coreos.com/v1/PodMonitor",
)


def render(*flags: str) -> list[dict]:
    out = helm("template", "demo", str(CHART), "--namespace", "ops", *flags)
    return [d for d in yaml.safe_load_all(out) if d]


def kinds(objects: list[dict]) -> list[str]:
    return [o["kind"] for o in objects]


def test_dashboards_configmap_carries_every_dashboard_for_the_sidecar():
    (cm,) = [
        o for o in render() if o["kind"] == "ConfigMap" and "dashboards" in o["metadata"]["name"]
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["annotations"]["grafana_folder"] == "pdfleet"
    assert set(cm["data"]) == {p.name for p in DASHBOARDS}
    for path in DASHBOARDS:
        assert json.loads(cm["data"][path.name]) == json.loads(path.read_text())
    relabelled = render("--set", "dashboards.label=my_dash", "--set", "dashboards.labelValue=yes")
    cm = next(o for o in relabelled if o["metadata"]["name"].endswith("-dashboards"))
    assert cm["metadata"]["labels"]["my_dash"] == "yes"
    assert "ConfigMap" not in kinds(render("--set", "dashboards.enabled=false"))


def test_prometheus_rule_only_where_the_prometheus_operator_is():
    assert "PrometheusRule" not in kinds(render())
    objects = render(*PROMETHEUS_OPERATOR, "--set", "prometheusRule.labels.release=kps")
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert rule["metadata"]["labels"]["release"] == "kps"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
    off = render(*PROMETHEUS_OPERATOR, "--set", "prometheusRule.enabled=false")
    assert "PrometheusRule" not in kinds(off)


def test_pod_monitors_are_off_by_default_and_label_role_and_service():
    assert "PodMonitor" not in kinds(render(*PROMETHEUS_OPERATOR))
    objects = render(
        "--set",
        "podMonitor.enabled=true",
        "--set",
        "podMonitor.bearerTokenSecret.name=metrics-token",
        "--set",
        "podMonitor.namespaces={ml}",
    )
    fleets, operator = [o for o in objects if o["kind"] == "PodMonitor"]
    assert fleets["spec"]["namespaceSelector"] == {"matchNames": ["ml"]}
    (endpoint,) = fleets["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["credentials"] == {"name": "metrics-token", "key": "token"}
    targets = {r["targetLabel"] for r in endpoint["relabelings"]}
    assert targets == {"pdsvc", "pdfleet_role"}  # what the dashboards and alerts group by
    assert operator["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
