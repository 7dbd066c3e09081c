"""Build-time check that Triton can compile its kernel launchers in this image.

Triton builds a small C launcher (including ``Python.h``) the first time each
kernel runs, with the system C compiler. An image without a compiler or the
Python headers starts, then crashes on the first Triton launch (start-up
profiling, on CUDA). This compiles a C extension the way Triton does and
imports it; it exits non-zero if that fails. See docs/gpu.md.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

from triton.runtime.build import _build

SOURCE = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "pdfleet_toolchain_check", NULL, -1};
PyMODINIT_FUNC PyInit_pdfleet_toolchain_check(void) { return PyModule_Create(&module); }
"""


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "check.c"
        src.write_text(SOURCE)
        try:
            so = _build("pdfleet_toolchain_check", str(src), tmp, [], [], [], [])
        except Exception as e:  # no compiler, no headers: say which
            print(f"Triton cannot build its launchers here: {e}", file=sys.stderr)
            return 1
        spec = importlib.util.spec_from_file_location("pdfleet_toolchain_check", so)
        if spec is None or spec.loader is None:
            raise RuntimeError("broken invariant: spec is not None and spec.loader is not None")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    print("Triton launcher toolchain: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
