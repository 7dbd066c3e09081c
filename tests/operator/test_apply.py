"""`pdfleet apply`: a changed file rolls a running `pdfleet up` fleet under load,
decode first, with no failed request and the same greedy answers; a file for
another service or an invalid one changes nothing."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Callable

import httpx
import pytest
import yaml
from helpers.server import fleet_headers, wait_until
from helpers.up import Up, fleet_spec, process_argv

from pdfleet.engine.contracts import metrics as m
from pdfleet.engine.contracts.launch import python_module
from pdfleet.engine.testing_hooks import FAULT_STEP_DELAY_ENV


@pytest.fixture(scope="module")
def step_delay(tmp_path_factory):
    """Engines sleep the seconds this file holds before each step (empty: none)."""
    path = tmp_path_factory.mktemp("apply-delay") / "step-delay"
    path.write_text("")
    return path


@pytest.fixture(scope="module")
def up(tiny_model, tmp_path_factory, step_delay):
    spec = fleet_spec(tiny_model)
    spec["spec"]["engine"]["maxModelLen"] = 4096  # room for streams that outlast a drain
    fleet = Up(
        spec, tmp_path_factory.mktemp("apply-up"), env={FAULT_STEP_DELAY_ENV: str(step_delay)}
    )
    try:
        yield fleet.wait_ready()
    finally:
        fleet.stop()


def apply(up: Up, resource: dict, name: str) -> subprocess.CompletedProcess[str]:
    """`pdfleet apply` of ``resource``; once applied it is the fleet's file (up.file)."""
    path = up.file.with_name(f"{name}.yaml")
    path.write_text(yaml.safe_dump(resource))
    done = subprocess.run(
        [*python_module("pdfleet.engine.cli"), "apply", str(path), "--run-dir", str(up.run_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode == 0:
        up.file.write_text(path.read_text())
    return done


def engine_pids(up: Up) -> dict[str, int]:
    """Engine name -> pid of the fleet's engine processes."""
    return {str(pid): pid for pid in up.child_pids() if "serve" in process_argv(pid)}


def compat_hash(url: str) -> str:
    text = httpx.get(url + "/metrics", headers=fleet_headers(), timeout=10).text
    labels = m.parse_metrics(text).labels(m.ENGINE_CACHE_CONFIG.name)
    return labels["compat_hash"]


PROMPTS = [f"request {i}: " + "the quick brown fox jumps over the lazy dog " * 6 for i in range(4)]


def stream(
    url: str, prompt: str, on_chunk: Callable[[int], None] | None = None, **extra: object
) -> tuple[str, str | None]:
    """(text, finish_reason) of a greedy stream; raises on any failure.
    ``on_chunk``: called with the number of chunks read so far."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 0,
        "stream": True,
        **extra,
    }
    text, finish = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"error event: {event}")
            choice = event["choices"][0]
            text.append(choice.get("text") or "")
            finish = choice.get("finish_reason") or finish
            if on_chunk is not None:
                on_chunk(len(text))
    return "".join(text), finish


def test_a_file_for_another_service_or_an_invalid_one_changes_nothing(up):
    before = engine_pids(up)
    other = fleet_spec("/nowhere")
    other["metadata"]["name"] = "other"
    done = apply(up, other, "other")
    assert done.returncode != 0
    assert "runs 'tiny', the file is for 'other'" in done.stderr
    broken = yaml.safe_load(up.file.read_text())
    broken["spec"]["decode"]["replicas"] = -1
    done = apply(up, broken, "broken")
    assert done.returncode != 0 and "spec.decode.replicas" in done.stderr
    # Valid, but only a new gateway could take it: the supervisor refuses it.
    gateway = yaml.safe_load(up.file.read_text())
    gateway["spec"]["gateway"] = {"maxMigrations": 1}
    done = apply(up, gateway, "gateway")
    assert done.returncode == 1
    assert "needs a new gateway (max_migrations)" in done.stdout
    assert engine_pids(up) == before


def test_apply_rolls_every_engine_under_load_without_a_failed_or_changed_answer(up):
    baseline = {p: stream(up.url, p) for p in PROMPTS}
    assert all(finish == "length" for _, finish in baseline.values())
    old_hash = compat_hash(up.engine_url("decode"))
    old_pids = set(engine_pids(up).values())

    failures: list[str] = []
    answers: list[tuple[str, tuple[str, str | None]]] = []
    done = threading.Event()

    def load() -> None:
        i = 0
        while not done.is_set():
            prompt = PROMPTS[i % len(PROMPTS)]
            i += 1
            try:
                answers.append((prompt, stream(up.url, prompt)))
            except Exception as e:
                failures.append(repr(e))

    clients = [threading.Thread(target=load) for _ in range(3)]
    for t in clients:
        t.start()
    try:
        assert wait_until(lambda: len(answers) >= 3, 60, 0.05)
        # maxModelLen is an engine setting; the revision is in the P/D compat hash.
        changed = yaml.safe_load(up.file.read_text())
        changed["spec"]["engine"]["maxModelLen"] = 3072
        changed["spec"]["model"]["revision"] = "v2"
        result = apply(up, changed, "changed")
        served = len(answers)
        assert wait_until(lambda: len(answers) >= served + 3, 60, 0.05)
    finally:
        done.set()
        for t in clients:
            t.join(180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "decode-1 ready" in result.stdout and "prefill-1 ready" in result.stdout
    # Decode first: the new decode engine is ready before the new prefill starts.
    assert result.stdout.index("decode-1 ready") < result.stdout.index("prefill-1 ready")
    assert failures == []
    assert len(answers) > 6
    for prompt, answer in answers:
        assert answer == baseline[prompt]
    # The fleet ends on the new config: new processes, new settings, new hash.
    pids = engine_pids(up)
    assert len(pids) == 2 and not (set(pids.values()) & old_pids)
    for pid in pids.values():
        argv = process_argv(pid)
        assert argv[argv.index("--max-model-len") + 1] == "3072"
    assert sorted(e["name"] for e in up.engines()) == ["decode-1", "prefill-1"]
    assert compat_hash(up.engine_url("decode")) != old_hash
    assert compat_hash(up.engine_url("prefill")) == compat_hash(up.engine_url("decode"))
    # P/D pairs again once both roles run the new hash.
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0}
    r = httpx.post(up.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == baseline[PROMPTS[0]][0]


def migrations(up: Up) -> float:
    text = httpx.get(up.url + "/metrics", headers=fleet_headers(), timeout=10).text
    return m.parse_metrics(text).totals().get(m.GATEWAY_MIGRATIONS.name, 0.0)


def test_a_new_compat_hash_of_the_same_resume_identity_drains_decode_by_migration(up, step_delay):
    """A block size changes the P/D compatibility hash but not what the tokens
    are (the resume identity): the old decode engine's streams move to the new
    one of the other hash, and no stream fails or changes."""
    # The drain signals the old engine once the gateway stops routing new
    # streams to it (it re-reads the engines file every second: within about
    # 1 s); each client always has a stream in flight, which is there to move
    # unless it ended within that time. Engines slowed to 10 ms a step make a
    # stream last over 6 s, and the five clients start a fifth of a stream
    # apart (each once the one before it is that far in), so at any moment one
    # stream on the old engine began within the last fifth and has over 4.8 s
    # left: the assert on the migrations counter relies on it. (Started
    # together, the streams ended and restarted together, and a new engine
    # ready near their end let all five end before the drain and restart on
    # the new engine.)
    long = {"max_tokens": 600, "ignore_eos": True}
    stagger = 600 // 5
    prompts = ["Once upon a time", "The answer is"]
    baseline = {p: stream(up.url, p, **long) for p in prompts}
    step_delay.write_text("0.01")
    assert all(finish == "length" for _, finish in baseline.values())
    old_hash = compat_hash(up.engine_url("decode"))
    moved = migrations(up)

    failures: list[str] = []
    answers: list[tuple[str, tuple[str, str | None]]] = []
    done = threading.Event()

    def load(prompt: str, into: threading.Event) -> None:
        def progress(chunks: int) -> None:
            if chunks >= stagger:
                into.set()

        while not done.is_set():
            try:
                answers.append((prompt, stream(up.url, prompt, progress, **long)))
            except Exception as e:
                failures.append(repr(e))
            into.set()  # a failed stream lets the next client start (the test fails anyway)

    clients = []
    try:
        for p in [*prompts, *prompts, prompts[0]]:
            into = threading.Event()
            clients.append(threading.Thread(target=load, args=(p, into)))
            clients[-1].start()
            assert into.wait(60)
        assert wait_until(lambda: len(answers) >= 1, 60, 0.05)
        changed = yaml.safe_load(up.file.read_text())
        changed["spec"]["engine"]["blockSize"] = 32
        result = apply(up, changed, "block-size")
        served = len(answers)
        assert wait_until(lambda: len(answers) >= served + 1, 60, 0.05)
    finally:
        done.set()
        step_delay.write_text("")
        for t in clients:
            t.join(180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "(by migration)" in result.stdout, result.stdout
    assert compat_hash(up.engine_url("decode")) != old_hash
    assert failures == []
    for prompt, answer in answers:
        assert answer == baseline[prompt]
    assert migrations(up) > moved  # streams in flight on the old engine moved
