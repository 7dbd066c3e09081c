"""matplotlib for the `--plot` options of `pdfleet bench` and `pdfleet sim`.

Torch-free and importing nothing else of pdfleet, so both the engine's
benchmark and the operator's simulator use this one loader."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """matplotlib's pyplot on the headless Agg backend, or a ValueError saying
    what to install."""
    try:
        import matplotlib
    except ImportError:
        raise ValueError(
            "--plot needs matplotlib: pip install 'pdfleet[plot]' (or matplotlib>=3.10)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
