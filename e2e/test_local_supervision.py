"""`pdfleet up` as a supervisor: what its children get, and that they die with it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess

import pytest
from helpers.server import wait_until
from helpers.up import (
    Up,
    fleet_spec,
    is_dead,
    listening_addresses,
    process_argv,
    process_environ,
)

from pdfleet.engine.contracts.launch import python_module


def nothing_listens(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) != 0


def kv_config(argv: list[str]) -> dict:
    if "--kv-transfer-config" not in argv:
        return {}
    return json.loads(argv[argv.index("--kv-transfer-config") + 1])


@pytest.fixture
def up(tiny_model, tmp_path):
    # Keys as a person types them: a stray blank and a newline.
    fleet = Up(fleet_spec(tiny_model), tmp_path, env={"PDFLEET_API_KEY": " ka,\nkb "})
    pids: list[int] = []
    try:
        fleet.wait_ready()
        pids = fleet.child_pids()
        yield fleet, pids
    finally:
        for pid in pids:  # only if the test failed: never leave a child behind
            if not is_dead(pid):
                os.kill(pid, signal.SIGKILL)
        fleet.stop()


def test_children_get_the_fleet_credentials_bind_loopback_and_die_with_a_sigkilled_up(up):
    fleet, pids = up
    assert len(pids) == 3, pids  # prefill, decode, gateway
    ports = set()
    for pid in pids:
        env = process_environ(pid)
        # The session's secret (conftest sets it) reaches every child unchanged.
        assert env["PDFLEET_FLEET_SECRET"] == os.environ["PDFLEET_FLEET_SECRET"]
        argv = process_argv(pid)
        # One canonical list, split the same way everywhere, for the gateway only:
        # engines get no client key (pdfleet up --direct-engine-access gives them).
        engine = "gateway" not in argv
        assert env["PDFLEET_API_KEY"] == ("" if engine else "ka,kb")
        http = int(argv[argv.index("--port") + 1])
        listening = listening_addresses(pid)
        assert http in {port for _, port in listening}
        # --host 127.0.0.1 (the default): HTTP, the side channel and UCX on loopback only.
        assert {addr for addr, _ in listening} == {"127.0.0.1"}, listening
        kv = kv_config(argv)
        if kv.get("kv_role") == "kv_producer":  # the prefill engine serves the side channel
            assert kv["kv_port"] in {port for _, port in listening}
        # Every port a child listens on (UCX's included) must be free afterwards.
        ports |= {port for _, port in listening}
    assert fleet.port in ports
    # Its sample requests carry the key header, never a key (two keys: a placeholder).
    assert wait_until(lambda: "Ctrl-C stops" in fleet.output(), 30.0, 0.1)
    printed = fleet.output()
    assert printed.count('-H "Authorization: Bearer $KEY"') == 2
    assert "set KEY to one of the API keys in PDFLEET_API_KEY" in printed
    assert "warning: no API key" not in printed
    assert "memory: " in printed and " GiB resident in all" in printed

    # SIGKILL: the supervisor gets no chance to stop anything itself.
    os.kill(fleet.proc.pid, signal.SIGKILL)
    fleet.proc.wait(10)
    assert wait_until(lambda: all(is_dead(p) for p in pids), 20.0, 0.1), [
        p for p in pids if not is_dead(p)
    ]
    assert wait_until(lambda: all(nothing_listens(p) for p in ports), 10.0, 0.1)
    # Its run still says "ready" in fleet.json, but `pdfleet status` knows better.
    status = subprocess.run(
        [*python_module("pdfleet.engine.cli"), "status", "--run-dir", str(fleet.run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 3, status.stderr  # 3: a stopped fleet
    lines = status.stdout.splitlines()
    assert lines[0].endswith(" stopped"), lines
    assert all(" stopped " in line for line in lines if line.startswith(("prefill-", "decode-")))
