"""The gateway's ``/engines`` answer: the pool, the tenants and the open KV
pairs as the answering gateway process sees them. The gateway encodes it
(``gateway/app.py``); ``pdfleet status`` decodes it (``operator/status_cmd.py``)
for its tenant lines. One JSON object, an :class:`EnginesView`::

    {"queued": 0,
     "tenants": [{"tenant", "priority", "weight", "inflight", "inflight_tokens",
                  "queued", "waited", "queue_s"}, ...],
     "worker": "0/2" | null,
     "routable": {"prefill": 1, "decode": 1},
     "engines": [{"url", "role", "state", "inflight", "stalled", "admitted",
                  "capacity", "longest_step_s", "stall_limit_s", "step_running_s",
                  "adapters": {NAME: "device" | "host" | "registered"},
                  "peer_pull": {"prefill_tokens_per_s", "step_s", "lend_s",
                                "queued_prompt_tokens", "kv_block_bytes",
                                "step_wait_s"} | null},
                 ...],
     "kv_pairs_open": [{"prefill", "decode"}, ...]}

Every field is always written (null where the docstrings say). The decoders
raise ``ValueError`` naming the field that is missing or of the wrong type;
fields they do not know are ignored (a newer gateway may add some).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def _get(raw: Mapping[str, Any], name: str, kind: type | tuple[type, ...], where: str) -> Any:
    """``raw[name]``, of ``kind`` (a bool is no number here), or ValueError."""
    if name not in raw:
        raise ValueError(f"{where}{name}: missing")
    value = raw[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ValueError(f"{where}{name}: {value!r} is not of type {_names(kinds)}")
    if not isinstance(value, kinds):
        raise ValueError(f"{where}{name}: {value!r} is not of type {_names(kinds)}")
    return value


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join("null" if k is type(None) else k.__name__ for k in kinds)


_NUMBER = (int, float)
_MAYBE_NUMBER = (int, float, type(None))
_MAYBE_INT = (int, type(None))


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: not an object")
    return value


def _list(raw: Mapping[str, Any], name: str, where: str = "") -> list[Any]:
    value: list[Any] = _get(raw, name, list, where)
    return value


@dataclass(frozen=True, slots=True)
class TenantView:
    """One tenant (its flow control state in this gateway process)."""

    tenant: str
    priority: int | None
    """Its band (None: a tenant seen only in the queue, not in the tenants file)."""
    weight: float | None
    """Its fair-share weight (None as for ``priority``)."""
    inflight: int
    inflight_tokens: int
    """The cost (tokens) of its requests in flight."""
    queued: int
    waited: int
    """Its requests that waited for a slot."""
    queue_s: float
    """The recent mean wait of those, seconds."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "priority": self.priority,
            "weight": self.weight,
            "inflight": self.inflight,
            "inflight_tokens": self.inflight_tokens,
            "queued": self.queued,
            "waited": self.waited,
            "queue_s": self.queue_s,
        }

    @classmethod
    def from_wire(cls, value: Any, where: str = "tenants[]: ") -> TenantView:
        raw = _object(value, where)
        return cls(
            _get(raw, "tenant", str, where),
            _get(raw, "priority", _MAYBE_INT, where),
            _get(raw, "weight", _MAYBE_NUMBER, where),
            _get(raw, "inflight", int, where),
            _get(raw, "inflight_tokens", int, where),
            _get(raw, "queued", int, where),
            _get(raw, "waited", int, where),
            _get(raw, "queue_s", _NUMBER, where),
        )


