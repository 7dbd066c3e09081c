"""One request through `pdfleet up` is one trace: gateway, both legs, the KV
pull on the decode engine, with correct parent links (also on a fallback)."""

from __future__ import annotations

import os
import secrets
import signal
from pathlib import Path

import openai
import pytest
from helpers.server import wait_until
from otlp_receiver import Span

SERVER, CLIENT = 2, 3  # OTLP span kinds


def traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def prompt(tag: str) -> str:
    # Long enough for the prefill leg (minPromptTokens 32), unique per test so no
    # engine has its prefix cached.
    return f"[{tag}] The harbor was quiet before dawn. Boats rocked against the pier. " * 6


def one(spans: list[Span], name: str, **where) -> Span:
    found = [
        s
        for s in spans
        if s.name == name and all(s.attributes.get(k) == v for k, v in where.items())
    ]
    assert len(found) == 1, (name, where, [(s.service, s.name) for s in spans])
    return found[0]


def has(*names: str):
    """A wait predicate: the trace holds these spans (each process exports on its own)."""

    def check(spans: list[Span]) -> bool:
        got = [s.name for s in spans]
        return all(got.count(n) >= names.count(n) for n in set(names))

    return check


def children(spans: list[Span], parent: Span) -> dict[str, Span]:
    return {s.name: s for s in spans if s.parent_id == parent.span_id}


@pytest.fixture(scope="module")
def client(fleet):
    return openai.OpenAI(base_url=fleet.url + "/v1", api_key="x", max_retries=0, timeout=120)


def test_pd_request_is_one_trace_with_legs_kv_pull_and_finish(fleet, client, receiver):
    header, trace_id, client_span = traceparent()
    chunks = client.completions.create(
        model="tiny",
        prompt=prompt("pd"),
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_headers={"traceparent": header},
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices)

    everything = has(
        "gateway POST /v1/completions", "prefill leg", "decode leg", "prefill request",
        "decode request", "queue", "queue", "prefill forward", "kv pull", "decode", "end", "end",
    )  # fmt: skip
    spans = receiver.wait_for(trace_id, everything)
    assert {s.trace_id for s in spans} == {trace_id}
    # Only pdfleet's spans: FastAPI's native telemetry (global provider) stays silent.
    assert {s.name for s in spans} == {
        "gateway POST /v1/completions", "prefill leg", "decode leg", "prefill request",
        "decode request", "queue", "prefill forward", "kv pull", "decode", "end",
    }  # fmt: skip

    gateway = one(spans, "gateway POST /v1/completions")
    assert gateway.parent_id == client_span, "the client's traceparent is the root's parent"
    assert gateway.kind == SERVER and gateway.service == "pdfleet-gateway"
    assert gateway.attributes["pdfleet.route_decision"] == "prefill_decode"
    assert gateway.attributes["pdfleet.route_reason"] == "long_prompt"
    assert gateway.attributes["pdfleet.decode_engine"] == fleet.engine_url("decode")
    assert gateway.attributes["pdfleet.prefill_engine"] == fleet.engine_url("prefill")
    assert any(
        x.startswith(fleet.engine_url("decode"))
        for x in gateway.attributes["pdfleet.decode_scores"]
    )
    assert "pdfleet.fallback" not in gateway.attributes

    prefill_leg = one(spans, "prefill leg")
    decode_leg = one(spans, "decode leg")
    for leg in (prefill_leg, decode_leg):
        assert leg.parent_id == gateway.span_id and leg.kind == CLIENT and not leg.error
    assert decode_leg.attributes["pdfleet.kv_transfer"] is True
    assert decode_leg.attributes["pdfleet.time_to_first_chunk_s"] > 0
    assert prefill_leg.end_ns <= decode_leg.start_ns, "the decode leg starts after the prefill leg"

    prefill = one(spans, "prefill request")
    assert prefill.parent_id == prefill_leg.span_id and prefill.kind == SERVER
    assert prefill.service == "pdfleet-engine"
    assert prefill.attributes["pdfleet.queue_wait_s"] >= 0
    p_children = children(spans, prefill)
    assert set(p_children) == {"queue", "prefill forward", "end"}
    assert p_children["prefill forward"].attributes["pdfleet.prompt_tokens"] > 32
    assert p_children["queue"].end_ns <= p_children["prefill forward"].end_ns

    decode = one(spans, "decode request")
    assert decode.parent_id == decode_leg.span_id and decode.kind == SERVER
    d_children = children(spans, decode)
    assert set(d_children) == {"queue", "kv pull", "decode", "end"}
    pull = d_children["kv pull"]
    assert not pull.error
    assert pull.attributes["pdfleet.kv.blocks"] >= 4
    assert pull.attributes["pdfleet.kv.bytes"] > 0 and pull.attributes["pdfleet.kv.gbps"] > 0
    assert pull.attributes["pdfleet.kv.peer_engine_id"].startswith("tiny-prefill-0")
    assert d_children["decode"].attributes["pdfleet.time_to_first_token_s"] > 0
    assert d_children["decode"].attributes["pdfleet.output_tokens"] == 8
    assert d_children["end"].attributes["pdfleet.finish_reason"] == "length"
    # The engine spans lie inside their legs (clocks of one machine).
    assert prefill_leg.start_ns <= prefill.start_ns
    assert decode_leg.start_ns <= pull.start_ns


