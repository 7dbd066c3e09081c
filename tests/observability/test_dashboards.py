"""The chart's Grafana dashboards: every query parses (promtool) and names only
metrics that a real engine and gateway of `pdfleet up` expose, or that the
operator defines in code."""

from __future__ import annotations

import json

from promql import DASHBOARDS, check_parses, dashboard_exprs, dashboard_panels


def test_the_chart_has_the_fleet_engine_and_kv_dashboards():
    titles = {json.loads(p.read_text())["title"] for p in DASHBOARDS}
    assert titles == {"pdfleet / Fleet", "pdfleet / Engine", "pdfleet / KV transfer"}
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        assert board["uid"] == path.stem
        panels = [p for p in dashboard_panels(board) if p["type"] != "row"]
        assert len(panels) >= 8, path.name
        for panel in panels:
            assert panel["targets"] and panel["description"], (path.name, panel["title"])


def test_every_dashboard_query_parses_with_promtool(tmp_path):
    exprs = [e for _, _, e in dashboard_exprs()]
    assert len(exprs) > 50
    check_parses(exprs, tmp_path)


def test_dashboard_queries_name_only_metrics_pdfleet_exports(exported):
    from promql import metric_names

    known = set().union(*exported.values())
    # The scrape saw the engines' KV-transfer and the gateway's series.
    assert "pdfleet_engine_kv_transfer_seconds_bucket" in exported["engine"]
    assert "pdfleet_gateway_fallbacks_total" in exported["gateway"]
    used = set()
    for board, title, expr in dashboard_exprs():
        names = metric_names(expr)
        assert names, (board, title, expr)
        unknown = names - known
        assert not unknown, f"{board} / {title}: {sorted(unknown)} not exported by pdfleet"
        used |= names
    # Each dashboard family shows up: gateway, engine, KV transfer and autoscaler series.
    for prefix in (
        "pdfleet_gateway_",
        "pdfleet_engine_kv_",
        "pdfleet_engine_",
        "pdfleet_autoscaler_",
    ):
        assert any(n.startswith(prefix) for n in used), prefix


def test_metric_name_extraction_skips_functions_labels_and_keywords():
    from promql import metric_names

    expr = (
        'histogram_quantile(0.9, sum by (le, pod) (rate(a_bucket{x="y", le="1.0"}[5m])))'
        " / on (pod) group_left (role) b_total > bool 1e9 and c unless d offset 5m"
    )
    assert metric_names(expr) == {"a_bucket", "b_total", "c", "d"}
