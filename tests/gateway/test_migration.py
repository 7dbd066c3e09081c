"""Request migration (docs/migration.md) with real engine processes.

Two decode engines of this module's own (NIXL consumers of the package's
prefill engine, ``Always`` disaggregation: a first decode leg carries the
producer's KV) behind a gateway. First the engine's side alone, called as the
gateway calls it: a request resumed after any number of sent tokens (the
first, the middle, all but the last) continues token for token as the
unfaulted run, greedy and seeded, with stop strings, logprobs and a JSON
schema grammar. Then the gateway under real faults, each compared with an
unfaulted run of the same request: a stopped process (SIGSTOP, ejected by the
stall watchdog), a drained one (SIGTERM) and a killed one (SIGKILL, a
non-streamed request). The migration cap runs over recording engines.

The engines' steps are slowed (the step-delay test hook) while a fault test
streams, so that the fault lands mid-stream; conditions, not sleeps, decide
when to strike.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from gateway.fake_engine import FakeEngine
from helpers.fleet import ENGINE_ARGS, kv_transfer_args, metric, start_engines, start_gateway
from helpers.server import ServerProcess, fleet_headers, stop_all, wait_until

from pdfleet.engine.contracts.migration import (
    END_ONE_PREFIX,
    END_PREFIX,
    IDS_PREFIX,
    MULTI_IDS_PREFIX,
    parse_choice_ids,
)
from pdfleet.engine.gateway.migration import Migrating, Migration, split_events, with_state

PROMPT = "Once upon a time, in a harbor town by the sea,"
STEP_DELAY = "0.03"


class Fleet:
    def __init__(self, prefill: ServerProcess, tiny_model: str, log_dir: Path) -> None:
        self.prefill = prefill
        self.model = tiny_model
        self.log_dir = log_dir
        self.delay = log_dir / "step-delay"
        self.delay.write_text("")
        self.decode: list[ServerProcess] = []
        self.gateway: ServerProcess | None = None

    def start_decode(self, n: int) -> list[ServerProcess]:
        return start_engines(
            self.model,
            self.log_dir,
            [f"decode{i}" for i in range(n)],
            extra=[],
            per_engine=[kv_transfer_args("NixlConnector", "kv_consumer") for _ in range(n)],
        )

    def replace(self, dead: ServerProcess) -> ServerProcess:
        """A new decode engine on the dead one's port (the gateway's URL for it)."""
        dead.stop()
        proc = ServerProcess(
            ["serve", self.model, *ENGINE_ARGS, *kv_transfer_args("NixlConnector", "kv_consumer")],
            self.log_dir,
            "decode-again",
            env={"OMP_NUM_THREADS": "1", "PDFLEET_FAULT_STEP_DELAY_FILE": str(self.delay)},
            port=dead.port,
        )
        self.decode[self.decode.index(dead)] = proc
        return proc

    def serving(self, generated: dict[str, float] | None = None) -> ServerProcess:
        """The decode engine the gateway has the request on (bounded wait); with
        ``generated`` (each engine's generated tokens before the request), once
        that engine has generated a few tokens of it."""
        assert self.gateway is not None
        found: list[ServerProcess] = []

        def look() -> bool:
            view = httpx.get(self.gateway.url + "/engines", headers=fleet_headers(), timeout=5)
            busy = {e["url"] for e in view.json()["engines"] if e["inflight"] > 0}
            found[:] = [d for d in self.decode if d.url in busy]
            if len(found) != 1 or generated is None:
                return len(found) == 1
            now = metric(found[0].url, "pdfleet_engine_generation_tokens_total")
            return now >= generated.get(found[0].url, 0.0) + 3

        assert wait_until(look, 30), "the gateway has the request on no decode engine"
        return found[0]


@pytest.fixture(scope="module")
def fleet(engines, tiny_model, tmp_path_factory, monkeypatch_module):
    prefill, _ = engines
    log_dir = tmp_path_factory.mktemp("migration")
    f = Fleet(prefill, tiny_model, log_dir)
    monkeypatch_module.setenv("PDFLEET_FAULT_STEP_DELAY_FILE", str(f.delay))
    f.decode = f.start_decode(2)
    try:
        f.gateway = start_gateway(
            [
                "--prefill",
                prefill.url,
                *(x for d in f.decode for x in ("--decode", d.url)),
                "--disaggregation-mode",
                "Always",
                "--scrape-interval",
                "0.2",
                "--stall-timeout",
                "1",
                "--hold-timeout",
                "30",
            ],
            log_dir,
        )
        yield f
    finally:
        if f.gateway is not None:
            f.gateway.stop()
        for d in f.decode:
            d.signal(signal.SIGCONT)
        stop_all(f.decode)


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


# -- reading streams ---------------------------------------------------------------


def events_of(raw: bytes) -> list[tuple[list[int], dict | None]]:
    """(token ids named by the event's comment, its JSON) per event."""
    out: list[tuple[list[int], dict | None]] = []
    for event in raw.split(b"\n\n")[:-1]:
        ids: list[int] = []
        if event.startswith((IDS_PREFIX, END_ONE_PREFIX)):
            line, _, event = event.partition(b"\n")
            ids = [int(x) for x in line[len(IDS_PREFIX) :].split()]
        data = json.loads(event[6:]) if event.startswith(b"data: {") else None
        out.append((ids, data))
    return out


def text_of(data: dict) -> str:
    choice = data["choices"][0] if data.get("choices") else {}
    if "text" in choice:
        return choice["text"]
    return (choice.get("delta") or {}).get("content") or ""


class Answer:
    def __init__(self, events: list[tuple[list[int], dict | None]]) -> None:
        self.events = events
        self.ids = [t for ids, _ in events for t in ids]
        datas = [d for _, d in events if d is not None]
        self.text = "".join(text_of(d) for d in datas)
        self.finish = [
            c["finish_reason"]
            for d in datas
            for c in d.get("choices", [])
            if c.get("finish_reason")
        ]
        self.usage = next((d["usage"] for d in datas if d.get("usage")), None)
        self.errors = [d for d in datas if "error" in d]
        self.logprobs = [
            lp
            for d in datas
            for c in d.get("choices", [])
            for lp in ((c.get("logprobs") or {}).get("token_logprobs") or [])
        ]
        self.created = {d["created"] for d in datas if "created" in d}
        self.offsets = [
            o
            for d in datas
            for c in d.get("choices", [])
            for o in ((c.get("logprobs") or {}).get("text_offset") or [])
        ]

    def sent_text(self, k: int) -> str:
        """The text the client had when the first ``k`` tokens had been sent."""
        out, n = "", 0
        for ids, data in self.events:
            if n >= k:
                break
            n += len(ids)
            if data is not None:
                out += text_of(data)
        return out


def engine_stream(url: str, path: str, body: dict) -> Answer:
    """A decode leg as the gateway sends it, straight to an engine."""
    with httpx.stream("POST", url + path, json=body, headers=fleet_headers(), timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        return Answer(events_of(resp.read()))


def client_stream(url: str, body: dict, on_event=None, path: str = "/v1/completions") -> Answer:
    """A client's stream through the gateway; ``on_event(n)`` after the n-th event."""
    raw, n = b"", 0
    with httpx.stream("POST", url + path, json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for chunk in resp.iter_raw():
            raw += chunk
            while raw.count(b"\n\n") > n:
                n += 1
                if on_event is not None:
                    on_event(n)
    assert b"\n: " not in raw and not raw.startswith(b":"), "a comment reached the client"
    return Answer(events_of(raw))


# -- the engine resumes exactly --------------------------------------------------------

BASE = {
    "model": "tiny",
    "prompt": PROMPT,
    "max_tokens": 24,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 1234, "top_p": 0.9}]
)
def test_a_resumed_request_continues_token_for_token_at_any_point(fleet, sampling):
    url = fleet.decode[0].url
    body = {**BASE, **sampling, "logprobs": 2}
    ref = engine_stream(url, "/v1/completions", {**body, "migration": {}})
    n = len(ref.ids)
    assert n == 24 and ref.finish == ["length"] and len(ref.logprobs) == n
    for k in (1, n // 2, n - 1):
        state = {"output_token_ids": ref.ids[:k], "created": 1234}
        got = engine_stream(url, "/v1/completions", {**body, "migration": state})
        assert ref.ids[:k] + got.ids == ref.ids, k
        assert ref.sent_text(k) + got.text == ref.text, k
        assert got.finish == ["length"] and not got.errors
        # usage counts every token the client got; logprobs go on from k.
        assert got.usage["completion_tokens"] == n
        assert got.logprobs == pytest.approx(ref.logprobs[k:], abs=1e-4)
        assert got.offsets == ref.offsets[k:], k  # from where the first leg's went
        assert got.created == {1234}
    # With the prompt echoed, its tokens' strings count in the offsets too.
    body = {**body, "echo": True}
    ref = engine_stream(url, "/v1/completions", {**body, "migration": {}})
    k = n // 2
    state = {"output_token_ids": ref.ids[:k]}
    got = engine_stream(url, "/v1/completions", {**body, "migration": state})
    assert len(ref.offsets) > n and got.offsets == ref.offsets[len(ref.offsets) - n + k :]


def test_stop_strings_spanning_the_move_and_a_grammar_carry_across(fleet):
    url = fleet.decode[0].url
    free = engine_stream(url, "/v1/completions", {**BASE, "temperature": 0, "migration": {}})
    # A stop string that starts in the text of token 9 and ends after it.
    k = 10
    at = len(free.sent_text(k))
    stop = free.text[at - 2 : at + 3]
    assert len(stop) == 5 and free.text.index(stop) == at - 2
    body = {**BASE, "temperature": 0, "stop": [stop]}
    ref = engine_stream(url, "/v1/completions", {**body, "migration": {}})
    assert ref.finish == ["stop"] and ref.text == free.text[: at - 2]
    got = engine_stream(
        url, "/v1/completions", {**body, "migration": {"output_token_ids": ref.ids[:k]}}
    )
    # The first engine held back what could start the stop string: the client
    # sees the same text, cut at the same place, whichever engine finished it.
    assert ref.sent_text(k) + got.text == ref.text and got.finish == ["stop"]
    # Sent tokens that already hold the stop string ended the request there.
    resp = httpx.post(
        url + "/v1/completions",
        json={**body, "migration": {"output_token_ids": free.ids[: k + 10]}},
        headers=fleet_headers(),
        timeout=30,
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "migration.output_token_ids", resp.text

    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "A person as JSON"}],
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 5,
        "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    }
    ref = engine_stream(url, "/v1/chat/completions", {**chat, "migration": {}})
    k = len(ref.ids) // 2
    got = engine_stream(
        url, "/v1/chat/completions", {**chat, "migration": {"output_token_ids": ref.ids[:k]}}
    )
    # The matcher replayed the sent tokens: the rest is the same constrained text.
    assert ref.ids[:k] + got.ids == ref.ids
    assert ref.sent_text(k) + got.text == ref.text
    if ref.finish == ["stop"]:
        assert set(json.loads(ref.text)) >= {"name", "age"}


class Choices:
    """A stream of several choices, per choice index: the token ids (the
    engine's comments when it names them, else ``return_token_ids``), the
    text, the finish reasons, the logprobs; and which choices the comments
    marked finished."""

    def __init__(self, raw: bytes) -> None:
        self.ids: dict[int, list[int]] = {}
        self.text: dict[int, str] = {}
        self.finish: dict[int, list[str]] = {}
        self.logprobs: dict[int, list[float]] = {}
        self.ended: set[int] = set()
        self.usage: dict | None = None
        self.errors: list[dict] = []
        self.created: set[int] = set()
        for event in raw.split(b"\n\n")[:-1]:
            named: int | None = None
            if event.startswith((MULTI_IDS_PREFIX, END_PREFIX)):
                line, _, event = event.partition(b"\n")
                named, ids, end = parse_choice_ids(line)
                self.ids.setdefault(named, []).extend(ids)
                if end:
                    self.ended.add(named)
            if not event.startswith(b"data: {"):
                continue
            data = json.loads(event[6:])
            self.created |= {data["created"]} if "created" in data else set()
            if "error" in data:
                self.errors.append(data)
            if data.get("usage") and not data.get("choices"):
                self.usage = data["usage"]
            for c in data.get("choices", []):
                i = c["index"]
                assert named is None or named == i
                if named is None and "token_ids" in c:
                    self.ids.setdefault(i, []).extend(c["token_ids"])
                self.text[i] = self.text.get(i, "") + text_of({"choices": [c]})
                if c.get("finish_reason"):
                    self.finish.setdefault(i, []).append(c["finish_reason"])
                lps = (c.get("logprobs") or {}).get("token_logprobs") or []
                self.logprobs.setdefault(i, []).extend(lps)


def engine_choices(url: str, path: str, body: dict) -> Choices:
    with httpx.stream("POST", url + path, json=body, headers=fleet_headers(), timeout=60) as resp:
        assert resp.status_code == 200, resp.read()
        return Choices(resp.read())


@pytest.mark.parametrize(
    "sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 4321, "top_p": 0.9}]
)
def test_a_resumed_request_of_several_choices_continues_each_choice(fleet, sampling):
    url = fleet.decode[0].url
    body = {**BASE, **sampling, "n": 3, "logprobs": 1}
    ref = engine_choices(url, "/v1/completions", {**body, "migration": {}})
    assert sorted(ref.ids) == [0, 1, 2] and ref.ended == {0, 1, 2}
    assert all(len(ref.ids[i]) == 24 and ref.finish[i] == ["length"] for i in range(3))
    if "seed" in sampling:
        assert ref.ids[0] != ref.ids[1] != ref.ids[2]  # each choice its own draw
    # Choice 0 went out whole, choice 1 in part, nothing of choice 2 yet.
    k = 9
    state = {"choices": [ref.ids[0], ref.ids[1][:k], None], "finished": [0], "created": 99}
    got = engine_choices(url, "/v1/completions", {**body, "migration": state})
    assert not got.errors and sorted(got.ids) == [1, 2]  # the finished choice is not run
    assert ref.ids[1][:k] + got.ids[1] == ref.ids[1] and got.ids[2] == ref.ids[2]
    assert got.text[2] == ref.text[2] and ref.text[1].endswith(got.text[1])
    assert got.finish == {1: ["length"], 2: ["length"]} and got.ended == {1, 2}
    assert got.logprobs[1] == pytest.approx(ref.logprobs[1][k:], abs=1e-4)
    # usage counts every token the client got, the finished choice's too.
    assert got.usage["completion_tokens"] == 72 and got.created == {99}
    # All finished (the engine died before its [DONE]): only the usage is left.
    done = {"choices": [ref.ids[i] for i in range(3)], "finished": [0, 1, 2]}
    got = engine_choices(url, "/v1/completions", {**body, "migration": done})
    assert got.ids == {} and got.usage["completion_tokens"] == 72


def test_a_finished_stream_says_so_and_resumes_as_finished(fleet):
    # The event that finishes a stream of one choice is marked ``: end``; a
    # leg resumed after it (its state in the choices form, finished) runs
    # nothing again and answers only usage and [DONE].
    url = fleet.decode[0].url
    chat = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me about the harbor town."}],
    }
    plain = {k: v for k, v in BASE.items() if k != "prompt"}
    for path, body in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", chat)):
        body = {**plain, **body, "max_tokens": 4, "temperature": 0}
        with httpx.stream(
            "POST", url + path, json={**body, "migration": {}}, headers=fleet_headers(), timeout=60
        ) as resp:
            events = resp.read().split(b"\n\n")[:-1]
        ids: list[int] = []
        for event in events:
            if event.startswith((IDS_PREFIX, END_ONE_PREFIX)):
                ids += [int(x) for x in event.split(b"\n", 1)[0][len(IDS_PREFIX) :].split()]
        ends = [e for e in events if e.startswith(END_ONE_PREFIX)]
        assert len(ends) == 1 and b'"finish_reason":"length"' in ends[0].replace(b" ", b""), path
        assert len(ids) == 4
        with httpx.stream(
            "POST",
            url + path,
            json={**body, "migration": {"choices": [ids], "finished": [0]}},
            headers=fleet_headers(),
            timeout=60,
        ) as resp:
            assert resp.status_code == 200
            rest = resp.read().split(b"\n\n")[:-1]
        assert rest[-1] == b"data: [DONE]" and len(rest) == 2, rest
        usage = json.loads(rest[0][6:])
        assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4, path


def test_migration_is_an_internal_field(fleet):
    assert fleet.gateway is not None
    resp = httpx.post(
        fleet.gateway.url + "/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "migration": {"output_token_ids": [1, 2]}},
        timeout=30,
    )
    assert resp.status_code == 403 and resp.json()["error"]["param"] == "migration"
    # A request of several choices names its sent tokens per choice.
    for state, extra, param in (
        ({"output_token_ids": [1]}, {"n": 2}, "migration.output_token_ids"),
        ({"choices": [[1], None, [2]]}, {"n": 2}, "migration.choices"),
        # Sent tokens that already end the request: nothing to resume. They
        # use up max_tokens (16), or hold a stop token.
        ({"output_token_ids": [1] * 16}, {}, "migration.output_token_ids"),
        ({"output_token_ids": [1, 7, 2]}, {"stop_token_ids": [7]}, "migration.output_token_ids"),
    ):
        resp = httpx.post(
            fleet.decode[0].url + "/v1/completions",
            json={"model": "tiny", "prompt": PROMPT, "stream": True, "migration": state, **extra},
            headers=fleet_headers(),
            timeout=30,
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


# -- the gateway moves failed legs ---------------------------------------------------


def faulted(fleet: Fleet, body: dict, fault, after: int = 6) -> tuple[Answer, Answer]:
    """(the unfaulted answer, the answer with ``fault(engine)`` struck at the
    ``after``-th event of the stream), both through the gateway."""
    assert fleet.gateway is not None
    url = fleet.gateway.url
    ref = client_stream(url, body)
    fleet.delay.write_text(STEP_DELAY)
    try:

        def strike(n: int) -> None:
            if n == after:
                fault(fleet.serving())

        got = client_stream(url, body, strike)
    finally:
        fleet.delay.write_text("")
    return ref, got


def assert_same(ref: Answer, got: Answer) -> None:
    assert not got.errors, got.errors
    assert got.text == ref.text
    assert got.finish == ref.finish == ["length"]
    assert got.usage["completion_tokens"] == ref.usage["completion_tokens"] == 40
    assert len(got.created) == 1  # one answer, as the client sees it


def _stall_limit(gw: str, url: str) -> float:
    engines = httpx.get(gw + "/engines", headers=fleet_headers(), timeout=10).json()["engines"]
    return next(e["stall_limit_s"] for e in engines if e["url"] == url)


def test_a_stopped_engine_s_stream_moves_when_the_watchdog_ejects_it(fleet):
    # Twice in a row: the time a stopped engine spent stopped is not a step
    # of its pace, so its stall limit stays where it was and its next stall
    # (or a peer's) is judged as fast as the first.
    assert fleet.gateway is not None
    gw = fleet.gateway.url
    moved = metric(gw, "pdfleet_gateway_migrations_total", reason="stalled")
    resumed = metric(gw, "pdfleet_gateway_migration_resume_seconds_count")
    body = {**BASE, "max_tokens": 40, "temperature": 0}
    stopped: list[tuple[ServerProcess, float]] = []

    def sigstop(engine: ServerProcess) -> None:
        engine.signal(signal.SIGSTOP)
        stopped.append((engine, time.monotonic()))

    for turn in range(2):
        stopped.clear()
        try:
            ref, got = faulted(fleet, body, sigstop)
        finally:
            for engine, _ in stopped:
                engine.signal(signal.SIGCONT)
        stop_s = time.monotonic() - stopped[0][1]
        assert_same(ref, got)
        assert metric(gw, "pdfleet_gateway_migrations_total", reason="stalled") == moved + turn + 1
        assert metric(gw, "pdfleet_gateway_migration_resume_seconds_count") == resumed + turn + 1
        # The stopped engine comes back into routing once it answers again,
        # and the step that held the stop did not raise its stall limit.
        assert wait_until(lambda: _routable(gw) == 2, 30)
        limit = _stall_limit(gw, stopped[0][0].url)
        assert limit < stop_s, (limit, stop_s)
    assert metric(gw, "pdfleet_gateway_migration_replayed_tokens_total") >= 10


def client_choices(url: str, path: str, body: dict, on_event=None) -> Choices:
    """A client's stream of several choices through the gateway."""
    raw, n = b"", 0
    with httpx.stream("POST", url + path, json=body, timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for chunk in resp.iter_raw():
            raw += chunk
            while raw.count(b"\n\n") > n:
                n += 1
                if on_event is not None:
                    on_event(n)
    assert b"\n: " not in raw and not raw.startswith(b":"), "a comment reached the client"
    return Choices(raw)


def assert_same_choices(ref: Choices, got: Choices, count: int, tokens: int) -> None:
    assert not got.errors, got.errors
    assert sorted(got.ids) == sorted(ref.ids) == list(range(count))
    for i in range(count):
        # Each choice whole: no token missing, repeated or moved to another index.
        assert got.ids[i] == ref.ids[i] and len(got.ids[i]) == tokens, i
        assert got.text[i] == ref.text[i], i
        assert got.finish[i] == ref.finish[i] == ["length"], i
    assert got.usage["completion_tokens"] == ref.usage["completion_tokens"] == count * tokens
    assert len(got.created) == 1


SEVERAL = {
    "model": "tiny",
    "max_tokens": 40,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
    "return_token_ids": True,
}
"""Streams of several choices: 40 tokens each, their ids in the client's events."""

CHOICE_REQUESTS: list[tuple[str, dict, int]] = [
    # (path, body, choices): seeded n = 1, greedy n = 3, seeded chat n = 3,
    # 2 prompts × n = 2.
    ("/v1/completions", {**SEVERAL, "prompt": PROMPT, "temperature": 1.0, "seed": 99}, 1),
    ("/v1/completions", {**SEVERAL, "prompt": PROMPT, "n": 3, "temperature": 0}, 3),
    (
        "/v1/chat/completions",
        {
            **SEVERAL,
            "messages": [{"role": "user", "content": "Tell me about the harbor town."}],
            "n": 3,
            "temperature": 1.0,
            "seed": 11,
        },
        3,
    ),
    (
        "/v1/completions",
        {
            **SEVERAL,
            "prompt": [PROMPT, "The lighthouse keeper said"],
            "n": 2,
            "temperature": 1.0,
            "top_p": 0.9,
            "seed": 3,
        },
        4,
    ),
]


def test_sigterm_drains_a_decode_engine_by_handing_its_streams_back(fleet, tmp_path):
    # A gateway of one decode engine: every request below is on it when it is
    # drained (one sequence, several choices, several prompts, a non-streamed
    # one), and each resumes on the engine restarted under its URL (the
    # gateway holds them for it).
    assert fleet.gateway is not None
    engine = fleet.decode[0]
    gw = start_gateway(
        [
            "--decode",
            engine.url,
            "--disaggregation-mode",
            "Disabled",
            "--hold-timeout",
            "90",
            # Until the gateway's next scrape it may try the stopping engine
            # again (refused: one more move).
            "--max-migrations",
            "5",
        ],
        tmp_path,
    )
    # A non-streamed request of two choices (best_of equal to n) too.
    plain = {**BASE, "max_tokens": 40, "stream": False, "n": 2, "best_of": 2}
    plain = {**plain, "temperature": 1.0, "seed": 8}
    plain.pop("stream_options")
    seen = [0] * len(CHOICE_REQUESTS)

    def counted(i: int):
        def on_event(n: int) -> None:
            seen[i] = n

        return on_event

    try:
        # The unfaulted answers, from the engine itself (what the gateway relays).
        refs = [engine_choices(engine.url, p, b) for p, b, _ in CHOICE_REQUESTS]
        ref_plain = httpx.post(
            engine.url + "/v1/completions", json=plain, headers=fleet_headers(), timeout=60
        ).json()
        with concurrent.futures.ThreadPoolExecutor(len(CHOICE_REQUESTS) + 1) as pool:
            fleet.delay.write_text("0.1")
            try:
                # One after the other (each past its first step), so that the
                # gateway has each on the engine before the next comes.
                pending = []
                for i, (p, b, _) in enumerate(CHOICE_REQUESTS):
                    pending.append(pool.submit(client_choices, gw.url, p, b, counted(i)))
                    assert wait_until(lambda i=i: seen[i] >= 2, 60)
                pending_plain = pool.submit(
                    httpx.post, gw.url + "/v1/completions", json=plain, timeout=180
                )
                state: list[object] = []

                def all_in_flight() -> bool:
                    view = httpx.get(gw.url + "/engines", headers=fleet_headers(), timeout=5)
                    inflight = sum(e["inflight"] for e in view.json()["engines"])
                    state[:] = [inflight, list(seen)]
                    return inflight == len(CHOICE_REQUESTS) + 1 and min(seen) >= 6

                assert wait_until(all_in_flight, 60), state
                engine.signal(signal.SIGTERM)
                # It leaves without finishing them, and without failing them:
                # it exits cleanly.
                engine.proc.wait(30)
                assert engine.proc.returncode == 0
                assert "handed back to the gateway" in engine.log()
                # The streams only had to be in flight at the SIGTERM: the
                # engine restarted for them steps at full speed.
                fleet.delay.write_text("")
                fleet.replace(engine).wait_healthy(120)
                got = [p.result(180) for p in pending]
                got_plain = pending_plain.result(180)
            finally:
                fleet.delay.write_text("")
        for (_, _, count), ref, faulted in zip(CHOICE_REQUESTS, refs, got, strict=True):
            assert_same_choices(ref, faulted, count, 40)
        assert got_plain.status_code == 200, got_plain.text
        body = got_plain.json()
        assert [c["text"] for c in body["choices"]] == [c["text"] for c in ref_plain["choices"]]
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert body["usage"]["completion_tokens"] == 80
        # Each was handed back once, and resumed after the tokens the client had.
        drained = len(CHOICE_REQUESTS) + 1
        assert metric(gw.url, "pdfleet_gateway_migrations_total", reason="drain") == drained
        replayed = metric(gw.url, "pdfleet_gateway_migration_replayed_tokens_total")
        assert replayed >= 6 * len(CHOICE_REQUESTS)
    finally:
        gw.stop()
    assert wait_until(lambda: _routable(fleet.gateway.url) == 2, 30)


def test_a_non_streamed_request_moves_when_its_engine_is_killed(fleet):
    assert fleet.gateway is not None
    url = fleet.gateway.url
    body = {**BASE, "max_tokens": 40, "temperature": 0, "stream": False}
    body.pop("stream_options")
    ref = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    fleet.delay.write_text(STEP_DELAY)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            before = {
                d.url: metric(d.url, "pdfleet_engine_generation_tokens_total") for d in fleet.decode
            }
            pending = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=120)
            victim = fleet.serving(before)
            victim.signal(signal.SIGKILL)
            resp = pending.result(120)
    finally:
        fleet.delay.write_text("")
    assert resp.status_code == 200, resp.text
    got = resp.json()
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    assert got["usage"]["completion_tokens"] == 40
    # The engine had generated tokens of it but sent none (a non-streamed answer
    # comes whole): the gateway sent it again, as a migration, or as a leg whose
    # connection was refused (the engine's socket was gone by the time it noticed).
    moved = metric(url, "pdfleet_gateway_migrations_total", reason="died") + metric(
        url, "pdfleet_gateway_retries_total", role="decode"
    )
    assert moved >= 1


def cache_info(url: str) -> dict[str, str]:
    """An engine's cache-config info labels (its compat hash, its resume identity)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", headers=fleet_headers(), timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdfleet_engine_cache_config_info":
                return sample.labels
    raise AssertionError("no cache-config info")


def test_a_killed_engine_s_chat_stream_resumes_on_an_engine_of_another_compat_hash(fleet):
    # (Runs after the fleet's other fault tests: it kills an engine for good.)
    # An engine that differs from the fleet's only in its KV block size: another
    # compat hash (it could not exchange KV blocks with them), the same resume
    # identity (the same tokens: a resumed request recomputes its KV).
    alive = next(d for d in fleet.decode if d.proc.poll() is None)
    (other,) = start_engines(
        fleet.model, fleet.log_dir, ["decode-b32"], extra=["--block-size", "32"]
    )
    gw = None
    try:
        mine, theirs = cache_info(alive.url), cache_info(other.url)
        assert mine["compat_hash"] != theirs["compat_hash"]
        assert mine["resume_identity"] == theirs["resume_identity"]
        identity = mine["resume_identity"]
        chat = {
            "model": "tiny",
            "messages": [{"role": "user", "content": "Tell me about the harbor town."}],
            "max_tokens": 40,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        # The engines' side: the other engine continues a seeded stream of
        # this one's token for token; it refuses a leg of another identity by name.
        seeded = {**chat, "temperature": 1.0, "seed": 7}
        ref = engine_stream(alive.url, "/v1/chat/completions", {**seeded, "migration": {}})
        k = len(ref.ids) // 2
        state = {"output_token_ids": ref.ids[:k], "resume_identity": identity}
        got = engine_stream(other.url, "/v1/chat/completions", {**seeded, "migration": state})
        assert ref.ids[:k] + got.ids == ref.ids and ref.sent_text(k) + got.text == ref.text
        refused = httpx.post(
            other.url + "/v1/chat/completions",
            json={**seeded, "migration": {**state, "resume_identity": "0123456789abcdef"}},
            headers=fleet_headers(),
            timeout=30,
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "migration.resume_identity"

        # The gateway's side: a greedy chat stream whose engine is killed
        # mid-stream ends as the unfaulted one, whichever engine it started on.
        gw = start_gateway(
            [
                *(x for d in (alive, other) for x in ("--decode", d.url)),
                "--disaggregation-mode",
                "Disabled",
                "--scrape-interval",
                "0.2",
                "--hold-timeout",
                "30",
            ],
            fleet.log_dir,
        )
        body = {**chat, "temperature": 0}
        unfaulted = client_stream(gw.url, body, path="/v1/chat/completions")
        fleet.delay.write_text(STEP_DELAY)
        killed: list[ServerProcess] = []

        def strike(n: int) -> None:
            if n != 6:
                return

            def serving() -> bool:
                view = httpx.get(gw.url + "/engines", headers=fleet_headers(), timeout=5).json()
                busy = {e["url"] for e in view["engines"] if e["inflight"] > 0}
                killed[:] = [d for d in (alive, other) if d.url in busy]
                return len(killed) == 1

            assert wait_until(serving, 30)
            killed[0].signal(signal.SIGKILL)

        try:
            faulted = client_stream(gw.url, body, strike, path="/v1/chat/completions")
        finally:
            fleet.delay.write_text("")
        assert len(killed) == 1
        assert not faulted.errors, faulted.errors
        assert faulted.text == unfaulted.text and faulted.finish == ["length"]
        assert faulted.usage["completion_tokens"] == unfaulted.usage["completion_tokens"] == 40
        assert len(faulted.created) == 1
        assert metric(gw.url, "pdfleet_gateway_migrations_total", reason="died") == 1
    finally:
        if gw is not None:
            gw.stop()
        other.stop()


def _routable(gateway_url: str) -> int:
    view = httpx.get(gateway_url + "/engines", headers=fleet_headers(), timeout=5).json()
    return view["routable"]["decode"]


# -- the cap ---------------------------------------------------------------------------


def handing_back(body: dict) -> tuple[int, object]:
    """A decode engine that sends two tokens, then hands the stream back (or,
    for a leg without migration state, ends it early: it died); for ``n`` 2,
    one token of each choice."""
    sent = len((body.get("migration") or {}).get("output_token_ids", []))
    if body.get("n") == 2:
        return 200, choices_handed_back(body)

    def events():
        for t in (sent, sent + 1):
            data = {"id": "c", "created": 7, "choices": [{"index": 0, "text": f"t{t} "}]}
            if "migration" not in body:
                yield b"data: %s\n\n" % json.dumps(data).encode()
                continue
            yield b": ids %d\ndata: %s\n\n" % (100 + t, json.dumps(data).encode())
        if "migration" in body:
            yield b": migrate\n\n"

    return 200, events()


def choices_handed_back(body: dict):
    """Events of an ``n`` = 2 leg: choice 1 finishes on the first leg, choice 0
    sends one token per leg and is handed back."""
    state = body["migration"]
    sent = state.get("choices") or [None, None]
    for i in (0, 1):
        if i in state.get("finished", []):
            continue
        t = len(sent[i] or [])
        data = {"id": "c", "created": 7, "choices": [{"index": i, "text": f"c{i}t{t} "}]}
        head = b": end" if i == 1 else b": ids"
        yield b"%s.%d %d\ndata: %s\n\n" % (head, i, 100 + t, json.dumps(data).encode())
    yield b": migrate\n\n"


def test_a_request_moves_at_most_max_migrations_times(tmp_path):
    fakes = [FakeEngine(answer=handing_back), FakeEngine(answer=handing_back)]
    gw = None
    try:
        gw = start_gateway(
            [
                *(x for f in fakes for x in ("--decode", f.url)),
                "--disaggregation-mode",
                "Disabled",
                "--scrape-interval",
                "0.2",
                "--max-migrations",
                "2",
            ],
            tmp_path,
        )
        plain = {"model": "tiny", "prompt": "hi", "stream": True}
        got = client_stream(gw.url, plain)
        # Three legs (the first and two moves), two tokens each, then the error.
        assert got.text == "t0 t1 t2 t3 t4 t5 "
        assert len(got.errors) == 1
        assert "moved 2 times (the most --max-migrations" in got.errors[0]["error"]["message"]
        legs = [s.body for f in fakes for s in f.posts()]
        sent = sorted(len(b["migration"].get("output_token_ids", [])) for b in legs)
        assert sent == [0, 2, 4]
        resumed = [b["migration"] for b in legs if b["migration"].get("output_token_ids")]
        assert all(m["created"] == 7 for m in resumed)
        assert max(resumed, key=lambda m: len(m["output_token_ids"]))["output_token_ids"] == [
            100,
            101,
            102,
            103,
        ]
        assert metric(gw.url, "pdfleet_gateway_migrations_total", reason="drain") == 2
        assert metric(gw.url, "pdfleet_gateway_migrations_total", reason="exhausted") == 1

        # Several choices move choice by choice: the finished one is not run
        # again, the other resumes after its own sent tokens.
        got = client_choices(gw.url, "/v1/completions", {**plain, "n": 2})
        assert got.text == {0: "c0t0 c0t1 c0t2 ", 1: "c1t0 "} and len(got.errors) == 1
        legs = [s.body["migration"] for f in fakes for s in f.posts() if s.body.get("n") == 2]
        assert sorted(map(json.dumps, legs)) == sorted(
            map(
                json.dumps,
                [
                    {},
                    {"choices": [[100], [100]], "finished": [1], "created": 7},
                    {"choices": [[100, 101], [100]], "finished": [1], "created": 7},
                ],
            )
        )
        assert metric(gw.url, "pdfleet_gateway_migrations_total", reason="drain") == 4
    finally:
        if gw is not None:
            gw.stop()
        for f in fakes:
            f.close()


def handing_back_once(body: dict) -> tuple[int, object]:
    """A decode engine that hands a request's first leg back after two tokens
    and finishes a resumed one with two more."""
    sent = (body.get("migration") or {}).get("output_token_ids", [])

    def events():
        for t in (len(sent), len(sent) + 1):
            data = {"id": "c", "created": 7, "choices": [{"index": 0, "text": f"t{t} "}]}
            yield b": ids %d\ndata: %s\n\n" % (100 + t, json.dumps(data).encode())
        if sent:
            yield b"data: [DONE]\n\n"
        else:
            yield b": migrate\n\n"

    return 200, events()


def test_a_leg_resumes_on_an_engine_of_its_resume_identity_whatever_its_compat_hash(tmp_path):
    # The first leg goes to ``first`` (the shortest queue); of the two others,
    # ``same_hash`` shares its compat hash but not its resume identity (other
    # weights or sampling defaults: its tokens would differ) and has the
    # shorter queue; ``other_hash`` has the same resume identity under another
    # compat hash (a rollout that changed only the KV layout or the version).
    first = FakeEngine(answer=handing_back_once, compat_hash="h1", resume_identity="r1")
    same_hash = FakeEngine(
        answer=handing_back_once, compat_hash="h1", resume_identity="r2", waiting=1
    )
    other_hash = FakeEngine(
        answer=handing_back_once, compat_hash="h2", resume_identity="r1", waiting=3
    )
    fakes = [first, same_hash, other_hash]
    gw = None
    try:
        gw = start_gateway(
            [
                *(x for f in fakes for x in ("--decode", f.url)),
                "--disaggregation-mode",
                "Disabled",
                "--scrape-interval",
                "0.2",
            ],
            tmp_path,
        )

        # The gateway knows each queue once it scraped each engine twice (the
        # first answer was read when the second was asked for), in each worker.
        scrapes = 2 * int(os.environ.get("PDFLEET_TEST_GATEWAY_WORKERS") or 1)
        assert wait_until(
            lambda: all(sum(s.path == "/metrics" for s in f.seen) >= scrapes for f in fakes), 30
        )
        got = client_stream(gw.url, {"model": "tiny", "prompt": "hi", "stream": True})
        assert not got.errors and got.text == "t0 t1 t2 t3 "
        assert [len(p.body["migration"]) for p in first.posts()] == [0]
        assert same_hash.posts() == []
        (resumed,) = [p.body["migration"] for p in other_hash.posts()]
        assert resumed == {"output_token_ids": [100, 101], "created": 7, "resume_identity": "r1"}
        assert metric(gw.url, "pdfleet_gateway_migrations_total", reason="drain") == 1
    finally:
        if gw is not None:
            gw.stop()
        for f in fakes:
            f.close()


# -- the wire, without processes --------------------------------------------------------


def _split_each(block: bytes, state: Migration) -> tuple[bytes, bool]:
    """What split_events does, one event at a time (its general path)."""
    out, handed_back = [], False
    for event in block.split(b"\n\n")[:-1]:
        if event.startswith((b": ids ", b": end ")):
            line, _, event = event.partition(b"\n")
            state.sent.extend(int(x) for x in line[6:].split())
            if line.startswith(b": end "):
                state.finished.add(0)
        if event:
            out.append(event + b"\n\n")
    return b"".join(out), handed_back


def test_a_block_of_several_events_of_one_choice_splits_as_event_by_event():
    """The one-pass path for piled-up events of one choice gives the bytes,
    ids and finish of the event-by-event one, on random mixes of events with
    ids, ids alone, finishing ids and plain data, in any order."""
    rng = random.Random(7)
    shapes = (
        lambda i: b': ids %d %d\ndata: {"t":"a:b\\n"}\n\n' % (i, i + 1),
        lambda i: b": ids %d\n\n" % i,
        lambda i: b'data: {"plain":"x"}\n\n',
        lambda i: b': end %d\ndata: {"last":1}\n\n' % i,
        lambda i: b"data: [DONE]\n\n",
    )
    for _ in range(300):
        block = b"".join(rng.choice(shapes)(i) for i in range(rng.randint(2, 12)))
        a, b = Migration({}), Migration({})
        assert split_events(block, a) == _split_each(block, b), block
        assert (a.sent, a.finished) == (b.sent, b.finished)
    # An engine's usual pile (each event its ids and one data line, maybe a
    # [DONE] after them), whose lines are checked and cut without the regex.
    for _ in range(100):
        block = b"".join(rng.choice(shapes[0:4:3])(i) for i in range(rng.randint(2, 12)))
        block += rng.choice((b"", shapes[2](0), shapes[4](0)))
        a, b = Migration({}), Migration({})
        assert split_events(block, a) == _split_each(block, b), block
        assert (a.sent, a.finished) == (b.sent, b.finished)


def test_the_relay_strips_the_comments_and_keeps_the_ids_in_order():
    state = Migration({})
    block = b': ids 5 6\ndata: {"a":1}\n\n: ids 7\n\ndata: {"b":2}\n\n'
    assert split_events(block, state) == (b'data: {"a":1}\n\ndata: {"b":2}\n\n', False)
    assert state.sent == [5, 6, 7]
    assert split_events(b"data: [DONE]\n\n", state) == (b"data: [DONE]\n\n", False)
    assert split_events(b': ids 8\ndata: {"c":3}\n\n: migrate\n\n', state) == (
        b'data: {"c":3}\n\n',
        True,
    )
    assert state.sent == [5, 6, 7, 8]
    assert state.state().to_json() == {"output_token_ids": [5, 6, 7, 8]}
    # The event that finishes a stream of one choice: it resumes as finished.
    assert split_events(b': end 9\ndata: {"d":4}\n\n', state) == (b'data: {"d":4}\n\n', False)
    assert state.sent == [5, 6, 7, 8, 9] and state.finished == {0}
    assert state.state().to_json() == {"choices": [[5, 6, 7, 8, 9]], "finished": [0]}
    assert state.replayed() == 0
    # Several choices: per choice index, and which ones finished.
    state = Migration({"n": 3}, choices=3)
    block = b": ids.2\ndata: {}\n\n: ids.0 5 6\ndata: {}\n\n: end.2 7\ndata: {}\n\n: ids.0 8\n\n"
    assert split_events(block, state) == (b"data: {}\n\n" * 3, False)
    assert state.sent_of == {0: [5, 6, 8], 2: [7]} and state.finished == {2}
    assert state.state().to_json() == {"choices": [[5, 6, 8], None, [7]], "finished": [2]}
    assert state.replayed() == 3  # what the new engine recomputes: not choice 2's
    for raw in (b'{"prompt": "x"}', b' {"prompt":"x"} ', '{"prompt": "x"}'.encode("utf-16")):
        assert json.loads(with_state(raw, {"prompt": "x"})) == {"migration": {}, "prompt": "x"}
    assert json.loads(with_state(b"{ }", {})) == {"migration": {}}


def test_a_leg_whose_first_event_names_no_tokens_is_relayed_as_it_comes():
    """An engine that does not speak the protocol (its first event names no
    tokens) has its blocks forwarded unread; a first block that opens with a
    comment is read (a ``: migrate`` before the first token), a capable leg's
    ids and ``created`` are kept."""
    engine = SimpleNamespace(
        url="http://e", load=SimpleNamespace(resume_identity=None, compat_hash="c")
    )
    migrator = SimpleNamespace(legs=None, max_migrations=1)

    def leg() -> Migrating:
        call = SimpleNamespace(migration=Migration({}), request_id="r")
        return Migrating(migrator, call, engine, None)  # type: ignore[arg-type]

    plain = leg()
    first = b'data: {"created":5}\n\ndata: {"x":1}\n\n'
    assert plain.events(first, True) == (first, False) and not plain.capable
    later = b": ids 1\ndata: {}\n\n: migrate\n\n"
    assert plain.events(later, False) == (later, False)
    assert plain.state.sent == [] and plain.state.created is None
    handed = leg()
    assert handed.events(b": migrate\n\n", True) == (b"", True)
    capable = leg()
    assert capable.events(b': ids 4\ndata: {"created":7}\n\n', True) == (
        b'data: {"created":7}\n\n',
        False,
    )
    assert capable.capable and capable.state.sent == [4] and capable.state.created == 7
    assert capable.events(b': end 5\ndata: {"y":2}\n\n', False) == (b'data: {"y":2}\n\n', False)
    assert capable.state.sent == [4, 5] and capable.state.finished == {0}
