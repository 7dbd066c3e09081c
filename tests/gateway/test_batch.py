"""The OpenAI Batch API through a real gateway process and the official
``openai`` client: upload, create, poll, download, list, cancel, per-line
errors, and a gateway killed mid-batch that loses nothing.

The engine is a recording fake (``fake_engine.py``) that can hold the
requests of chosen prompts, so a batch can be stopped exactly where a test
wants it.
"""

from __future__ import annotations

import json
import signal
import threading

import httpx
import openai
import pytest
from gateway.fake_engine import FakeEngine
from helpers.fleet import metric, start_gateway
from helpers.server import wait_until

from pdfleet.engine.gateway.flow.tenants import BATCH_BAND

KEY, OTHER = "batch-key", "other-key"


class HoldingEngine(FakeEngine):
    """Answers a completion with its prompt; a prompt starting with "hold"
    waits until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

        def answer(body):
            if str(body["prompt"]).startswith("hold"):
                self.release.wait(60)
            out = {
                "id": "c",
                "object": "text_completion",
                "choices": [
                    {"index": 0, "text": f"echo {body['prompt']}", "finish_reason": "stop"}
                ],
            }
            return 200, json.dumps(out).encode()

        self.answer = answer


@pytest.fixture(scope="module")
def engine():
    e = HoldingEngine()
    yield e
    e.release.set()
    e.close()


def gateway_args(engine, data_dir) -> list[str]:
    return [
        "--decode", engine.url,
        "--disaggregation-mode", "Disabled",
        "--api-key", f"{KEY},{OTHER}",
        "--data-dir", str(data_dir),
        "--engine-priority",
        "--scrape-interval", "0.2",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("batch-data")


@pytest.fixture(scope="module")
def gateway(engine, data_dir, tmp_path_factory):
    gw = start_gateway(gateway_args(engine, data_dir), tmp_path_factory.mktemp("batch"))
    yield gw
    gw.stop()


def client(gw, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=30)


def line(custom_id: str, prompt: str, **body) -> bytes:
    request = {"prompt": prompt, "max_tokens": 4, **body}
    item = {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": request}
    return json.dumps(item).encode()


def upload(c: openai.OpenAI, lines: list[bytes]) -> str:
    return c.files.create(file=("in.jsonl", b"\n".join(lines) + b"\n"), purpose="batch").id


def finished(c: openai.OpenAI, batch_id: str, status: str = "completed", timeout: float = 30):
    got = {}

    def done() -> bool:
        got["b"] = c.batches.retrieve(batch_id)
        return got["b"].status == status

    assert wait_until(done, timeout), got["b"]
    return got["b"]


def jsonl(c: openai.OpenAI, file_id: str | None) -> list[dict]:
    assert file_id is not None
    return [json.loads(x) for x in c.files.content(file_id).text.splitlines() if x]


def test_a_batch_runs_through_the_official_client_with_per_line_errors(gateway, engine):
    c = client(gateway)
    lines = [line(f"ok-{i}", f"p{i}") for i in range(5)]
    lines += [
        b"{not json",
        line("ok-0", "again"),  # a repeated custom_id
        line("bad-n", "x", n=10**6),  # the gateway's 400 naming n
    ]
    file_id = upload(c, lines)
    assert c.files.retrieve(file_id).purpose == "batch"
    batch = c.batches.create(
        input_file_id=file_id,
        endpoint="/v1/completions",
        completion_window="24h",
        metadata={"job": "t1"},
    )
    assert batch.status == "in_progress" and batch.request_counts.total == 8
    assert [e.line for e in batch.errors.data] == [6, 7]
    done = finished(c, batch.id)
    assert (done.request_counts.completed, done.request_counts.failed) == (5, 3)
    assert done.metadata == {"job": "t1"}
    out = jsonl(c, done.output_file_id)
    assert [o["custom_id"] for o in out] == [f"ok-{i}" for i in range(5)]
    assert out[2]["response"]["status_code"] == 200
    assert out[2]["response"]["body"]["choices"][0]["text"] == "echo p2"
    errors = jsonl(c, done.error_file_id)
    assert [e["error"] and e["error"]["line"] for e in errors[:2]] == [6, 7]
    assert errors[2]["custom_id"] == "bad-n"
    assert errors[2]["response"]["status_code"] == 400
    assert errors[2]["response"]["body"]["error"]["param"] == "n"
    # Batch requests reach the engines in the batch band (the lowest priority).
    sent = [s.body for s in engine.posts() if s.body.get("prompt") == "p0"]
    assert sent and sent[0]["priority"] >> 40 == BATCH_BAND
    # Listing, and another key sees none of it.
    assert batch.id in [b.id for b in c.batches.list()]
    assert file_id in [f.id for f in c.files.list()]
    with pytest.raises(openai.NotFoundError):
        client(gateway, OTHER).batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        client(gateway, OTHER).files.content(file_id)
    assert c.files.delete(file_id).deleted
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(file_id)


def test_bad_batches_are_400s_naming_the_field(gateway):
    c = client(gateway)
    file_id = upload(c, [line("a", "p")])
    for kwargs, param in (
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "forever"}, "completion_window"),
    ):
        fields = {"endpoint": "/v1/completions", "completion_window": "24h", **kwargs}
        with pytest.raises(openai.BadRequestError) as e:
            c.batches.create(input_file_id=file_id, **fields)
        assert e.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        c.batches.create(
            input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h"
        )
    r = httpx.post(
        gateway.url + "/v1/files",
        headers={"authorization": f"Bearer {KEY}"},
        files={"file": ("x.jsonl", b"{}\n")},
        data={"purpose": "fine-tune"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"


def test_cancel_keeps_what_finished_and_fails_the_rest(gateway, engine):
    engine.release.clear()
    c = client(gateway)
    lines = [line("first", "p-first"), line("held", "hold-1")]
    lines += [line(f"later-{i}", f"p-later-{i}") for i in range(20)]
    batch = c.batches.create(
        input_file_id=upload(c, lines), endpoint="/v1/completions", completion_window="24h"
    )
    assert wait_until(lambda: any(s.body.get("prompt") == "hold-1" for s in engine.posts()), 15)
    cancelling = c.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    engine.release.set()
    done = finished(c, batch.id, "cancelled")
    out = {o["custom_id"] for o in jsonl(c, done.output_file_id)}
    assert {"first", "held"} <= out
    errors = jsonl(c, done.error_file_id)
    assert errors and all(e["error"]["code"] == "batch_cancelled" for e in errors)
    assert len(out) + len(errors) == 22  # nothing lost


def test_a_gateway_killed_mid_batch_loses_nothing(engine, tmp_path):
    """SIGKILL while a request runs: a new gateway on the same data directory
    runs it again and finishes the batch; every line has one result."""
    engine.release.clear()
    data_dir = tmp_path / "data"  # this test's gateways' own
    gw = start_gateway(gateway_args(engine, data_dir), tmp_path)
    try:
        c = client(gw)
        lines = [line(f"r{i}", f"k{i}") for i in range(3)] + [line("held", "hold-2")]
        lines += [line(f"s{i}", f"m{i}") for i in range(3)]
        batch = c.batches.create(
            input_file_id=upload(c, lines), endpoint="/v1/completions", completion_window="24h"
        )
        assert wait_until(lambda: c.batches.retrieve(batch.id).request_counts.completed >= 3, 15)
        assert wait_until(lambda: metric(gw.url, "pdfleet_gateway_batch_requests") >= 1, 10)
        assert c.batches.retrieve(batch.id).request_counts.completed < 7
        gw.signal(signal.SIGKILL)
        gw.proc.wait(10)
    finally:
        gw.stop()
    engine.release.set()
    held_runs = sum(1 for s in engine.posts() if s.body.get("prompt") == "hold-2")
    again = start_gateway(gateway_args(engine, data_dir), tmp_path)
    try:
        c = client(again)
        done = finished(c, batch.id)
        out = jsonl(c, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(
            [f"r{i}" for i in range(3)] + ["held"] + [f"s{i}" for i in range(3)]
        )
        assert done.error_file_id is None
        # The held request ran again on the new gateway (at least once).
        assert sum(1 for s in engine.posts() if s.body.get("prompt") == "hold-2") == held_runs + 1
    finally:
        again.stop()
