"""The Batch API's PostgreSQL store, on a real PostgreSQL server: the same
behaviour as the SQLite store, requests claimed once across replicas, leases
that hand a stopped replica's work to another, and two gateway processes
sharing one database, one of them killed mid-batch, losing nothing."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
from gateway.test_batch import HoldingEngine, client, finished, jsonl, line, upload
from helpers.fleet import start_gateway
from helpers.postgres import postgres_server
from helpers.server import wait_until

from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.gateway.batch.store import (
    BatchStore,
    PostgresBatchStore,
    SqliteBatchStore,
    open_store,
)

KEY = "batch-key"


@pytest.fixture(scope="module")
def pg_url():
    with postgres_server() as url:
        yield url


@pytest.fixture(scope="module")
def engine():
    e = HoldingEngine()
    yield e
    e.release.set()
    e.close()


def emptied(s: BatchStore) -> BatchStore:
    """``s`` with no files, batches nor requests (tests share one server)."""
    with s.tx():
        for table in ("files", "file_data", "batches", "requests"):
            s.execute(f"DELETE FROM {table}")  # noqa: S608 (constant names)
    return s


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path, pg_url):
    s: BatchStore
    if request.param == "sqlite":
        s = SqliteBatchStore(str(tmp_path / "data"))
    else:
        s = emptied(PostgresBatchStore(pg_url))
    yield s
    s.close()


def new_batch(s: BatchStore, batch_id: str, n: int, owner: str = "k") -> None:
    now = int(time.time())
    batch = {"id": batch_id, "status": "in_progress", "created_at": now, "expires_at": now + 60}
    rows = [(i, f"c{i}", json.dumps({"prompt": f"p{i}"}), "pending", None) for i in range(n)]
    s.add_batch(owner, batch, rows)


def test_both_stores_keep_files_batches_and_requests_alike(store):
    blob = bytes(range(256)) * 3  # binary content survives
    f1 = store.add_file("k", "batch", "a.jsonl", blob)
    f2 = store.add_file("k", "batch_output", "b.jsonl", b"x\n")
    assert store.read_file(f1["id"]) == blob and f1["bytes"] == len(blob)
    assert store.file("other", f1["id"]) is None  # another key's file is not there
    assert {f["id"] for f in store.files("k", None, 10, None)} == {f1["id"], f2["id"]}
    assert [f["id"] for f in store.files("k", "batch", 10, None)] == [f1["id"]]
    first = store.files("k", None, 1, None)
    assert len(first) == 1 and store.files("k", None, 5, first[0]["id"]) != first
    assert store.delete_file("k", f1["id"]) and not store.delete_file("k", f1["id"])
    with pytest.raises(FileNotFoundError):
        store.read_file(f1["id"])

    new_batch(store, "batch-1", 3)
    assert store.batch("k", "batch-1")["status"] == "in_progress"
    assert store.batch("other", "batch-1") is None and store.owner_of("batch-1") == "k"
    assert [b["_owner"] for b in store.active_batches()] == ["k"]
    claimed = store.claim("batch-1", 2, "me", 10)
    assert [r["line"] for r in claimed] == [0, 1]
    store.finish("batch-1", 0, "done", {"ok": 0})
    store.finish("batch-1", 1, "pending", None)  # to be tried again
    assert store.counts("batch-1") == {"done": 1, "pending": 2}
    assert store.pending_demand() == {"pending": 2}
    store.fail_pending("batch-1", "batch_cancelled", "cancelled")
    assert [json.loads(x)["error"]["code"] for x in store.results("batch-1", "failed")] == [
        "batch_cancelled"
    ] * 2
    assert [json.loads(x) for x in store.results("batch-1", "done")] == [{"ok": 0}]


def test_leases_hand_a_stopped_runners_requests_and_finalization_to_another(store):
    new_batch(store, "batch-2", 4)
    store.claim("batch-2", 2, "alive", 30)
    store.claim("batch-2", 2, "stopped", -1)  # its lease has ended already
    assert store.renew("alive", 30) == 2
    assert store.reclaim() == 2  # only the stopped runner's
    assert store.counts("batch-2") == {"running": 2, "pending": 2}
    assert [r["line"] for r in store.claim("batch-2", 5, "alive", 30)] == [2, 3]
    # One finalizer at a time; a stopped one's hold ends with its lease.
    assert store.claim_finalize("batch-2", "stopped", -1)
    assert store.claim_finalize("batch-2", "alive", 30)
    assert not store.claim_finalize("batch-2", "third", 30)
    assert store.claim_finalize("batch-2", "alive", 30)  # its own, again


def test_replicas_claim_every_request_exactly_once(pg_url):
    replicas = [emptied(PostgresBatchStore(pg_url)) for _ in range(3)]
    new_batch(replicas[0], "batch-3", 300)
    got: list[list[int]] = [[] for _ in replicas]

    def drain(i: int) -> None:
        while rows := replicas[i].claim("batch-3", 7, f"r{i}", 30):
            got[i] += [r["line"] for r in rows]

    threads = [threading.Thread(target=drain, args=(i,)) for i in range(len(replicas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    every = [x for g in got for x in g]
    assert sorted(every) == list(range(300))  # each once: none twice, none left
    assert sum(1 for g in got if g) >= 2  # the replicas really shared the work
    for r in replicas:
        r.close()


def test_the_gateway_takes_the_database_from_the_environment_and_never_shows_it(monkeypatch):
    import argparse

    monkeypatch.setenv("PDFLEET_BATCH_DATABASE_URL", "postgresql://u:secret@db/x")
    parser = argparse.ArgumentParser()
    GatewayConfig.add_cli_args(parser)
    config = GatewayConfig.from_cli_args(parser.parse_args(["--decode", "http://e"]))
    assert config.batch_database_url == "postgresql://u:secret@db/x"
    assert "secret" not in repr(config) and "secret" not in " ".join(config.to_cli_args())
    with pytest.raises(ValueError, match="two stores"):
        GatewayConfig(decode=["http://e"], data_dir="/d", batch_database_url="postgresql://x")
    with pytest.raises(ValueError, match="must be a PostgreSQL URL"):
        GatewayConfig(decode=["http://e"], batch_database_url="mysql://u:secret@db/x")
    assert open_store(None, None) is None


def gateway_args(engine, pg_url) -> list[str]:
    return [
        "--decode", engine.url,
        "--disaggregation-mode", "Disabled",
        "--api-key", KEY,
        "--scrape-interval", "0.2",
    ]  # fmt: skip


def test_two_gateways_share_batches_and_a_killed_ones_requests_run_on_the_other(
    engine, pg_url, tmp_path
):
    env = {"PDFLEET_BATCH_DATABASE_URL": pg_url}
    emptied(PostgresBatchStore(pg_url)).close()
    engine.release.clear()
    a = start_gateway(gateway_args(engine, pg_url), tmp_path, env=env)
    b = None
    try:
        ca = client(a, KEY)
        lines = [line("held", "hold-pg")] + [line(f"r{i}", f"pg{i}") for i in range(12)]
        batch = ca.batches.create(
            input_file_id=upload(ca, lines), endpoint="/v1/completions", completion_window="24h"
        )
        # A runs the held request; then B starts on the same database.
        assert wait_until(
            lambda: any(s.body.get("prompt") == "hold-pg" for s in engine.posts()), 15
        )
        b = start_gateway(gateway_args(engine, pg_url), tmp_path, env=env)
        cb = client(b, KEY)
        assert cb.batches.retrieve(batch.id).id == batch.id  # one batch, seen by both
        a.signal(signal.SIGKILL)
        a.proc.wait(10)
        engine.release.set()
        # B finishes the batch: the held request once A's lease ends.
        done = finished(cb, batch.id, timeout=60)
        out = jsonl(cb, done.output_file_id)
        assert sorted(o["custom_id"] for o in out) == sorted(
            ["held"] + [f"r{i}" for i in range(12)]
        )
        assert done.error_file_id is None and done.request_counts.completed == 13
        assert cb.files.content(done.output_file_id).text  # the output file is B's to serve
    finally:
        a.stop()
        if b is not None:
            b.stop()
