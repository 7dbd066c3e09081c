"""The CPU malloc tuning keeps freed activations in the process (no page faults per step)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# Allocates and frees 48 MiB tensors the way a model step does, in the main thread,
# and reports the minor page faults of 10 rounds after the heap reached its size.
PROBE = r"""
import json, resource, sys, torch
from pdfleet.engine.worker import cpu_allocator
tuned = cpu_allocator.tune() if sys.argv[1] == "tune" else False
def step():
    a = torch.ones(12 << 20)          # 48 MiB
    b = a * 2
    del a, b
for _ in range(8):  # the heap grows to its steady size in the first rounds
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"tuned": tuned, "again": cpu_allocator.tune(), "faults": faults}))
"""


def probe(mode: str, **env: str) -> dict:
    import os

    out = subprocess.run(
        [sys.executable, "-P", "-c", PROBE, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **env},
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_tuning_removes_page_faults_of_repeated_large_allocations():
    plain = probe("plain")
    tuned = probe("tune")
    assert tuned["tuned"] and tuned["again"]
    # 10 rounds x 2 tensors x 48 MiB would be ~240k faults of 4 KiB pages if re-faulted.
    assert plain["faults"] > 50_000, plain
    assert tuned["faults"] < plain["faults"] / 10, (plain, tuned)


def test_disabled_by_environment_or_preloaded_allocator():
    assert probe("tune", PDFLEET_CPU_MALLOC_TUNING="0")["tuned"] is False
    # A preloaded allocator is left alone (the name is all that is checked).
    assert probe("tune", LD_PRELOAD="/nonexistent/libtcmalloc.so")["tuned"] is False


# Under the tuning, 256 MiB freed stays resident until release() trims the heap.
RELEASE = r"""
import json, torch
from pdfleet.engine.worker import cpu_allocator
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
assert cpu_allocator.tune()
a = torch.ones(64 << 20)  # 256 MiB, from the heap under the tuning
del a
kept = rss()
released = cpu_allocator.release()
print(json.dumps({"released": released, "kept": kept, "after": rss()}))
"""


def test_release_hands_back_what_the_tuning_would_keep():
    import os

    out = subprocess.run(
        [sys.executable, "-P", "-c", RELEASE],
        capture_output=True,
        text=True,
        timeout=120,
        env=os.environ,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["released"]
    assert result["kept"] - result["after"] > 200 << 20, result
