"""The wire of request migration between the gateway and decode engines
(docs/migration.md): what a migratable stream carries besides OpenAI's events.

A decode leg the gateway can migrate has the internal body field
``migration`` (only from the fleet token or an internal key), a
:class:`MigrationState`: ``{}`` on a request's first decode leg, and
``{"output_token_ids": [...], "created": N, "resume_identity": "..."}`` on a
resumed one (``created`` and ``resume_identity`` only when the first engine
gave them). Its stream then carries, as SSE comments
that no SSE client dispatches (the gateway strips them anyway):

* ``: ids 17 42`` as the first line of every event that sends output tokens
  (an event of that line alone when their text is still held back), and of
  the stream's first event (``: ids`` with none: a chat stream's role chunk),
  so the gateway knows which tokens the client has received, and that the
  engine speaks this at all (it moves no stream whose first event lacks it:
  an engine that does not could not resume it without repeating text);
* ``: migrate`` as the last event of a stream a stopping engine hands back
  (no ``data: [DONE]``): the gateway resumes it elsewhere, it is no error.

A non-streamed migratable request that a stopping engine hands back is a 503
with the header ``x-pdfleet-migrate: drain``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FIELD = "migration"
"""The internal body field."""
IDS_PREFIX = b": ids "
"""The comment line naming the output token ids an event sends."""
MIGRATE_EVENT = b": migrate\n\n"
"""The event that ends a stream handed back by a stopping engine."""
MIGRATE_HEADER = "x-pdfleet-migrate"
"""On a non-streamed answer (503) handed back by a stopping engine."""
OUTPUT_TOKEN_IDS = "output_token_ids"
CREATED = "created"
RESUME_IDENTITY = "resume_identity"
STATE_FIELDS = (OUTPUT_TOKEN_IDS, CREATED, RESUME_IDENTITY)
"""The state's fields, in the order they are encoded."""
MAX_SENT_TOKENS = 1 << 20
"""Most output token ids a resumed leg may name (an engine's longest context is
far below it; the bound keeps one body from costing more than its bytes)."""
MAX_IDENTITY_CHARS = 64
"""Longest resume identity (``EngineConfig.resume_identity`` is 16 hex digits)."""


class MigrationStateError(ValueError):
    """A malformed state; ``param`` names the field at fault (``migration`` for
    the state itself, ``migration.output_token_ids`` for one of its fields)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def _refuse(name: str | None, why: str) -> MigrationStateError:
    param = FIELD if name is None else f"{FIELD}.{name}"
    return MigrationStateError(f"{param}: {why}", param)


@dataclass(frozen=True, slots=True)
class MigrationState:
    """A decode leg's migration state, as the gateway sends it and an engine
    reads it.

    ``output_token_ids``: the tokens another engine already sent the client
    (the leg resumes after them, sending none again); None on a first leg,
    where the field is absent (an engine reads that as none sent: see
    :attr:`sent`). ``created``: the first engine's ``created``, kept for the
    client. ``resume_identity``: the first engine's resume identity; an engine
    of another one refuses the leg, since its tokens would not continue the
    stream."""

    output_token_ids: tuple[int, ...] | None = None
    created: int | None = None
    resume_identity: str | None = None

    @property
    def sent(self) -> tuple[int, ...]:
        """The output tokens already sent (none on a first leg)."""
        return self.output_token_ids or ()

    def to_json(self) -> dict[str, Any]:
        """The body field's value: the fields that are set, in
        :data:`STATE_FIELDS` order (the first leg's state is ``{}``)."""
        out: dict[str, Any] = {}
        if self.output_token_ids is not None:
            out[OUTPUT_TOKEN_IDS] = list(self.output_token_ids)
        if self.created is not None:
            out[CREATED] = self.created
        if self.resume_identity is not None:
            out[RESUME_IDENTITY] = self.resume_identity
        return out

    def encode(self) -> bytes:
        """The value's compact JSON bytes (the form a leg's body splices in)."""
        return json.dumps(self.to_json(), separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: Any) -> MigrationState:
        """The state of a body's ``migration`` value (parsed JSON);
        MigrationStateError naming the field for anything malformed: an
        unknown field, ids that are not a list of at most
        :data:`MAX_SENT_TOKENS` non-negative integers, a ``created`` that is
        not an integer, an identity that is not a string of at most
        :data:`MAX_IDENTITY_CHARS` characters. ``null`` fields are absent."""
        if not isinstance(raw, dict):
            raise _refuse(None, "must be a JSON object")
        for name in raw:
            if name not in STATE_FIELDS:
                raise _refuse(str(name), "unknown field")
        ids, created, identity = (raw.get(n) for n in STATE_FIELDS)
        if ids is not None:
            if not isinstance(ids, list):
                raise _refuse(OUTPUT_TOKEN_IDS, "must be a list of token ids")
            if len(ids) > MAX_SENT_TOKENS:
                raise _refuse(OUTPUT_TOKEN_IDS, f"at most {MAX_SENT_TOKENS} token ids")
            if not all(type(t) is int and t >= 0 for t in ids):
                raise _refuse(OUTPUT_TOKEN_IDS, "token ids are non-negative integers")
            ids = tuple(ids)
        if created is not None and (type(created) is not int or created < 0):
            raise _refuse(CREATED, "must be a non-negative integer (seconds)")
        if identity is not None and (
            not isinstance(identity, str) or len(identity) > MAX_IDENTITY_CHARS
        ):
            raise _refuse(RESUME_IDENTITY, f"a string of at most {MAX_IDENTITY_CHARS} characters")
        return cls(ids, created, identity)

    @classmethod
    def decode(cls, data: bytes | str) -> MigrationState:
        """The state from the value's JSON bytes; MigrationStateError as :meth:`from_json`."""
        try:
            raw = json.loads(data)
        except ValueError:
            raise _refuse(None, "not JSON") from None
        return cls.from_json(raw)


FIRST_LEG = MigrationState()
"""The state of a request's first decode leg: nothing sent yet."""


def ids_comment(token_ids: list[int]) -> str:
    """The comment line for an event that sends ``token_ids``."""
    return ": ids " + " ".join(map(str, token_ids)) + "\n"


def parse_ids(line: bytes) -> list[int]:
    """The token ids of an ``IDS_PREFIX`` line (without its newline);
    ValueError for anything else."""
    return [int(x) for x in line[len(IDS_PREFIX) :].split()]
