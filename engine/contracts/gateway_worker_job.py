"""What ``pdfleet gateway --workers N`` sends each worker process it starts
(``gateway/workers.py``): one JSON object on the worker's stdin, which the
supervisor then closes::

    {"config": {...GatewayConfig fields by name...}, "index": 0, "count": 4,
     "run_dir": "/tmp/pdfleet-gateway-abc"}

``config`` is the supervisor's whole ``GatewayConfig`` (API keys included: the
pipe is private to the two processes); the worker builds its configuration
from it, which refuses a field it does not know. :class:`WorkerJob` carries
it; :meth:`WorkerJob.decode` raises ``ValueError`` naming what is wrong.
Nothing is pickled.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class WorkerJob:
    """One worker's start: its configuration, its index of ``count`` workers,
    and the supervisor's run directory (the workers' shared sockets)."""

    config: Mapping[str, Any]
    """The ``GatewayConfig`` fields by name (``dataclasses.asdict``)."""
    index: int
    count: int
    run_dir: str

    def encode(self) -> bytes:
        return json.dumps(
            {
                "config": dict(self.config),
                "index": self.index,
                "count": self.count,
                "run_dir": self.run_dir,
            }
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> WorkerJob:
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise ValueError("a gateway worker job is not JSON") from None
        if not isinstance(raw, dict) or set(raw) != {"config", "index", "count", "run_dir"}:
            raise ValueError(
                "a gateway worker job is an object of config, index, count and run_dir"
            )
        config, index, count, run_dir = raw["config"], raw["index"], raw["count"], raw["run_dir"]
        if not isinstance(config, dict):
            raise ValueError("config: not an object")
        for name, value in (("index", index), ("count", count)):
            if type(value) is not int or value < 0:
                raise ValueError(f"{name}: not a non-negative integer")
        if not index < count:
            raise ValueError(f"index: {index} is not below count {count}")
        if not isinstance(run_dir, str) or not run_dir:
            raise ValueError("run_dir: not a path")
        return cls(config, index, count, run_dir)
