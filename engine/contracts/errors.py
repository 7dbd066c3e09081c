"""OpenAI's error body: what every pdfleet server answers for a refused or failed request.

    {"error": {"message": str, "type": str, "param": str | null, "code": int}}

One shape from engines (``pdfleet serve``), from the gateway, and from the
HTTP server under both (a malformed request, a head or chunk past its bound,
an unknown route or method), in a JSON answer or as the SSE event that ends
a stream which failed after it began.

``code`` is the HTTP status as an integer, as vLLM's OpenAI server sends it
(its ``ErrorInfo.code`` is an ``int`` set from the status), so tools written
against vLLM read pdfleet's errors unchanged; the official ``openai`` client
reads ``error.code`` whatever its type (``APIError.code``, as a string).
``type`` names the status (:data:`ERROR_TYPES`: the names vLLM and the
``openai`` client use for their errors), ``param`` the request field at
fault when there is one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    431: "RequestHeaderFieldsTooLargeError",
    499: "ClientClosedRequest",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}
"""The ``type`` of each status; any other status is an ``"Error"``."""


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "Error")


@dataclass(frozen=True, slots=True)
class ErrorBody:
    """One error answer: its message, HTTP status and the field at fault."""

    message: str
    status: int
    param: str | None = None

    @property
    def type(self) -> str:
        return error_type(self.status)

    def to_dict(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": error_type(self.status),
                "param": self.param,
                "code": self.status,
            }
        }

    def encode(self) -> bytes:
        """The JSON body of an error answer."""
        return json.dumps(self.to_dict()).encode()

    def sse_event(self) -> bytes:
        """The SSE event that ends a stream which failed after it began (the
        sender follows it with ``data: [DONE]``)."""
        return b"data: " + self.encode() + b"\n\n"

    @classmethod
    def decode(cls, body: bytes | str | dict[str, Any], status: int) -> ErrorBody | None:
        """An error answer read back (the gateway reading an engine's refusal):
        None when ``body`` is not OpenAI's shape (no ``error`` object with a
        string ``message``). The HTTP status is the answer's, whatever its
        ``code`` says; a ``param`` that is not a string is dropped."""
        if not isinstance(body, dict):
            try:
                body = json.loads(body)
            except ValueError:  # invalid JSON or UTF-8
                return None
            except RecursionError:
                return None
        error = body.get("error") if isinstance(body, dict) else None
        if not isinstance(error, dict) or not isinstance(error.get("message"), str):
            return None
        param = error.get("param")
        return cls(error["message"], status, param if isinstance(param, str) else None)


def not_found() -> ErrorBody:
    """An unknown route (404), from whichever server."""
    return ErrorBody("Not Found", 404)


def method_not_allowed() -> ErrorBody:
    """A known route asked with another method (405; the answer carries ``Allow``)."""
    return ErrorBody("Method Not Allowed", 405)