@dataclass(frozen=True, slots=True)
class PeerPullCosts:
    """What peer pull has measured of one engine (``--peer-pull``)."""

    prefill_tokens_per_s: float | None
    step_s: float | None
    lend_s: float | None
    """How long its lend requests took to answer (None: none yet)."""
    queued_prompt_tokens: float
    """Prompt tokens waiting on it (its last scrape, and routed since)."""
    kv_block_bytes: float
    """Bytes of one KV block of it (0: not known yet)."""
    step_wait_s: float
    """Seconds a request sent to it now is predicted to wait for its step in
    progress (0: idle at its last scrape, and nothing routed to it since)."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "step_s": self.step_s,
            "lend_s": self.lend_s,
            "queued_prompt_tokens": self.queued_prompt_tokens,
            "kv_block_bytes": self.kv_block_bytes,
            "step_wait_s": self.step_wait_s,
        }

    @classmethod
    def from_wire(cls, value: Any, where: str) -> PeerPullCosts:
        raw = _object(value, where)
        return cls(
            _get(raw, "prefill_tokens_per_s", _MAYBE_NUMBER, where),
            _get(raw, "step_s", _MAYBE_NUMBER, where),
            _get(raw, "lend_s", _MAYBE_NUMBER, where),
            _get(raw, "queued_prompt_tokens", _NUMBER, where),
            _get(raw, "kv_block_bytes", _NUMBER, where),
            _get(raw, "step_wait_s", _NUMBER, where),
        )


@dataclass(frozen=True, slots=True)
class EngineView:
    """One engine of the pool."""

    url: str
    role: str
    state: str
    """``pending``, ``healthy``, ``ejected`` (the gateway's health states)."""
    inflight: int
    stalled: bool
    admitted: int
    """Requests routed to it and not ended (its slots)."""
    capacity: int | None
    """Its learned capacity (None: unbounded)."""
    longest_step_s: float
    stall_limit_s: float
    step_running_s: float | None
    """Age of the step in progress at its last check (None: none, or an engine
    that reports none); a step this young is no stall."""
    adapters: Mapping[str, str]
    """The LoRA adapters it serves and where their weights are as routing sees
    them: ``device``, ``host`` or ``registered``."""
    peer_pull: PeerPullCosts | None
    """None without ``--peer-pull``."""

    def to_wire(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role,
            "state": self.state,
            "inflight": self.inflight,
            "stalled": self.stalled,
            "admitted": self.admitted,
            "capacity": self.capacity,
            "longest_step_s": self.longest_step_s,
            "stall_limit_s": self.stall_limit_s,
            "step_running_s": self.step_running_s,
            "adapters": dict(self.adapters),
            "peer_pull": None if self.peer_pull is None else self.peer_pull.to_wire(),
        }

    @classmethod
    def from_wire(cls, value: Any, where: str = "engines[]: ") -> EngineView:
        raw = _object(value, where)
        peer = _get(raw, "peer_pull", (Mapping, type(None)), where)
        adapters = _get(raw, "adapters", Mapping, where)
        for name, tier in adapters.items():
            if not isinstance(name, str) or tier not in ("device", "host", "registered"):
                raise ValueError(f"{where}adapters: {name!r}: {tier!r} is not a tier")
        return cls(
            _get(raw, "url", str, where),
            _get(raw, "role", str, where),
            _get(raw, "state", str, where),
            _get(raw, "inflight", int, where),
            _get(raw, "stalled", bool, where),
            _get(raw, "admitted", int, where),
            _get(raw, "capacity", _MAYBE_INT, where),
            _get(raw, "longest_step_s", _NUMBER, where),
            _get(raw, "stall_limit_s", _NUMBER, where),
            _get(raw, "step_running_s", _MAYBE_NUMBER, where),
            dict(adapters),
            None if peer is None else PeerPullCosts.from_wire(peer, f"{where}peer_pull."),
        )


@dataclass(frozen=True, slots=True)
class KVPairOpen:
    """A prefill/decode pair whose KV hand-offs the breaker stopped for now."""

    prefill: str
    decode: str

    def to_wire(self) -> dict[str, Any]:
        return {"prefill": self.prefill, "decode": self.decode}


@dataclass(frozen=True, slots=True)
class EnginesView:
    """The whole ``/engines`` answer."""

    queued: int
    """Requests waiting for a slot in this gateway process."""
    tenants: list[TenantView]
    worker: str | None
    """``INDEX/N`` with ``--workers N`` (the view is the answering worker's), else None."""
    routable: dict[str, int]
    """Routable engines per role (``prefill``, ``decode``)."""
    engines: list[EngineView]
    kv_pairs_open: list[KVPairOpen]

    def to_wire(self) -> dict[str, Any]:
        return {
            "queued": self.queued,
            "tenants": [t.to_wire() for t in self.tenants],
            "worker": self.worker,
            "routable": dict(self.routable),
            "engines": [e.to_wire() for e in self.engines],
            "kv_pairs_open": [p.to_wire() for p in self.kv_pairs_open],
        }

    def encode(self) -> bytes:
        return json.dumps(self.to_wire()).encode()

    @classmethod
    def from_wire(cls, value: Any) -> EnginesView:
        raw = _object(value, "/engines")
        routable = _get(raw, "routable", Mapping, "")
        if not all(isinstance(k, str) and type(v) is int for k, v in routable.items()):
            raise ValueError("routable: not a count per role")
        pairs = []
        for i, p in enumerate(_list(raw, "kv_pairs_open")):
            where = f"kv_pairs_open[{i}]."
            pair = _object(p, where)
            pairs.append(
                KVPairOpen(_get(pair, "prefill", str, where), _get(pair, "decode", str, where))
            )
        return cls(
            _get(raw, "queued", int, ""),
            [
                TenantView.from_wire(t, f"tenants[{i}].")
                for i, t in enumerate(_list(raw, "tenants"))
            ],
            _get(raw, "worker", (str, type(None)), ""),
            dict(routable),
            [
                EngineView.from_wire(e, f"engines[{i}].")
                for i, e in enumerate(_list(raw, "engines"))
            ],
            pairs,
        )

    @classmethod
    def decode(cls, data: bytes | str) -> EnginesView:
        try:
            raw = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            raise ValueError("/engines: not JSON") from None
        return cls.from_wire(raw)
