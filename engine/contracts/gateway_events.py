"""What the workers of one gateway (``--workers N``) tell each other: the events
that must change every worker's routing state (``gateway/siblings.py`` carries
them, one JSON object a line on a unix socket per worker).

* :class:`EngineStalled` ``{"kind": "stall", "url", "since"}``: a worker
  ejected an engine whose stream stalled; ``since`` is its last progress
  (``time.monotonic()`` seconds: the workers share the host's clock);
* :class:`EngineRefused` ``{"kind": "refused", "url"}``: an engine refused a
  connection;
* :class:`KVPairUsed` / :class:`KVPairFailed` ``{"kind": "kv_pair_used" |
  "kv_pair_failed", "prefill", "decode"}``: a KV hand-off between two
  engines, and a failed decode leg after one (the KV-pair breaker's counts).

:func:`decode_event` raises ``ValueError`` naming what is wrong, for a line
over :data:`MAX_EVENT_BYTES` as well; the receiver logs it and reads on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

MAX_EVENT_BYTES = 64 * 1024
"""The longest event line (with its newline) a worker accepts from a sibling."""
MAX_URL_CHARS = 2048


def _url(data: dict[str, Any], name: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not 0 < len(value) <= MAX_URL_CHARS:
        raise ValueError(f"{name}: not a URL of 1 to {MAX_URL_CHARS} characters")
    return value


@dataclass(frozen=True, slots=True)
class EngineStalled:
    url: str
    since: float
    """The engine's last progress, ``time.monotonic()`` seconds."""

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "stall", "url": self.url, "since": self.since}


@dataclass(frozen=True, slots=True)
class EngineRefused:
    url: str

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "refused", "url": self.url}


@dataclass(frozen=True, slots=True)
class KVPairUsed:
    prefill: str
    decode: str

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "kv_pair_used", "prefill": self.prefill, "decode": self.decode}


@dataclass(frozen=True, slots=True)
class KVPairFailed:
    prefill: str
    decode: str

    def to_wire(self) -> dict[str, Any]:
        return {"kind": "kv_pair_failed", "prefill": self.prefill, "decode": self.decode}


SiblingEvent = EngineStalled | EngineRefused | KVPairUsed | KVPairFailed
KVPairEvent = KVPairUsed | KVPairFailed


def encode_event(event: SiblingEvent) -> bytes:
    """One line: the event's JSON and a newline."""
    line = json.dumps(event.to_wire()).encode() + b"\n"
    if len(line) > MAX_EVENT_BYTES:
        raise ValueError(f"a sibling event is at most {MAX_EVENT_BYTES} bytes")
    return line


def decode_event(line: bytes) -> SiblingEvent:
    """The event of one line; ValueError naming what is wrong."""
    if len(line) > MAX_EVENT_BYTES:
        raise ValueError(f"a sibling event is at most {MAX_EVENT_BYTES} bytes")
    try:
        data = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        raise ValueError("a sibling event is not JSON") from None
    if not isinstance(data, dict):
        raise ValueError("a sibling event is not a JSON object")
    kind = data.get("kind")
    if kind == "stall":
        since = data.get("since")
        if (
            not isinstance(since, int | float)
            or isinstance(since, bool)
            or not math.isfinite(since)
        ):
            raise ValueError("since: not a number of seconds")
        return EngineStalled(_url(data, "url"), float(since))
    if kind == "refused":
        return EngineRefused(_url(data, "url"))
    if kind == "kv_pair_used":
        return KVPairUsed(_url(data, "prefill"), _url(data, "decode"))
    if kind == "kv_pair_failed":
        return KVPairFailed(_url(data, "prefill"), _url(data, "decode"))
    raise ValueError(f"kind: unknown sibling event {kind!r}")
