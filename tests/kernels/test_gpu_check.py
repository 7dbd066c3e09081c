"""benchmarks/gpu_check.py runs end to end in its dry mode (tiny sizes, CPU, interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def test_gpu_check_dry_run_reports_every_section(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--seed", "7", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "engine end-to-end decode" in proc.stdout
    report = json.loads(out.read_text())
    assert report["dry_run"] is True and report["seed"] == 7
    assert report["ceilings"]["copy_GBps"] > 0 and report["ceilings"]["matmul_TFLOPs"] > 0
    checks = report["correctness"]
    names = " ".join(c["check"] for c in checks)
    for kernel in (
        "store_kv", "rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul",
        "paged_prefill_attention", "paged_decode_attention",
    ):  # fmt: skip
        assert kernel in names
    assert all(c["ok"] for c in checks if "skipped" not in c), checks
    assert all(r["GBps"] > 0 and r["pct_of_copy"] > 0 for r in report["decode_attention"])
    assert all(r["TFLOPs"] > 0 for r in report["prefill_attention"])
    assert {r["op"] for r in report["ops"]} >= {"rms_norm", "silu_and_mul", "store_kv"}
    sweep = report["sweep"]
    assert {r["kernel"] for r in sweep} == {"decode", "decode splits", "prefill"}
    assert all(r["value"] > 0 and "error" not in r for r in sweep), sweep
    e2e = report["engine_e2e"]
    assert e2e["status"] == "dry-run"
    assert [r["batch"] for r in e2e["rows"]] == [1, 2]
    # The engine's real decode path ran (model runner, Triton attention, sampling).
    assert all(r["ms_per_step"] > 0 for r in e2e["rows"])
    assert len(report["targets"]) == 3
    # The engine sections: whole-model greedy checks on the fused path, and a P/D pair.
    engine = {r["check"]: r for r in report["engine_checks"]}
    greedy = engine["greedy vs transformers (bf16, same device)"]
    assert greedy["ok"] and greedy["fused_path"] and greedy["prompts"] == 4
    assert engine["triton vs torch backend (bf16)"]["ok"]
    assert "skipped" in engine["CUDA graphs on vs off"]  # no graphs on a CPU
    pd = report["pd_pair"]
    assert pd["ok"] and pd["mismatches"] == 0 and pd["pulls"] >= 1
    assert pd["pull_GBps"] > 0 and pd["pull_ms"] > 0
    assert report["failed"] == []
    markdown = (tmp_path / "gpu_check.md").read_text()
    assert "| batch | context |" in markdown and "### P/D pair" in markdown
