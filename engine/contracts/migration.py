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
* ``: end 17 42`` instead of ``: ids 17 42`` on the event that finishes the
  stream's one choice (its ``finish_reason``): the gateway then knows the
  answer is whole, and a leg cut after it resumes as finished (the
  ``choices``/``finished`` form below, which answers only ``usage`` and
  ``data: [DONE]``) instead of running on past its end;
* ``: migrate`` as the last event of a stream a stopping engine hands back
  (no ``data: [DONE]``): the gateway resumes it elsewhere, it is no error.

A request of several choices (``n`` > 1, several prompts; choice index
``prompt × n + i`` as in the answer) names the choice: ``: ids.2 17 42`` on
every event of choice 2 (its first, the role chunk, with no ids), and
``: end.2 17 42`` on the event that finishes it. Its resumed leg carries
``{"choices": [[...], null, ...], "finished": [0], ...}`` instead of
``output_token_ids``: per choice index the ids the client has received
(``null``: nothing of that choice went out yet, not even its opening chunk),
and the choices that finished (not run again; their tokens count in
``usage``). Each unfinished choice resumes as the ``n`` = 1 request of its
prompt with its own sent tokens and its own seed (the engine derives a
choice's seed from the request's and the choice's index within its prompt),
so greedy and seeded choices continue as unfaulted.

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
MULTI_IDS_PREFIX = b": ids."
"""The comment line naming a choice's index and the output token ids an event sends."""
END_PREFIX = b": end."
"""As :data:`MULTI_IDS_PREFIX`, on the event that finishes the choice."""
END_ONE_PREFIX = b": end "
"""As :data:`IDS_PREFIX`, on the event that finishes a stream of one choice."""
OUTPUT_TOKEN_IDS = "output_token_ids"
CREATED = "created"
RESUME_IDENTITY = "resume_identity"
CHOICES = "choices"
FINISHED = "finished"
STATE_FIELDS = (OUTPUT_TOKEN_IDS, CHOICES, FINISHED, CREATED, RESUME_IDENTITY)
"""The state's fields, in the order they are encoded."""
MAX_SENT_TOKENS = 1 << 20
"""Most output token ids a resumed leg may name (an engine's longest context is
far below it; the bound keeps one body from costing more than its bytes)."""
MAX_IDENTITY_CHARS = 64
"""Longest resume identity (``EngineConfig.resume_identity`` is 16 hex digits)."""
MAX_CHOICES = 1 << 16
"""Most choices a resumed leg may name (n times the prompts of a request)."""


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
    stream. ``choices`` and ``finished``: a resumed leg of a request of
    several choices (see the module), instead of ``output_token_ids``."""

    output_token_ids: tuple[int, ...] | None = None
    created: int | None = None
    resume_identity: str | None = None
    choices: tuple[tuple[int, ...] | None, ...] | None = None
    finished: tuple[int, ...] = ()

    @property
    def sent(self) -> tuple[int, ...]:
        """The output tokens already sent (none on a first leg)."""
        return self.output_token_ids or ()

    def choice_sent(self, index: int) -> tuple[int, ...] | None:
        """Choice ``index``'s sent tokens (None: nothing of it went out)."""
        if self.choices is None:
            if index == 0 and self.output_token_ids:
                return self.output_token_ids
            return None
        return self.choices[index] if index < len(self.choices) else None

    def to_json(self) -> dict[str, Any]:
        """The body field's value: the fields that are set, in
        :data:`STATE_FIELDS` order (the first leg's state is ``{}``)."""
        out: dict[str, Any] = {}
        if self.output_token_ids is not None:
            out[OUTPUT_TOKEN_IDS] = list(self.output_token_ids)
        if self.choices is not None:
            out[CHOICES] = [None if c is None else list(c) for c in self.choices]
            out[FINISHED] = list(self.finished)
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
        ids, choices, finished, created, identity = (raw.get(n) for n in STATE_FIELDS)
        if ids is not None:
            ids = _token_ids(OUTPUT_TOKEN_IDS, ids, MAX_SENT_TOKENS)
        if choices is not None:
            if ids is not None:
                raise _refuse(CHOICES, f"not with {OUTPUT_TOKEN_IDS} (one or the other)")
            if not isinstance(choices, list) or not choices or len(choices) > MAX_CHOICES:
                raise _refuse(CHOICES, f"must be a list of 1 to {MAX_CHOICES} choices")
            left = MAX_SENT_TOKENS
            parsed: list[tuple[int, ...] | None] = []
            for c in choices:
                parsed.append(None if c is None else _token_ids(CHOICES, c, left))
                left -= len(c or ())
            choices = tuple(parsed)
        if finished is not None:
            if choices is None:
                raise _refuse(FINISHED, f"only with {CHOICES}")
            if not isinstance(finished, list) or not all(
                type(i) is int and 0 <= i < len(choices) and choices[i] is not None
                for i in finished
            ):
                raise _refuse(FINISHED, f"must list indexes of {CHOICES} that went out")
            finished = tuple(sorted(set(finished)))
        if created is not None and (type(created) is not int or created < 0):
            raise _refuse(CREATED, "must be a non-negative integer (seconds)")
        if identity is not None and (
            not isinstance(identity, str) or len(identity) > MAX_IDENTITY_CHARS
        ):
            raise _refuse(RESUME_IDENTITY, f"a string of at most {MAX_IDENTITY_CHARS} characters")
        return cls(ids, created, identity, choices, finished or ())

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
_FIRST_LEG_HEAD = b'{"' + FIELD.encode() + b'":' + FIRST_LEG.encode()
"""What :func:`splice_state` puts before a first leg's body fields (every
migratable request's first decode leg: encoded once)."""


def splice_state(payload: bytes, state: MigrationState) -> bytes | None:
    """``payload`` (a JSON object's UTF-8 bytes, as a client sent it) with
    ``state`` as its :data:`FIELD`, first: the bytes are spliced, not parsed
    and written again. None for a payload that does not start with ``{``
    (UTF-16/32 JSON, which a body parser also takes): encode that one again."""
    text = payload.lstrip()
    if text[:1] != b"{":
        return None
    rest = text[1:].lstrip()
    sep = b"" if rest.startswith(b"}") else b","
    head = (
        _FIRST_LEG_HEAD if state is FIRST_LEG else b'{"' + FIELD.encode() + b'":' + state.encode()
    )
    return head + sep + rest


def _token_ids(name: str, ids: Any, most: int) -> tuple[int, ...]:
    if not isinstance(ids, list):
        raise _refuse(name, "must be a list of token ids")
    if len(ids) > most:
        raise _refuse(name, f"at most {MAX_SENT_TOKENS} token ids")
    if not all(type(t) is int and t >= 0 for t in ids):
        raise _refuse(name, "token ids are non-negative integers")
    return tuple(ids)


def ids_comment(token_ids: list[int], index: int | None = None, end: bool = False) -> str:
    """The comment line for an event that sends ``token_ids``; with ``index``
    (a request of several choices) naming the choice, and whether the event
    finishes it."""
    if index is None:
        return (": end " if end else ": ids ") + " ".join(map(str, token_ids)) + "\n"
    head = ": end." if end else ": ids."
    return head + " ".join(map(str, (index, *token_ids))) + "\n"


def parse_choice_ids(line: bytes) -> tuple[int, list[int], bool]:
    """(choice index, token ids, finished) of a :data:`MULTI_IDS_PREFIX` or
    :data:`END_PREFIX` line (without its newline); ValueError for anything else."""
    index, *ids = (int(x) for x in line[len(MULTI_IDS_PREFIX) :].split())
    return index, ids, line.startswith(END_PREFIX)


def parse_ids(line: bytes) -> list[int]:
    """The token ids of an :data:`IDS_PREFIX` or :data:`END_ONE_PREFIX` line
    (without its newline; both prefixes are as long); ValueError for anything else."""
    return [int(x) for x in line[len(IDS_PREFIX) :].split()]
