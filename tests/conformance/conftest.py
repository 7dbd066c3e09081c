"""One `pdfleet serve` and one `pdfleet up` P/D fleet for the whole conformance
suite: every case runs against both, with the official `openai` client.

Both serve the tiny model (the server with ``--reasoning-parser qwen3``) with a
generation-config default of
``DEFAULT_MAX_TOKENS`` output tokens (``--override-generation-config``), so a
request without ``max_tokens`` proves that default wins over the context.
The fleet runs NIXL between two prefill engines and one decode engine,
``Always`` disaggregated: every request that can take two legs does. Its prefill
engines pull cached prefixes from each other (``peerPull``): the gateway may run
a prefill leg on the engine that does not hold the prompt's prefix, which pulls
it first (``test_fleet_peer_pulls.py``); every case's answer must be the same.
Its prefill engines compute at most ``PREFILL_BUDGET`` tokens a step. The
fleet's engines read a step-delay file (empty: no delay) that a test may fill to
slow their steps, as a loaded host or a slower device would (``fleet_step_delay``).
"""

from __future__ import annotations

import json

import openai
import pytest
from helpers.fleet import ENGINE_ARGS
from helpers.server import ServerProcess, fleet_token
from helpers.up import Up, fleet_spec

from pdfleet.engine.testing_hooks import FAULT_STEP_DELAY_ENV

DEFAULT_MAX_TOKENS = 24
PREFILL_BUDGET = 64
"""Tokens one step of a fleet's prefill engine computes at most (its
maxNumBatchedTokens): a 320-token prefix takes five steps to compute, so a
prefill leg that pulls it from a busy holder (the holder's step in progress
and its next one) can be sooner than one that recomputes it."""


@pytest.fixture(scope="session")
def _processes(tiny_model, tmp_path_factory):
    """The server and the fleet, started together (their start-ups overlap) on
    first use and stopped at the session's end."""
    logs = tmp_path_factory.mktemp("conformance")
    server = ServerProcess(
        [
            "serve",
            tiny_model,
            *ENGINE_ARGS,
            "--override-generation-config",
            json.dumps({"max_new_tokens": DEFAULT_MAX_TOKENS}),
            # The tiny model never thinks: its chat answers must pass through whole.
            "--reasoning-parser",
            "qwen3",
        ],
        logs,
        "serve",
    )
    spec = fleet_spec(
        tiny_model,
        disaggregation={"mode": "Always"},
        prefill={
            "replicas": 2,
            "peerPull": True,
            "engine": {"maxNumBatchedTokens": PREFILL_BUDGET},
        },
    )
    spec["spec"]["engine"]["overrideGenerationConfig"] = {"max_new_tokens": DEFAULT_MAX_TOKENS}
    step_delay = logs / "step_delay"
    up = Up(spec, logs, "fleet", env={FAULT_STEP_DELAY_ENV: str(step_delay)})
    try:
        server.wait_healthy(300)
        up.wait_ready(300)
        yield {"serve": server.url, "fleet": up.url, "up": up, "step_delay": step_delay}
    finally:
        server.stop()
        up.stop()


@pytest.fixture(scope="session")
def serve_url(_processes) -> str:
    return _processes["serve"]


@pytest.fixture(scope="session")
def fleet_url(_processes) -> str:
    return _processes["fleet"]


@pytest.fixture(scope="session")
def fleet_up(_processes) -> Up:
    """The fleet's `pdfleet up` (its engines' addresses)."""
    return _processes["up"]


@pytest.fixture
def fleet_step_delay(_processes):
    """Sets the seconds each step of the fleet's engines sleeps first, and the
    seconds per scheduled token their forward passes take longer, for the test;
    no delay again after it."""
    path = _processes["step_delay"]

    def delay(seconds: float, per_token: float = 0.0) -> None:
        path.write_text(f"{seconds} {per_token}\n")

    try:
        yield delay
    finally:
        path.write_text("")


@pytest.fixture(params=["serve", "fleet"])
def target(request) -> str:
    """The base URL of the engine, or of the fleet's gateway."""
    return request.getfixturevalue(f"{request.param}_url")


@pytest.fixture
def client(target) -> openai.OpenAI:
    # The fleet token: the engine requires it; the fleet's gateway has no keys.
    return openai.OpenAI(
        base_url=target + "/v1", api_key=fleet_token() or "none", max_retries=0, timeout=120
    )
