"""Every kernel compiles for Hopper (sm_90) with its launcher's real launch
configuration, checked without a GPU (see hopper_compile.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
# The most shared memory one block may use on an H100/H200 (227 KiB).
MAX_SHARED_BYTES = 232448


@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build ships no ptxas")
def test_every_kernel_compiles_for_hopper_within_shared_memory_and_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("hopper_compile.py"))],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    errors = [f"{r['case']} {r['kernel']}: {r['error']}" for r in rows if "error" in r]
    assert not errors, "\n".join(errors)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {r["kernel"] for r in rows} == {
        "_prefill_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_rms_norm_kernel",
        "_rotary_kernel", "_store_kv_kernel", "_silu_and_mul_kernel",
    }  # fmt: skip
    for r in rows:
        assert r["shared_bytes"] <= MAX_SHARED_BYTES, r
        # Spills on the half-precision paths would cost speed; float32 (a
        # correctness path on GPUs, with 3xTF32 dots) may spill a little.
        if r["case"] != "float32":
            assert r["stack"] == 0 and r["local"] == 0, r
