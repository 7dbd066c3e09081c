"""A migrated stream's trace: the move is a ``migration`` span under the
request's root, from the failure to the resumed leg's first event, naming its
reason, the two engines and the tokens replayed; each leg is a ``decode leg``
span of its own. The decode engines are fakes that speak the migration wire
(a stream handed back by a stopping engine, then resumed); a real gateway
process exports to the test's OTLP receiver."""

from __future__ import annotations

import os

import httpx
from gateway.fake_engine import FakeEngine
from gateway.test_migration import handing_back_once
from helpers.fleet import start_gateway
from helpers.server import wait_until


def test_a_move_is_a_migration_span_with_its_reason_engines_and_replayed_tokens(receiver, tmp_path):
    # The first leg goes to ``first`` (the shorter queue), which hands it back.
    first = FakeEngine(answer=handing_back_once, resume_identity="r1")
    second = FakeEngine(answer=handing_back_once, resume_identity="r1", waiting=2)
    fakes = [first, second]
    env = {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": receiver.endpoint,
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    gw = None
    try:
        gw = start_gateway(
            [
                *(x for f in fakes for x in ("--decode", f.url)),
                "--disaggregation-mode",
                "Disabled",
                "--scrape-interval",
                "0.2",
                "--trust-client-trace-context",
            ],
            tmp_path,
            env={**os.environ, **env},
        )
        scrapes = 2 * int(os.environ.get("PDFLEET_TEST_GATEWAY_WORKERS") or 1)
        assert wait_until(
            lambda: all(sum(s.path == "/metrics" for s in f.seen) >= scrapes for f in fakes), 30
        )
        trace_id = "ef" * 16
        body = {"model": "tiny", "prompt": "hi", "stream": True}
        headers = {"traceparent": f"00-{trace_id}-{'12' * 8}-01"}
        with httpx.stream(
            "POST", gw.url + "/v1/completions", json=body, headers=headers, timeout=60
        ) as resp:
            assert resp.status_code == 200
            raw = resp.read()
        assert b"t3 " in raw and b"error" not in raw
        spans = receiver.wait_for(
            trace_id, lambda s: any(x.name.startswith("gateway POST") for x in s)
        )
        (root,) = [s for s in spans if s.name == "gateway POST /v1/completions"]
        (move,) = [s for s in spans if s.name == "migration"]
        assert move.parent_id == root.span_id
        assert move.attributes["pdfleet.migration.reason"] == "drain"
        assert move.attributes["pdfleet.migration.from"] == first.url
        assert move.attributes["pdfleet.migration.to"] == second.url
        assert move.attributes["pdfleet.migration.replayed_tokens"] == 2
        legs = sorted((s for s in spans if s.name == "decode leg"), key=lambda s: s.start_ns)
        assert [leg.attributes["pdfleet.engine"] for leg in legs] == [first.url, second.url]
        # The move spans the failure (the first leg's end) to the resumed leg's first event.
        assert legs[0].start_ns <= move.start_ns <= move.end_ns
        assert legs[1].start_ns <= move.end_ns
    finally:
        if gw is not None:
            gw.stop()
        for f in fakes:
            f.close()
