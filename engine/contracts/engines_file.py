"""The engines file: the engines a gateway routes to, as ``pdfleet up`` writes
them (``operator/local/fleet.py``) and the gateway's ``--engines-file``
discovery reads them (``engine/gateway/discovery.py``), re-read on change.

The file is JSON (or YAML, for a hand-written one), an :class:`EnginesFile`::

    {"engines": [{"url": "http://127.0.0.1:8001", "role": "decode", "name": "d-0",
                  "kv_events": "tcp://127.0.0.1:5557",
                  "kv_events_replay": "tcp://127.0.0.1:5558"}, ...]}

one :class:`EngineEntry` per engine: ``url`` and ``role`` required, ``name``
(default empty), and the engine's KV-event endpoints when it publishes them.
Any other field is refused. A malformed file is refused naming the field
(``engines[2].role: ...``); a reader keeps the last good list.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from .identity import ROLES

ENGINES = "engines"
URL = "url"
ROLE = "role"
NAME = "name"
KV_EVENTS = "kv_events"
KV_EVENTS_REPLAY = "kv_events_replay"
ENTRY_FIELDS = (URL, ROLE, NAME, KV_EVENTS, KV_EVENTS_REPLAY)
"""An entry's fields, in the order they are written."""
_ZMQ_SCHEMES = ("tcp://", "ipc://")


class EnginesFileError(ValueError):
    """A malformed file or entry; ``field`` names what is wrong (``engines``,
    ``engines[2].role``; an entry built alone names its own field)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class EngineEntry:
    """One engine: its base URL (no trailing slash), its role (``prefill``,
    ``decode`` or ``both``), its name, and the ZMQ endpoints of its KV event
    stream and replay socket (e.g. ``tcp://10.0.0.5:5557``) when it publishes
    one. Built from flags and Kubernetes pods too: the constructor checks it,
    raising EnginesFileError naming the field."""

    url: str
    role: str
    name: str = ""
    kv_events: str | None = None
    kv_events_replay: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(("http://", "https://")):
            raise EnginesFileError(
                f"{URL}: engine URL {self.url!r} must start with http:// or https://", URL
            )
        if self.role not in ROLES:
            raise EnginesFileError(
                f"{ROLE}: engine {self.url}: role {self.role!r} is not one of {ROLES}", ROLE
            )
        if not isinstance(self.name, str):
            raise EnginesFileError(f"{NAME}: engine {self.url}: must be a string", NAME)
        for field in (KV_EVENTS, KV_EVENTS_REPLAY):
            value = getattr(self, field)
            if value is not None and (
                not isinstance(value, str) or not value.startswith(_ZMQ_SCHEMES)
            ):
                raise EnginesFileError(
                    f"{field}: engine {self.url}: {value!r} must be a ZMQ endpoint "
                    "(tcp://HOST:PORT or ipc://PATH)",
                    field,
                )
        object.__setattr__(self, "url", self.url.rstrip("/"))

    def to_json(self) -> dict[str, str]:
        """The entry's object: ``url``, ``role``, ``name``, then the KV-event
        endpoints that are set."""
        out = {URL: self.url, ROLE: self.role, NAME: self.name}
        if self.kv_events is not None:
            out[KV_EVENTS] = self.kv_events
        if self.kv_events_replay is not None:
            out[KV_EVENTS_REPLAY] = self.kv_events_replay
        return out

    @classmethod
    def from_json(cls, raw: Any) -> EngineEntry:
        """An entry from its parsed object; EnginesFileError naming the field."""
        if not isinstance(raw, dict):
            raise EnginesFileError("must be an object", "")
        for key in raw:
            if key not in ENTRY_FIELDS:
                raise EnginesFileError(f"{key}: unknown field", str(key))
        for key in (URL, ROLE):
            if key not in raw:
                raise EnginesFileError(f"{key}: required (every entry needs `url` and `role`)", key)
        return cls(
            raw[URL],
            raw[ROLE],
            raw.get(NAME) or "",
            raw.get(KV_EVENTS),
            raw.get(KV_EVENTS_REPLAY),
        )


@dataclass(frozen=True)
class EnginesFile:
    """The whole file: its engines, in order."""

    engines: tuple[EngineEntry, ...] = ()

    def encode(self) -> bytes:
        """The file's JSON bytes (indented: people read it while debugging a run)."""
        return json.dumps({ENGINES: [e.to_json() for e in self.engines]}, indent=2).encode()

    @classmethod
    def from_json(cls, data: Any) -> EnginesFile:
        """The file from its parsed JSON or YAML; EnginesFileError naming the
        field (``engines``, ``engines[I]``, ``engines[I].FIELD``)."""
        if not isinstance(data, dict) or not isinstance(data.get(ENGINES), list):
            raise EnginesFileError(f"{ENGINES}: expected an object with an `engines` list", ENGINES)
        unknown = sorted(str(k) for k in data if k != ENGINES)
        if unknown:
            raise EnginesFileError(f"{unknown[0]}: unknown field", unknown[0])
        entries = []
        for i, item in enumerate(data[ENGINES]):
            try:
                entries.append(EngineEntry.from_json(item))
            except EnginesFileError as e:
                field = f"{ENGINES}[{i}]" + (f".{e.field}" if e.field else "")
                message = str(e).removeprefix(f"{e.field}: ") if e.field else str(e)
                raise EnginesFileError(f"{field}: {message}", field) from None
        return cls(tuple(entries))

    @classmethod
    def decode(cls, data: bytes | str) -> EnginesFile:
        """The file from its JSON bytes; EnginesFileError as :meth:`from_json`."""
        try:
            parsed = json.loads(data)
        except ValueError as e:
            raise EnginesFileError(f"not JSON: {e}", "") from None
        return cls.from_json(parsed)
