"""The batch runner's record of one request whose answer is not JSON: OpenAI's
error body (type and code), as every other error pdfleet writes."""

import asyncio

import httpx
import pytest

from pdfleet.engine.gateway.batch.runner import BatchRunner


class Finished:
    """Stands in for the store: keeps what the runner finishes."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []

    def finish(self, *args) -> None:
        self.rows.append(args)


@pytest.mark.parametrize(("status", "code", "state"), [(400, 400, "failed"), (200, 502, "failed")])
def test_an_answer_that_is_not_json_is_recorded_as_openai_s_error_body(status, code, state):
    async def main() -> Finished:
        store = Finished()
        runner = BatchRunner(store, "http://gw", "t", 1, lambda: True, 5.0)
        await runner.client.aclose()
        runner.client = httpx.AsyncClient(
            transport=httpx.MockTransport(lambda request: httpx.Response(status, text="oops"))
        )
        batch = {"id": "batch_1", "endpoint": "/v1/completions", "_owner": "o"}
        await runner.run_one(batch, {"line": 0, "custom_id": "c", "body": b"{}", "attempts": 0})
        await runner.stop()
        return store

    (row,) = asyncio.run(main()).rows
    _, line, recorded, result = row
    assert (line, recorded) == (0, state)
    assert result["response"]["status_code"] == status
    assert result["response"]["body"] == {
        "error": {
            "message": "oops",
            "type": "BadRequestError" if code == 400 else "BadGatewayError",
            "param": None,
            "code": code,
        }
    }
