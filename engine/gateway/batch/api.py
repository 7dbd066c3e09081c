"""``/v1/files`` and ``/v1/batches`` as the official ``openai`` client calls them.

Files: upload (multipart ``file`` and ``purpose``; a batch input is JSONL),
list, retrieve, download (``/content``), delete. Batches: create (from an
uploaded ``batch`` file, for ``/v1/completions`` or ``/v1/chat/completions``,
within a ``completion_window`` of hours), retrieve, list, cancel. Every
object belongs to the API key that made it (a gateway without keys: to
everyone); another key's ids answer 404.

A batch's input is read when it is created. Each line is one request
(``custom_id``, ``method: POST``, ``url`` the batch's endpoint, ``body``); a
line that is not that (invalid JSON, a missing or repeated ``custom_id``,
another URL, a streamed body) fails alone, with its line number, in the
error file; the other lines run.
"""

from __future__ import annotations

import email.parser
import email.policy
import json
import re
import time
from typing import Any
from urllib.parse import parse_qs

from starlette.responses import JSONResponse, Response

from ...contracts.errors import ErrorBody
from ...http.asgi import BytesResponse, Request
from ...http.limits import BodyRejected, read_body
from .runner import BatchRunner, strip
from .store import BatchStore, InputRow, line_error, new_id

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# OpenAI's bounds on a batch input file.
MAX_LINES = 50_000
MAX_WINDOW_HOURS = 168
_WINDOW = re.compile(r"([1-9][0-9]{0,2})h")
_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_METADATA = 16


class BatchError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, status, param


def error(e: BatchError) -> Response:
    body = ErrorBody(e.message, e.status, e.param)
    return BytesResponse(body.encode(), e.status, [(b"content-type", b"application/json")])


def parse_multipart(content_type: str, raw: bytes) -> dict[str, tuple[str | None, bytes]]:
    """``multipart/form-data`` fields: name → (filename, bytes)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise BatchError("upload the file as multipart/form-data (fields file and purpose)")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"content-type: " + content_type.encode("latin-1") + b"\r\n\r\n" + raw
    )
    if not message.is_multipart():
        raise BatchError("the multipart body does not parse")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True)
            fields[name] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    return fields


def parse_input(content: bytes, endpoint: str) -> list[InputRow]:
    """The store's request rows of a batch input file (see :meth:`BatchStore.add_batch`)."""
    rows: list[InputRow] = []
    seen: set[str] = set()
    lines = content.split(b"\n")
    if len([x for x in lines if x.strip()]) > MAX_LINES:
        raise BatchError(f"a batch holds at most {MAX_LINES} requests", param="input_file_id")
    number = 0
    for raw in lines:
        if not raw.strip():
            continue
        number += 1
        custom_id = None
        try:
            item = json.loads(raw)
            if not isinstance(item, dict):
                raise ValueError("the line is not a JSON object")
            custom_id = item.get("custom_id")
            if not isinstance(custom_id, str) or not custom_id:
                custom_id = None
                raise ValueError("custom_id: missing, or not a string")
            if custom_id in seen:
                raise ValueError(f"custom_id: {custom_id!r} appears on an earlier line too")
            if item.get("method", "POST") != "POST":
                raise ValueError("method: must be POST")
            if item.get("url") != endpoint:
                raise ValueError(f"url: must be the batch's endpoint {endpoint}")
            body = item.get("body")
            if not isinstance(body, dict):
                raise ValueError("body: must be a JSON object (the request)")
            if body.get("stream"):
                raise ValueError("body.stream: a batch request is not streamed")
        except ValueError as e:
            message = f"invalid JSON: {e}" if isinstance(e, json.JSONDecodeError) else str(e)
            err = line_error(custom_id, "invalid_request", message, line=number)
            rows.append((number, custom_id, None, "failed", json.dumps(err)))
            continue
        seen.add(custom_id)
        rows.append((number, custom_id, json.dumps(body), "pending", None))
    return rows


