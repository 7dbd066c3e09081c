"""The wire of request migration between the gateway and decode engines
(docs/migration.md): what a migratable stream carries besides OpenAI's events.

A decode leg the gateway can migrate has the internal body field
``migration`` (``{"output_token_ids": [...], "created": N}``, only from the
fleet token or an internal key). Its stream then carries, as SSE comments
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

FIELD = "migration"
"""The internal body field."""
IDS_PREFIX = b": ids "
"""The comment line naming the output token ids an event sends."""
MIGRATE_EVENT = b": migrate\n\n"
"""The event that ends a stream handed back by a stopping engine."""
MIGRATE_HEADER = "x-pdfleet-migrate"
"""On a non-streamed answer (503) handed back by a stopping engine."""


def ids_comment(token_ids: list[int]) -> str:
    """The comment line for an event that sends ``token_ids``."""
    return ": ids " + " ".join(map(str, token_ids)) + "\n"


def parse_ids(line: bytes) -> list[int]:
    """The token ids of an ``IDS_PREFIX`` line (without its newline);
    ValueError for anything else."""
    return [int(x) for x in line[len(IDS_PREFIX) :].split()]
