"""PromQL helpers for the dashboard and alert tests: the expressions of the
chart's dashboards and rules, their metric names, and `promtool` parsing."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "pdfleet"
DASHBOARDS = sorted((CHART / "dashboards").glob("*.json"))
RULES = CHART / "alerts" / "pdfleet.rules.yaml"

# Grafana's variables, replaced by values Prometheus accepts.
GRAFANA_VARS = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$ttft_slo": "1.0",
    "$namespace": ".*",
    "$pdsvc": ".*",
    "$role": ".*",
}
KEYWORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan", "atan2",
}  # fmt: skip


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (make test installs Debian's prometheus package)")
    return path


def dashboard_panels(board: dict) -> Iterator[dict]:
    for panel in board.get("panels", []):
        yield panel
        yield from panel.get("panels", [])  # panels of a collapsed row


def dashboard_exprs() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL with Grafana's variables replaced)."""
    out = []
    for path in DASHBOARDS:
        board = json.loads(path.read_text())
        for panel in dashboard_panels(board):
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], substitute(target["expr"])))
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                m = re.fullmatch(r"label_values\((\w+), *(\w+)\)", var["query"]["query"])
                assert m, f"{path.name}: variable {var['name']}: unexpected query"
                out.append((path.name, f"variable {var['name']}", m.group(1)))
    return out


def rule_exprs() -> list[tuple[str, str]]:
    """(alert name, PromQL) of every rule in the chart's rules file."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [(r.get("alert") or r["record"], r["expr"]) for g in groups for r in g["rules"]]


def substitute(expr: str) -> str:
    # Longest names first: $__rate_interval before $__range.
    for name in sorted(GRAFANA_VARS, key=len, reverse=True):
        expr = expr.replace(name, GRAFANA_VARS[name])
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (not functions, labels or keywords)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", "{}", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", "", s)  # range and subquery selectors
    s = re.sub(
        r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1", s
    )  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.:])([A-Za-z_:][\w:]*)(?!\w)", s):
        name = m.group(1)
        rest = s[m.end() :].lstrip()
        # A function call, or an aggregation whose label list comes first.
        if name.lower() in KEYWORDS or rest.startswith("(") or re.match(r"(by|without)\b", rest):
            continue
        names.add(name)
    return names


def check_parses(exprs: list[str], tmp: Path) -> None:
    """Every expression parses: each becomes a recording rule for `promtool check rules`."""
    rules = [{"record": f"pdfleet:check:{i}", "expr": e} for i, e in enumerate(exprs)]
    path = tmp / "exprs.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "check", "rules": rules}]}))
    out = subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in out.stdout


def exposed_names(text: str) -> set[str]:
    """Every sample name a Prometheus text exposition can produce (from its TYPE lines)."""
    names = set()
    for m in re.finditer(r"^# TYPE (\S+) (\w+)$", text, re.M):
        name, kind = m.groups()
        if kind == "counter":
            base = name.removesuffix("_total")
            names |= {base + "_total", base + "_created"}
        elif kind in ("histogram", "summary"):
            names |= {name + s for s in ("_bucket", "_sum", "_count", "_created")}
        else:
            names.add(name)
    return names
