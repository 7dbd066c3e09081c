"""Installs the outside tools the suite runs (helm and kubectl, checkov,
vllm-router) into build/, as their tests would on first use.

``make test`` runs this beside lint, so a fresh clone's test run does not wait
for the installs. Each tool is installed by the same function its tests call,
which reuses what is there; one that cannot be installed here is left to its
tests, which skip saying why.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.checkov_tool import checkov_python
from helpers.helm_tool import helm_binary
from helpers.vllm_router import install_vllm_router


def main() -> int:
    failed = 0
    for name, install in (
        ("helm", helm_binary),
        ("checkov", checkov_python),
        ("vllm-router", install_vllm_router),
    ):
        start = time.monotonic()
        try:
            install()
        except BaseException as e:  # pytest.skip's exception is a BaseException
            failed += 1
            print(f"{name}: not installed ({type(e).__name__}: {e})", flush=True)
            continue
        print(f"{name}: ready ({time.monotonic() - start:.1f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