class BatchAPI:
    def __init__(self, store: BatchStore, runner: BatchRunner | None, max_file_bytes: int) -> None:
        self.store = store
        self.runner = runner
        self.max_file_bytes = max_file_bytes

    async def db(self, fn: Any, *args: Any) -> Any:
        if self.runner is not None:
            return await self.runner.db(fn, *args)
        return fn(*args)

    # -- files -------------------------------------------------------------------------

    async def upload(self, request: Request, owner: str, body_timeout: float) -> Response:
        try:
            raw = await read_body(request, self.max_file_bytes, body_timeout)
        except BodyRejected as e:
            return error(BatchError(e.message, e.status))
        try:
            fields = parse_multipart(request.headers.get("content-type", ""), raw)
            purpose = fields.get("purpose", (None, b""))[1].decode(errors="replace").strip()
            if purpose != "batch":
                raise BatchError(
                    f"purpose: this server takes files for batches only (purpose=batch), "
                    f"got {purpose!r}",
                    param="purpose",
                )
            if "file" not in fields:
                raise BatchError("file: missing", param="file")
            filename, content = fields["file"]
        except BatchError as e:
            return error(e)
        name = (filename or "upload.jsonl")[:255]
        return JSONResponse(await self.db(self.store.add_file, owner, purpose, name, content))

    async def list_files(self, request: Request, owner: str) -> Response:
        q = query(request)
        try:
            limit = _limit(q.get("limit"), 10_000)
        except BatchError as e:
            return error(e)
        data = await self.db(self.store.files, owner, q.get("purpose"), limit + 1, q.get("after"))
        return JSONResponse(_page(data, limit))

    async def file_route(self, request: Request, owner: str) -> Response:
        rest = request.path[len("/v1/files/") :]
        file_id, _, tail = rest.partition("/")
        found = await self.db(self.store.file, owner, file_id) if _ID.fullmatch(file_id) else None
        if found is None:
            return error(BatchError(f"No such File object: {file_id}", 404, "file_id"))
        if request.scope["method"] == "DELETE" and not tail:
            await self.db(self.store.delete_file, owner, file_id)
            return JSONResponse({"id": file_id, "object": "file", "deleted": True})
        if request.scope["method"] == "GET" and not tail:
            return JSONResponse(found)
        if request.scope["method"] == "GET" and tail == "content":
            content = await self.db(self.store.read_file, file_id)
            return BytesResponse(content, 200, [(b"content-type", b"application/octet-stream")])
        return error(BatchError(f"no route {request.scope['method']} {request.path}", 404))

    # -- batches -----------------------------------------------------------------------

    async def create(self, raw: bytes, owner: str) -> Response:
        try:
            try:
                body = json.loads(raw)
            except ValueError:
                raise BatchError("the body is not valid JSON") from None
            if not isinstance(body, dict):
                raise BatchError("the body must be a JSON object")
            unknown = sorted(
                set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"}
            )
            if unknown:
                raise BatchError(f"{unknown[0]}: not a batch field", param=unknown[0])
            endpoint = body.get("endpoint")
            if endpoint not in ENDPOINTS:
                raise BatchError(
                    f"endpoint: must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}",
                    param="endpoint",
                )
            window = body.get("completion_window")
            m = _WINDOW.fullmatch(window) if isinstance(window, str) else None
            if m is None or int(m.group(1)) > MAX_WINDOW_HOURS:
                raise BatchError(
                    f"completion_window: hours as `24h` (1h to {MAX_WINDOW_HOURS}h), "
                    f"got {window!r}",
                    param="completion_window",
                )
            metadata = body.get("metadata")
            if metadata is not None and (
                not isinstance(metadata, dict)
                or len(metadata) > MAX_METADATA
                or not all(
                    isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                    for k, v in metadata.items()
                )
            ):
                raise BatchError(
                    "metadata: at most 16 string pairs (keys ≤ 64, values ≤ 512 characters)",
                    param="metadata",
                )
            file_id = body.get("input_file_id")
            found = (
                await self.db(self.store.file, owner, file_id)
                if isinstance(file_id, str) and _ID.fullmatch(file_id)
                else None
            )
            if found is None or found["purpose"] != "batch" or not isinstance(file_id, str):
                raise BatchError(
                    f"input_file_id: no batch file {file_id!r}", 404, param="input_file_id"
                )
            content = await self.db(self.store.read_file, file_id)
            rows = parse_input(content, endpoint)
        except BatchError as e:
            return error(e)
        now = int(time.time())
        failed = sum(1 for r in rows if r[3] == "failed")
        batch: dict[str, Any] = {
            "id": new_id("batch"),
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": file_id,
            "completion_window": window,
            "status": "in_progress",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": now,
            "expires_at": now + 3600 * int(m.group(1)),
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "request_counts": {"total": len(rows), "completed": 0, "failed": failed},
            "metadata": metadata,
        }
        if failed:
            batch["errors"] = {
                "object": "list",
                "data": [
                    {
                        "code": "invalid_request",
                        "message": json.loads(r[4] or "{}").get("error", {}).get("message", ""),
                        "param": None,
                        "line": r[0],
                    }
                    for r in rows
                    if r[3] == "failed"
                ][:100],
            }
        await self.db(self.store.add_batch, owner, batch, rows)
        if self.runner is not None:
            self.runner.wake.set()
        return JSONResponse(batch)

    async def _live(self, batch: dict[str, Any]) -> dict[str, Any]:
        """A batch with its request counts as of now (while it runs)."""
        if batch["status"] in ("in_progress", "cancelling", "finalizing"):
            counts = await self.db(self.store.counts, batch["id"])
            batch["request_counts"] = {
                "total": sum(counts.values()),
                "completed": counts.get("done", 0),
                "failed": counts.get("failed", 0),
            }
        return batch

    async def list_batches(self, request: Request, owner: str) -> Response:
        q = query(request)
        try:
            limit = _limit(q.get("limit"), 100)
        except BatchError as e:
            return error(e)
        data = await self.db(self.store.batches, owner, limit + 1, q.get("after"))
        return JSONResponse(_page([await self._live(b) for b in data[:limit]], limit, len(data)))

    async def batch_route(self, request: Request, owner: str) -> Response:
        rest = request.path[len("/v1/batches/") :]
        batch_id, _, tail = rest.partition("/")
        batch = (
            await self.db(self.store.batch, owner, batch_id) if _ID.fullmatch(batch_id) else None
        )
        if batch is None:
            return error(BatchError(f"No such Batch object: {batch_id}", 404, "batch_id"))
        if request.scope["method"] == "GET" and not tail:
            return JSONResponse(await self._live(batch))
        if request.scope["method"] == "POST" and tail == "cancel":
            if batch["status"] in ("in_progress", "validating"):
                batch["status"] = "cancelling"
                batch["cancelling_at"] = int(time.time())
                await self.db(self.store.save_batch, strip(batch))
                if self.runner is not None:
                    self.runner.wake.set()
            elif batch["status"] not in ("cancelling", "cancelled"):
                return error(
                    BatchError(f"the batch is {batch['status']}: it cannot be cancelled", 409)
                )
            return JSONResponse(await self._live(batch))
        return error(BatchError(f"no route {request.scope['method']} {request.path}", 404))


def _limit(value: Any, most: int) -> int:
    try:
        n = int(value) if value is not None else 20
    except ValueError:
        raise BatchError("limit: must be an integer", param="limit") from None
    return max(1, min(most, n))


def _page(data: list[dict[str, Any]], limit: int, found: int | None = None) -> dict[str, Any]:
    """One page of a list (``found``: how many were fetched, ``limit`` + 1 at most)."""
    found = len(data) if found is None else found
    data = data[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": found > limit,
    }


def query(request: Request) -> dict[str, str]:
    """The query string's parameters (the first value of each)."""
    raw = request.scope.get("query_string", b"").decode("latin-1")
    return {k: v[0] for k, v in parse_qs(raw).items()}
