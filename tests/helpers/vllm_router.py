"""vLLM's own router (``vllm-router``, the PyPI package) in a cached venv under build/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROUTER_VENV = ROOT / "build" / "vllm-router-venv"
ROUTER_BIN = ROUTER_VENV / "bin" / "vllm-router"


def install_vllm_router() -> Path:
    """The router's binary, installed once (bounded); skips the test if it cannot be had."""
    if ROUTER_BIN.exists():
        return ROUTER_BIN
    try:
        subprocess.run([sys.executable, "-m", "venv", str(ROUTER_VENV)], check=True, timeout=120)
        subprocess.run(
            [str(ROUTER_VENV / "bin" / "pip"), "install", "-q", "vllm-router"],
            check=True,
            timeout=600,
            capture_output=True,
        )
    except (subprocess.SubprocessError, OSError) as e:
        pytest.skip(f"vllm-router could not be installed ({type(e).__name__}: {e})")
    if not ROUTER_BIN.exists():
        pytest.skip("the vllm-router package installed no vllm-router binary")
    return ROUTER_BIN
