"""glibc malloc settings for CPU engines.

A CPU engine allocates and frees tens of megabytes per layer per step
(activations, gathered K/V). With glibc's defaults, freed memory at the top of
the heap is returned to the kernel as soon as it exceeds 128 KiB and the
largest blocks are mmap'ed afresh each time, so every step faults the same
pages in again: on the offline benchmark's model that was millions of minor
page faults and a quarter of the wall time in the kernel
(``docs/engine.md``, "CPU memory allocator").

``tune()`` keeps freed memory in the process instead (``mallopt``: no trim
below 2 GiB, large blocks from the heap, heap growth padded). The price is
that the process's resident memory stays at its peak, so the runner tunes
only once the model is loaded and its KV cache allocated, after
:func:`release` has handed the loader's temporaries back (a dequantized
tensor's float32 copy: ~110 MB for SmolLM2), and steps alone set the peak.
It does nothing when
``PDFLEET_CPU_MALLOC_TUNING=0``, when another allocator is preloaded
(``LD_PRELOAD`` with tcmalloc, jemalloc or mimalloc), or off glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

TRIM_THRESHOLD = (1 << 31) - 1  # an int: mallopt's largest value
TOP_PAD = 256 << 20
MMAP_THRESHOLD = 1 << 30

_PRELOADED = ("tcmalloc", "jemalloc", "mimalloc")
_done: bool | None = None


def release() -> bool:
    """Hand the free memory at the heaps' tops back to the kernel (``malloc_trim``);
    True when it was done (glibc only)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True


def tune() -> bool:
    """Apply the settings once per process; True when they are in effect."""
    global _done
    if _done is not None:
        return _done
    _done = _apply()
    return _done


def _apply() -> bool:
    if os.environ.get("PDFLEET_CPU_MALLOC_TUNING", "1").strip().lower() in ("0", "false", "no"):
        logger.info("CPU malloc tuning disabled by PDFLEET_CPU_MALLOC_TUNING")
        return False
    preload = os.environ.get("LD_PRELOAD", "")
    if any(name in preload for name in _PRELOADED):
        logger.info("CPU malloc tuning skipped: %s is preloaded", preload)
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD),
        )
    )
    if ok:
        logger.info("CPU malloc tuned: freed memory stays in the process (no per-step page faults)")
    else:
        logger.warning("CPU malloc tuning was refused by this libc; running with its defaults")
    return ok
