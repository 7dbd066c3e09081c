"""Structured outputs cannot exhaust an engine: its grammar memory is bounded in
bytes (measured as the engine process's RSS), oversized constraints are 400s
naming their field, a compile past its budget is stopped (400) while the engine
serves others, and one caller can neither queue compiles without bound (429)
nor take more than its share of the compile workers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import threading

import httpx
import pytest
from helpers.fleet import ENGINE_ARGS, metric
from helpers.server import ServerProcess, fleet_headers, stop_all, wait_until

from pdfleet.engine.config.admission import AdmissionConfig
from pdfleet.engine.entrypoints.openai.grammar_gate import CompileBusy, CompileGate, FairShare
from pdfleet.engine.sampling_params import StructuredOutputsParams as Spec

MiB = 1 << 20
CACHE_BYTES = 32 * MiB
# The RSS engine: big choice lists allowed, the cache small.
RSS_FLAGS = [
    "--max-grammar-choices", "100000", "--max-grammar-chars", "200K",
    "--grammar-cache-bytes", "32M", "--max-grammar-memory-bytes", "32M",
    "--grammar-compile-timeout", "300", "--grammar-compile-workers", "1",
]  # fmt: skip
# The budget engine: a 4-second compile budget (the slow constraint below takes
# over 15 s to compile and serialize here), one compile per caller.
KEYS = ("key-a", "key-b")
BUDGET_FLAGS = [
    "--max-grammar-choices", "100000", "--max-grammar-chars", "2M",
    "--grammar-compile-timeout", "4", "--max-grammar-compiles-per-caller", "1",
    "--grammar-compile-workers", "2", "--api-key", ",".join(KEYS),
]  # fmt: skip


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    """(rss engine, budget engine), started side by side."""
    log_dir = tmp_path_factory.mktemp("grammar-bounds")
    procs = [
        ServerProcess(["serve", tiny_model, *ENGINE_ARGS, *flags], log_dir, name)
        for name, flags in (("rss", RSS_FLAGS), ("budget", BUDGET_FLAGS))
    ]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: p.wait_healthy(180), procs))
        yield procs
    finally:
        stop_all(procs)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def big_choices(seed: int, n: int = 3000) -> list[str]:
    # 3,000 such strings compile to about 26 MiB here (the tiny model's tokenizer).
    return [f"choice number {i + seed * 100_000} with some words" for i in range(n)]


def complete(engine: ServerProcess, key: str | None = None, **body) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key else engine.headers
    return httpx.post(
        engine.url + "/v1/completions",
        json={"model": "tiny", "prompt": "Pick one:", "max_tokens": 2, **body},
        headers=headers,
        timeout=300,
    )


def test_grammar_memory_stays_within_the_cache_bound_in_rss(engines):
    engine, _ = engines
    pid = engine.proc.pid
    assert complete(engine, guided_choice=big_choices(0)).status_code == 200
    baseline = rss_mib(pid)  # the workers started, one big grammar cached
    before = metric(engine.url, "pdfleet_engine_grammar_compiles_total")
    for seed in range(1, 4):  # three more: about 78 MiB of compiled grammars
        resp = complete(engine, guided_choice=big_choices(seed))
        assert resp.status_code == 200, resp.text
        text = resp.json()["choices"][0]["text"]  # two tokens of one of the choices
        assert text and any(c.startswith(text) for c in big_choices(seed)), text
    grown = rss_mib(pid) - baseline
    assert metric(engine.url, "pdfleet_engine_grammar_compiles_total") == before + 3
    assert metric(engine.url, "pdfleet_engine_grammar_cache_bytes") <= CACHE_BYTES
    # Without the bound each grammar stays: about 26 MiB more per request.
    assert grown <= CACHE_BYTES / MiB + 32, f"RSS grew {grown:.0f} MiB over 3 grammars"


@pytest.mark.parametrize(
    ("body", "field", "needle"),
    [
        ({"guided_choice": [f"c{i}" for i in range(100_001)]}, "guided_choice", "choice list"),
        (
            {"structured_outputs": {"choice": [f"c{i}" for i in range(100_001)]}},
            "structured_outputs",
            "choice list",
        ),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "e", "schema": {"enum": list(range(1025))}},
                }
            },
            "response_format",
            "enum values",
        ),
        (
            {"guided_json": {"type": "string", "description": "x" * (128 * 1024)}},
            "guided_json",
            "JSON schema is",
        ),
        ({"guided_regex": "a" * (200 * 1024 + 1)}, "guided_regex", "regex is"),
        ({"guided_grammar": "root ::= " + '"a" ' * 60_000}, "guided_grammar", "grammar is"),
    ],
)
def test_constraints_over_a_bound_are_400s_naming_their_field(engines, body, field, needle):
    engine, _ = engines
    resp = complete(engine, **body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field
    assert error["message"].startswith(f"{field}: ") and needle in error["message"]


def test_a_compile_over_its_budget_is_a_400_and_the_engine_serves_meanwhile(engines):
    _, engine = engines
    slow: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: slow.update(
            r=complete(engine, "key-a", guided_choice=big_choices(9, 20_000))
        )
    )
    thread.start()
    try:
        assert wait_until(
            lambda: (
                metric(engine.url, "pdfleet_engine_grammar_compiles_running") >= 1 or "r" in slow
            ),
            60,
        )
        plain = complete(engine, "key-b", max_tokens=4)
        assert plain.status_code == 200 and "r" not in slow, "served while the compile ran"
    finally:
        thread.join(120)
    resp = slow["r"]
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "guided_choice"
    assert "--grammar-compile-timeout" in resp.json()["error"]["message"]
    assert metric(engine.url, "pdfleet_engine_grammar_compile_timeouts_total") >= 1
    # The killed worker is replaced: the next compile of that caller works.
    assert complete(engine, "key-a", guided_choice=["yes", "no"]).status_code == 200


def test_one_caller_cannot_queue_compiles_past_its_limit_nor_pose_as_another(engines):
    _, engine = engines
    slow: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: slow.update(
            r=complete(engine, "key-a", guided_choice=big_choices(7, 20_000))
        )
    )
    thread.start()
    try:
        assert wait_until(
            lambda: metric(engine.url, "pdfleet_engine_grammar_compiles_running") >= 1, 60
        )
        again = complete(engine, "key-a", guided_choice=["left", "right", "up"])
        assert again.status_code == 429, again.text
        assert again.json()["error"]["param"] == "guided_choice"
        other = complete(engine, "key-b", guided_choice=["left", "right", "down"])
        assert other.status_code == 200, "another caller is not held to the first one's limit"
        # The caller header counts only from the fleet token: a client key sending
        # it is still itself, and hits its own limit.
        posing = httpx.post(
            engine.url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 1, "guided_choice": ["p", "q"]},
            headers={"authorization": "Bearer key-a", "x-pdfleet-caller": "someone-else"},
            timeout=60,
        )
        assert posing.status_code == 429, posing.text
        # The fleet token naming a client (as a gateway does) counts against that client.
        named = httpx.post(
            engine.url + "/v1/completions",
            json={"model": "tiny", "prompt": "x", "max_tokens": 1, "guided_choice": ["p", "r"]},
            headers={**fleet_headers(), "x-pdfleet-caller": "key:another-client"},
            timeout=60,
        )
        assert named.status_code == 200, named.text
    finally:
        thread.join(120)
    assert slow["r"].status_code == 400  # its budget
    assert metric(engine.url, "pdfleet_engine_grammar_compiles_refused_total") >= 2


# -- fair shares, in process -----------------------------------------------------------


def test_fair_share_picks_the_caller_that_used_the_least_compile_time():
    share = FairShare(half_life=60.0)
    share.charge("heavy", 30.0, now=0.0)
    share.charge("light", 1.0, now=0.0)
    waiting = [("heavy", 0), ("light", 1), ("heavy", 2)]
    assert waiting[share.pick(waiting, now=1.0)][0] == "light"
    # Usage decays: a minute later the heavy caller has halved its charge.
    assert share.usage("heavy", now=60.0) == pytest.approx(15.0)
    # Equal usage: first come, first served.
    assert share.pick([("new", 5), ("newer", 6)], now=1.0) == 0


class SlowGrammars:
    """A stand-in GrammarCompiler: each build waits for the test to release it."""

    def __init__(self) -> None:
        self.built: list[str] = []
        self.release: dict[str, threading.Event] = {}

    def lookup(self, spec):
        return None

    def build(self, spec):
        name = spec.regex
        self.release.setdefault(name, threading.Event()).wait(30)
        self.built.append(name)
        return f"compiled {name}"


def test_a_caller_that_keeps_the_worker_busy_yields_it_to_a_waiting_one():
    grammars = SlowGrammars()
    limits = AdmissionConfig(grammar_compile_workers=1, max_grammar_compiles_per_caller=3)

    async def run() -> list[str]:
        gate = CompileGate(lambda: grammars, limits)
        try:
            first = asyncio.ensure_future(gate.compile(Spec(regex="a1"), "heavy"))
            while gate.busy < 1:
                await asyncio.sleep(0.01)
            heavy = [
                asyncio.ensure_future(gate.compile(Spec(regex=f"a{i}"), "heavy")) for i in (2, 3)
            ]
            while len(gate.waiting) < 2:
                await asyncio.sleep(0.01)
            light = asyncio.ensure_future(gate.compile(Spec(regex="b1"), "light"))
            while len(gate.waiting) < 3:
                await asyncio.sleep(0.01)
            with pytest.raises(CompileBusy) as e:  # heavy has 3 compiles waiting or running
                await gate.compile(Spec(regex="a4"), "heavy")
            assert e.value.status == 429
            for name in ("a1", "b1", "a2", "a3"):
                grammars.release.setdefault(name, threading.Event()).set()
            await asyncio.gather(first, light, *heavy)
            return grammars.built
        finally:
            gate.shutdown()

    # The light caller, which arrived last, ran right after the compile under way.
    assert asyncio.run(run()) == ["a1", "b1", "a2", "a3"]


def test_the_same_constraint_is_compiled_once_for_concurrent_requests():
    grammars = SlowGrammars()

    async def run() -> list[object]:
        gate = CompileGate(lambda: grammars, AdmissionConfig())
        try:
            specs = [Spec(regex="same") for _ in range(5)]
            tasks = [
                asyncio.ensure_future(gate.compile(s, f"caller-{i}")) for i, s in enumerate(specs)
            ]
            while gate.busy < 1:
                await asyncio.sleep(0.01)
            grammars.release.setdefault("same", threading.Event()).set()
            return await asyncio.gather(*tasks)
        finally:
            gate.shutdown()

    results = asyncio.run(run())
    assert results == ["compiled same"] * 5 and grammars.built == ["same"]


def test_bounds_are_engine_flags_with_defaults():
    limits = AdmissionConfig()
    assert limits.grammar_cache_bytes == 512 * MiB and limits.max_grammar_choices == 1024
    assert json.dumps(limits.__dict__)  # plain values: flags, JSON and the CRD
