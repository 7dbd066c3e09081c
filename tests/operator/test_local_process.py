"""Children of the local fleet die with their supervisor, however it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from helpers.server import wait_until
from helpers.up import is_dead

from pdfleet.operator.local.process import Child, spawn

# A supervisor that starts a long sleep through spawn() from a thread that then
# ends (as drains and autoscaler steps do), prints its pid and waits.
SUPERVISOR = """
import subprocess, sys, threading, time
from pdfleet.operator.local.process import spawn
pids = []
t = threading.Thread(target=lambda: pids.append(spawn([sys.executable, "-P", "-c",
    "import time; time.sleep(120)"]).pid))
t.start(); t.join()
print(pids[0], flush=True)
time.sleep(120)
"""


def test_a_child_outlives_the_thread_that_asked_for_it_but_not_a_sigkilled_supervisor():
    supervisor = subprocess.Popen(
        [sys.executable, "-P", "-c", SUPERVISOR], stdout=subprocess.PIPE, text=True
    )
    try:
        line = [None]
        reader = threading.Thread(target=lambda: line.__setitem__(0, supervisor.stdout.readline()))
        reader.start()
        reader.join(60)
        child = int(line[0])
        # The thread that called spawn() is gone; the child is not.
        assert not wait_until(lambda: is_dead(child), 1.0, 0.1)
        supervisor.send_signal(signal.SIGKILL)
        supervisor.wait(10)
        assert wait_until(lambda: is_dead(child), 10.0, 0.05), "orphaned child still runs"
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait(10)


def test_spawn_runs_the_command_with_the_given_environment(tmp_path):
    out = tmp_path / "out"
    proc = spawn(
        [sys.executable, "-P", "-c", f"import os; open({str(out)!r}, 'w').write(os.environ['X'])"],
        env={**os.environ, "X": "from-spawn"},
    )
    assert proc.wait(30) == 0
    assert out.read_text() == "from-spawn"


def test_a_childs_startup_runs_from_its_launch_to_ready_and_restarts_with_it(tmp_path):
    child = Child("decode-0", "decode", [sys.executable, "-P", "-c", "pass"], 1, tmp_path / "log")
    child.start()
    assert child.startup_seconds is None  # not ready yet
    child.mark_ready()
    assert child.ready and child.ready_at is not None
    assert child.startup_seconds == child.ready_at - child.started_at >= 0
    child.proc.wait(10)
    child.start()  # a restart: a new startup, unknown until ready again
    assert not child.ready and child.startup_seconds is None
    child.proc.wait(10)
