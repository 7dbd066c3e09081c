"""How pdfleet starts its own Python processes (engines, the gateway, its
workers, model preparation).

``python -m`` puts the current directory first on ``sys.path``. Started from
a checkout of this repository, that shadows installed packages with the
checkout's top-level folders: ``kernels/`` (pdfleet's Triton kernels, which
the installed package calls ``pdfleet.kernels``) hides Hugging Face's
``kernels`` package, which transformers (5.25 on) imports whenever it is
installed, so every model load failed with ``cannot import name
'CUDAProperties' from 'kernels'``. ``-P`` (Python 3.11's safe path) leaves
the current directory out; tests/engine/test_launch.py starts children
from the checkout's root and checks.
"""

from __future__ import annotations

import sys


def python_module(module: str, *args: str) -> list[str]:
    """argv that runs ``module`` as ``__main__`` in this interpreter, with the
    current directory kept off ``sys.path``."""
    return [sys.executable, "-P", "-m", module, *args]
