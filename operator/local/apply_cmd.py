"""``pdfleet apply FILE``: apply a changed InferenceService to a running `pdfleet up`.

The file is checked here first (a file that does not parse, breaks a rule or
names another service is refused before the fleet hears of it). It is then
left in the run directory (owner-only) and the supervisor, found through its
``fleet.json`` as `pdfleet status` finds it, gets SIGHUP; the supervisor
plans and rolls (``rollout.py``) and reports in ``fleet.json``, which this
command follows until the rollout is done or failed (bounded by --timeout).
"""

from __future__ import annotations

import argparse
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from .state import (
    APPLY_FILE,
    STATE_FILE,
    STOPPED,
    ApplyRequest,
    find_run,
    read_state,
    supervisor_alive,
    write_private,
)

ACK_SECONDS = 30.0
"""How long the supervisor may take to pick a request up (it checks twice a second)."""


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    parser = sub.add_parser(
        "apply",
        help="apply a changed InferenceService file to a running `pdfleet up` fleet",
        description="Apply a changed InferenceService to the fleet `pdfleet up` runs: engines "
        "whose settings changed are replaced one at a time, decode first (a new engine starts "
        "and becomes ready before an old one drains, a decode engine by migrating its streams), "
        "and replica counts are scaled. Refuses a file for another service, an invalid one, "
        "or a change that needs a new gateway.",
    )
    parser.add_argument("file", metavar="FILE.yaml", help="the changed InferenceService")
    parser.add_argument(
        "--run-dir",
        default="runs",
        help="the `pdfleet up --run-dir` of the fleet, or one run in it (default: runs; "
        "its newest run)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds to wait for the rollout to end (default 1800); the rollout goes on "
        "after this command gives up",
    )
    parser.set_defaults(func=run)
    return parser


def read_resource(path: str) -> dict[str, Any]:
    """The InferenceService document of ``path``, checked (ValueError naming the problem)."""
    from ..resource import KIND, load_inference_service
    from .rollout import service_problems

    service = load_inference_service(path)  # parse errors name the file and field
    problems = service_problems(service)
    if problems:
        raise ValueError(f"{path}: " + "; ".join(problems))
    with open(path) as f:
        (doc,) = [d for d in yaml.safe_load_all(f) if isinstance(d, dict) and d.get("kind") == KIND]
    return doc


def run(args: argparse.Namespace) -> int:
    resource = read_resource(args.file)
    run_dir = find_run(Path(args.run_dir))
    state = read_state(run_dir)
    if not supervisor_alive(state) or state.gateway.state == STOPPED:
        raise ValueError(f"the fleet of {run_dir} is not running (start it with `pdfleet up`)")
    name = resource.get("metadata", {}).get("name")
    if name != state.service:
        raise ValueError(
            f"metadata.name: the fleet in {run_dir} runs {state.service!r}, "
            f"the file is for {name!r}"
        )
    ident = uuid.uuid4().hex
    write_private(run_dir / APPLY_FILE, ApplyRequest(ident, resource).encode())
    if state.supervisor is None:
        raise ValueError(f"{run_dir / STATE_FILE}: supervisor: missing (an older pdfleet up)")
    os.kill(state.supervisor.pid, signal.SIGHUP)
    print(f"pdfleet apply: {args.file} -> {state.service} ({run_dir})", flush=True)
    return follow(run_dir, ident, args.timeout)


def follow(run_dir: Path, ident: str, timeout: float) -> int:
    """Print the rollout's steps as fleet.json lists them; 0 once done, 1 if it
    failed or was refused."""
    start = time.monotonic()
    shown = 0
    while True:
        state = read_state(run_dir)
        apply = state.apply
        if apply is not None and apply.id == ident:
            for line in apply.steps[shown:]:
                print(f"  {line}", flush=True)
            shown = len(apply.steps)
            if apply.state == "done":
                print(f"applied: {apply.message}", flush=True)
                return 0
            if apply.state == "failed":
                print(f"pdfleet apply: failed: {apply.message}", flush=True)
                return 1
        elif time.monotonic() - start > ACK_SECONDS:
            raise ValueError(f"the supervisor of {run_dir} did not take the request")
        if not supervisor_alive(state):
            raise ValueError(f"the supervisor of {run_dir} exited during the rollout")
        if time.monotonic() - start > timeout:
            print(f"pdfleet apply: still rolling after {timeout:.0f}s (see pdfleet status)")
            return 1
        time.sleep(0.25)
