"""What the gateway answers a client itself: errors in OpenAI's shape (the
body engines send too, engine/contracts/errors.py), as a JSON answer or as
the event that ends a stream; and what it logs of an engine's own error."""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from ..contracts.errors import ErrorBody
from ..http.asgi import JSON_CONTENT_TYPE, BytesResponse

DONE = b"data: [DONE]\n\n"
# The longest engine error message relayed for a refused (4xx) input, or logged.
MAX_RELAYED_MESSAGE = 1000


def error_response(
    message: str,
    status: int,
    request_id: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> Response:
    """An error answer in OpenAI's shape, with the request id (and ``headers``)."""
    raw = [JSON_CONTENT_TYPE, (b"x-request-id", request_id.encode("latin-1"))]
    for name, value in (headers or {}).items():
        raw.append((name.lower().encode("latin-1"), value.encode("latin-1")))
    return BytesResponse(ErrorBody(message, status, param).encode(), status, raw)


def sse_error(message: str, status: int) -> bytes:
    """The error event that ends a relayed stream, and the stream's end."""
    return ErrorBody(message, status).sse_event() + DONE


def upstream_message(resp: Any) -> str:
    """An engine answer's error message, for the gateway's log (never the
    client's); ``resp`` is an engine client's or httpx's response."""
    error = ErrorBody.decode(resp.content, resp.status_code)
    if error is not None:
        return error.message[:MAX_RELAYED_MESSAGE]
    text: str = resp.text[:200] or resp.reason_phrase  # not OpenAI-shaped: the body's start
    return text
