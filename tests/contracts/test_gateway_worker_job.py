"""The start job ``pdfleet gateway --workers N`` sends each worker."""

from __future__ import annotations

import dataclasses
import json

import pytest

from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.contracts.gateway_worker_job import WorkerJob


def test_a_job_round_trips_and_rebuilds_the_config():
    config = GatewayConfig(decode=["http://127.0.0.1:8001"], workers=2, port=8123)
    job = WorkerJob(dataclasses.asdict(config), 1, 2, "/tmp/run")
    data = job.encode()
    # The bytes the supervisor always wrote: one JSON object of these four fields.
    assert (
        data
        == json.dumps(
            {"config": dataclasses.asdict(config), "index": 1, "count": 2, "run_dir": "/tmp/run"}
        ).encode()
    )
    back = WorkerJob.decode(data)
    assert (back.index, back.count, back.run_dir) == (1, 2, "/tmp/run")
    assert GatewayConfig(**back.config) == config


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"not json", "not JSON"),
        (b"[]", "an object of config"),
        (b'{"config": {}, "index": 0, "count": 1}', "an object of config"),
        (b'{"config": [], "index": 0, "count": 1, "run_dir": "/r"}', "config: not an object"),
        (b'{"config": {}, "index": true, "count": 1, "run_dir": "/r"}', "index: not"),
        (b'{"config": {}, "index": 2, "count": 2, "run_dir": "/r"}', "not below count"),
        (b'{"config": {}, "index": 0, "count": 1, "run_dir": ""}', "run_dir: not a path"),
    ],
)
def test_a_malformed_job_is_refused_naming_what_is_wrong(raw, message):
    with pytest.raises(ValueError, match=message):
        WorkerJob.decode(raw)