def test_short_prompt_is_a_decode_only_trace(fleet, client, receiver):
    header, trace_id, _ = traceparent()
    out = client.completions.create(
        model="tiny",
        prompt="Hi",
        max_tokens=4,
        temperature=0,
        extra_headers={"traceparent": header},
    )
    assert out.choices[0].finish_reason == "length"
    everything = has(
        "gateway POST /v1/completions", "decode leg", "decode request", "queue",
        "prefill forward", "decode", "end",
    )  # fmt: skip
    spans = receiver.wait_for(trace_id, everything)
    gateway = one(spans, "gateway POST /v1/completions")
    assert gateway.attributes["pdfleet.route_decision"] == "decode_only"
    assert gateway.attributes["pdfleet.route_reason"] == "short_prompt"
    assert not any(s.name == "prefill leg" for s in spans)
    decode = one(spans, "decode request")
    assert decode.parent_id == one(spans, "decode leg").span_id
    assert set(children(spans, decode)) == {"queue", "prefill forward", "decode", "end"}


def _pid_serving(port: int) -> int:
    """The process whose command line has ``--port PORT`` (the engine child)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for i, arg in enumerate(argv[:-1]):
            if arg == b"--port" and argv[i + 1] == str(port).encode() and b"serve" in argv:
                return int(entry.name)
    raise LookupError(f"no engine process on port {port}")


def test_fallback_when_the_prefill_engine_dies_is_still_one_trace(fleet, client, receiver):
    """Runs last: it kills the prefill engine (`pdfleet up` restarts it)."""
    url = fleet.engine_url("prefill")
    pid = _pid_serving(int(url.rsplit(":", 1)[1]))
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not Path(f"/proc/{pid}").exists() or _zombie(pid), 10)
    header, trace_id, client_span = traceparent()
    out = client.completions.create(
        model="tiny",
        prompt=prompt("fallback"),
        max_tokens=4,
        temperature=0,
        extra_headers={"traceparent": header},
    )
    assert out.choices[0].finish_reason == "length"
    everything = has("gateway POST /v1/completions", "decode leg", "decode request", "end")
    spans = receiver.wait_for(trace_id, everything)
    gateway = one(spans, "gateway POST /v1/completions")
    assert gateway.parent_id == client_span
    # Either the gateway tried the dead engine (a failed prefill leg) or its
    # health check had already ejected it: both are a decode-only fallback.
    assert gateway.attributes["pdfleet.fallback"] in ("prefill_failed", "no_prefill_engine")
    for leg in (s for s in spans if s.name == "prefill leg"):
        assert leg.parent_id == gateway.span_id and leg.error
    assert any(s.name == "prefill leg" for s in spans) == (
        gateway.attributes["pdfleet.fallback"] == "prefill_failed"
    )
    decode_leg = one(spans, "decode leg")
    assert decode_leg.parent_id == gateway.span_id and not decode_leg.error
    decode = one(spans, "decode request")
    assert decode.parent_id == decode_leg.span_id
    assert decode.attributes["pdfleet.leg"] == "decode_only"
    assert children(spans, decode)["end"].attributes["pdfleet.finish_reason"] == "length"


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
