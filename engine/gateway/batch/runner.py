"""Runs the requests of batches: in the batch band, on idle capacity, within
each batch's completion window.

One task per gateway (``--workers N``: worker 0's) looks at the active
batches every ``TICK_S`` and starts a batch request only while nothing
waits for a slot (no online request queued in the gateway, no decode engine
reporting a queue of its own) and fewer than ``--batch-concurrency`` batch
requests run. Each request goes through the gateway's own front door (its
port, the fleet token, the batch header naming the batch's owner), so it is
checked, admitted, routed and counted like any other, in the lowest band:
an online request that arrives while it waits for a slot goes first.

A request answered 429, 503 or 5xx (or not at all) is tried again later, at
most ``MAX_ATTEMPTS`` times; any other answer is its result (a 2xx to the
output file, a 4xx to the error file).

Gateway replicas sharing a PostgreSQL store each run their own runner on the
same batches: each claims requests under a lease it renews while it runs
them (so the requests of a runner that stopped run again elsewhere within
``LEASE_S``), and one runner at a time finalizes a batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

import httpx

from ...contracts.errors import ErrorBody
from ..flow.gate import BATCH_HEADER
from .store import ACTIVE, BatchStore, line_error, new_id

logger = logging.getLogger("pdfleet.gateway.batch")

TICK_S = 0.2
MAX_ATTEMPTS = 5
# A claimed request's lease, renewed every LEASE_RENEW_S while its runner
# lives: a stopped runner's requests run again elsewhere within LEASE_S.
LEASE_S = 6.0
LEASE_RENEW_S = 1.5
# A finalizing runner's hold on its batch (writing two files takes far less).
FINALIZE_LEASE_S = 60.0
T = TypeVar("T")


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        base_url: str,
        token: str,
        concurrency: int,
        idle: Callable[[], bool],
        request_timeout: float,
        on_counts: Callable[[dict[str, int]], None] = lambda counts: None,
    ) -> None:
        self.store = store
        self.base_url = base_url
        self.token = token
        self.concurrency = concurrency
        self.idle = idle
        self.on_counts = on_counts
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout, connect=5.0))
        self.who = f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        """This runner, as the batches it finalizes name it."""
        self._renewed_at = time.monotonic()
        self.db_thread = concurrent.futures.ThreadPoolExecutor(1, "pdfleet-batch-db")
        """Every database call runs here, never on the event loop."""
        self.running: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self.wake = asyncio.Event()

    async def db(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.db_thread, fn, *args)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="pdfleet-batch-runner")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self.running) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.client.aclose()
        self.db_thread.shutdown(wait=True)

    async def _loop(self) -> None:
        recovered = await self.db(self.store.recover)
        if recovered:
            logger.info(
                "batch: %d request(s) left running by the last gateway run again", recovered
            )
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad tick must not end the runner
                logger.exception("batch runner tick failed")
            self.wake.clear()
            try:
                async with asyncio.timeout(TICK_S):
                    await self.wake.wait()
            except TimeoutError:
                pass

    async def tick(self) -> None:
        now = int(time.time())
        if time.monotonic() - self._renewed_at >= LEASE_RENEW_S:
            self._renewed_at = time.monotonic()
            await self.db(self.store.renew, self.who, LEASE_S)
            if reclaimed := await self.db(self.store.reclaim):
                logger.info("batch: %d request(s) whose runner stopped run again", reclaimed)
        self.on_counts(await self.db(self.store.pending_demand))
        for batch in await self.db(self.store.active_batches):
            counts = await self.db(self.store.counts, batch["id"])
            running = counts.get("running", 0) + sum(
                1 for t in self.running if t.get_name() == batch["id"]
            )
            if batch["status"] == "cancelling" or now >= batch["expires_at"]:
                if running:
                    continue  # its requests in flight finish first
                cancelled = batch["status"] == "cancelling"
                code = "batch_cancelled" if cancelled else "batch_expired"
                what = "cancelled" if cancelled else "expired: its completion window ended"
                await self.db(self.store.fail_pending, batch["id"], code, f"the batch was {what}")
                await self.finalize(batch, "cancelled" if cancelled else "expired")
                continue
            if not counts.get("pending") and not running:
                await self.finalize(batch, "completed")
                continue
            while len(self.running) < self.concurrency and self.idle():
                rows = await self.db(self.store.claim, batch["id"], 1, self.who, LEASE_S)
                if not rows:
                    break
                task = asyncio.create_task(self.run_one(batch, rows[0]), name=batch["id"])
                self.running.add(task)
                task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self.running.discard(task)
        self.wake.set()

    async def run_one(self, batch: dict[str, Any], row: Any) -> None:
        request_id = new_id("batch_req")
        line, custom_id = row["line"], row["custom_id"]
        try:
            resp = await self.client.post(
                self.base_url + batch["endpoint"],
                content=row["body"],
                headers={
                    "authorization": f"Bearer {self.token}",
                    "content-type": "application/json",
                    "x-request-id": request_id,
                    BATCH_HEADER: batch["_owner"],
                },
            )
        except httpx.HTTPError as e:
            await self._retry_or_fail(batch, row, f"the request failed: {type(e).__name__}")
            return
        if resp.status_code in (408, 429) or resp.status_code >= 500:
            await self._retry_or_fail(batch, row, f"answered {resp.status_code}")
            return
        ok = resp.status_code < 300
        try:
            answer: Any = resp.json()
        except ValueError:
            # Not JSON: OpenAI's error body (a 2xx that is not JSON is a bad gateway's).
            status = resp.status_code if resp.status_code >= 400 else 502
            answer, ok = ErrorBody(resp.text[:1000], status).to_dict(), False
        result = {
            "id": request_id,
            "custom_id": custom_id,
            "response": {
                "status_code": resp.status_code,
                "request_id": resp.headers.get("x-request-id", request_id),
                "body": answer,
            },
            "error": None,
        }
        state = "done" if ok else "failed"
        await self.db(self.store.finish, batch["id"], line, state, result)

    async def _retry_or_fail(self, batch: dict[str, Any], row: Any, why: str) -> None:
        if row["attempts"] + 1 >= MAX_ATTEMPTS:
            error = line_error(
                row["custom_id"], "request_failed", f"{why} ({MAX_ATTEMPTS} attempts)"
            )
            await self.db(self.store.finish, batch["id"], row["line"], "failed", error)
        else:
            await self.db(self.store.finish, batch["id"], row["line"], "pending", None)
            await asyncio.sleep(1.0)  # this slot of the runner backs off a second

    async def finalize(self, batch: dict[str, Any], status: str) -> None:
        """Write the output and error files, then the batch's final state (by
        one runner: another replica's may be finalizing it)."""
        if not await self.db(self.store.claim_finalize, batch["id"], self.who, FINALIZE_LEASE_S):
            return
        fresh = await self.db(self.store.batch, None, batch["id"])
        if fresh is None or fresh["status"] not in ACTIVE:
            return
        batch = {**fresh, "_owner": batch["_owner"]}
        batch["status"] = "finalizing" if status == "completed" else batch["status"]
        batch["finalizing_at"] = batch.get("finalizing_at") or int(time.time())
        for state, key, name in (
            ("done", "output_file_id", "output"),
            ("failed", "error_file_id", "errors"),
        ):
            lines = await self.db(self.store.results, batch["id"], state)
            if lines:
                content = ("\n".join(lines) + "\n").encode()
                f = await self.db(
                    self.store.add_file,
                    batch["_owner"],
                    "batch_output",
                    f"{batch['id']}_{name}.jsonl",
                    content,
                )
                batch[key] = f["id"]
        counts = await self.db(self.store.counts, batch["id"])
        batch["request_counts"] = {
            "total": sum(counts.values()),
            "completed": counts.get("done", 0),
            "failed": counts.get("failed", 0),
        }
        batch["status"] = status
        batch[f"{status}_at"] = int(time.time())
        await self.db(self.store.save_batch, strip(batch))
        logger.info("batch %s %s: %s", batch["id"], status, json.dumps(batch["request_counts"]))


def strip(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch as stored and answered (without the runner's own keys)."""
    return {k: v for k, v in batch.items() if not k.startswith("_")}
