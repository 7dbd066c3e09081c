"""OpenAI's error body (engine/contracts/errors.py): one encode, one decode."""

from __future__ import annotations

import json

import pytest

from pdfleet.engine.contracts.errors import ERROR_TYPES, ErrorBody, error_type


def test_the_body_is_openais_shape_with_the_status_as_an_integer_code():
    error = ErrorBody("prompt is too long", 400, "prompt")
    assert (
        json.loads(error.encode())
        == error.to_dict()
        == {
            "error": {
                "message": "prompt is too long",
                "type": "BadRequestError",
                "param": "prompt",
                "code": 400,
            }
        }
    )
    event = ErrorBody("the decode engine failed", 502).sse_event()
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n") and event.count(b"\n\n") == 1
    assert json.loads(event[len(b"data: ") :])["error"]["type"] == "BadGatewayError"


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (401, "AuthenticationError"),
        (404, "NotFoundError"),
        (408, "RequestTimeoutError"),
        (413, "RequestTooLargeError"),
        (429, "RateLimitError"),
        (431, "RequestHeaderFieldsTooLargeError"),
        (499, "ClientClosedRequest"),
        (503, "ServiceUnavailableError"),
        (504, "GatewayTimeoutError"),
        (418, "Error"),
    ],
)
def test_one_table_names_each_status(status, kind):
    assert error_type(status) == kind == ErrorBody("m", status).type
    assert all(name.endswith(("Error", "Request")) for name in ERROR_TYPES.values())


def test_decode_reads_back_what_encode_wrote_under_the_answers_status():
    sent = ErrorBody("kv_transfer_params: the lease expired", 400, "kv_transfer_params")
    assert ErrorBody.decode(sent.encode(), 400) == sent
    assert ErrorBody.decode(sent.to_dict(), 400) == sent
    # The HTTP status is the answer's; a foreign code or a non-string param is not relayed.
    foreign = {"error": {"message": "too long", "param": 3, "code": "too_long"}}
    assert ErrorBody.decode(json.dumps(foreign), 422) == ErrorBody("too long", 422, None)


@pytest.mark.parametrize(
    "body",
    [
        b"Traceback (most recent call last)",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"detail": "Not Found"}',
        b'{"error": "overloaded"}',
        b'{"error": {"message": 5}}',
        b"[" * 100_000,
    ],
)
def test_decode_of_anything_but_openais_shape_is_none(body):
    assert ErrorBody.decode(body, 500) is None
