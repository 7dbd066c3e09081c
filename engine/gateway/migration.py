"""Request migration: a decode leg that fails mid-answer resumes on another
decode engine, and the client sees one answer (docs/migration.md).

A request is migratable when ``--max-migrations`` is above 0. Its decode legs
carry the internal field ``migration`` (``contracts/migration.py``): the
engine then names, in an SSE comment on each event, the output token ids that
event sends (and, for a request of several choices, ``n`` > 1 or several
prompts, the choice they belong to and whether the event finished it), and a
stopping engine ends the stream with ``: migrate`` instead of cutting it.

The relay (``relay.py``, the one loop of every stream) forwards a migratable
stream event by event under :class:`Migrating`, its recovery here: the
comments are taken off (the bytes of the events otherwise unchanged) and the
token ids the client has received are kept. When the leg fails before its
``data: [DONE]`` (the engine died: connection refused, reset, or the stream
ended early; it stalled and the watchdog ejected it; it drained), the
request goes to another decode engine of the same compatibility hash as the
original body plus ``migration.output_token_ids``: the prompt is rendered as
before and the sent tokens follow it as token ids (no re-tokenized text), so
the new engine recomputes them or finds them in its prefix cache, then
continues with the same sampling state (a seeded request's draw is a
function of its seed and the output position; max_tokens, stop strings,
penalties and grammars count the sent tokens). It sends none of them again,
keeps the first engine's ``id`` and ``created``, and its ``usage`` counts
every token the client got. A request of several choices resumes every
unfinished choice after its own sent tokens (``migration.choices``); the
finished ones are not run again. A non-streamed request has sent nothing: it
is sent again whole.

Bounds: at most ``--max-migrations`` moves per request, then an error event
(a 502 for a non-streamed request); each wait is the one the first leg had
(the first-token bound for the resumed leg's first event, the idle timeout
between events), and the wait for another engine when none is routable is
``--hold-timeout``. A plain timeout (an engine that is slow, not stalled) is
not migrated: the fleet would only do the work twice.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from io import BytesIO
from typing import Any

from .. import tracing
from ..contracts.migration import (
    END_ONE_PREFIX,
    END_PREFIX,
    FIELD,
    FIRST_LEG,
    IDS_PREFIX,
    MIGRATE_EVENT,
    MIGRATE_HEADER,
    MULTI_IDS_PREFIX,
    MigrationState,
    parse_choice_ids,
    parse_ids,
    splice_state,
)
from ..http.upstream import UpstreamResponse
from .call import NOT_ANALYZED, Call
from .engines import EngineState
from .legs import LegFailed, Legs
from .relay import LegEnd, Opened, Recovery, StreamEnd

logger = logging.getLogger("pdfleet.gateway")

_CREATED = re.compile(rb'"created":\s*(\d+)')
_MIGRATE = MIGRATE_EVENT[:-2]
# A comment line that is not a block's first: the regex engine finds it several
# times faster than ``bytes.__contains__`` does in a block of many events (whose
# two-byte search steps over every ':' of their JSON).
_COMMENT_LINE = re.compile(rb"\n:")
# The comment line that opens an event of a one-choice stream (its token ids,
# in decimal digits) and is followed by the event's data; or a lone ``:``,
# any other comment that opens an event (another comment, one that is all of
# its event, or ids of another form). Each begins with the end of the event
# before (the block gets one in front), so the scan looks for a literal, and
# one pass both checks a block and splits it.
_ONE_CHOICE_IDS = re.compile(rb"\n\n(: (?:ids|end) [0-9 ]*\n(?=[^\n])|:)")


class Migration:
    """A migratable request's state across its decode legs."""

    __slots__ = (
        "_sent",
        "body",
        "choices",
        "compat",
        "created",
        "failed",
        "finished",
        "identity",
        "moves",
        "pinned",
        "sent_of",
        "unread",
    )

    def __init__(
        self,
        body: dict[str, Any],
        sent: list[int] | None = None,
        choices: int = 1,
        sent_of: dict[int, list[int]] | None = None,
        finished: set[int] | None = None,
        created: int | None = None,
        moves: int = 0,
        failed: set[str] | None = None,
        pinned: bool = False,
        identity: str | None = None,
        compat: str | None = None,
    ) -> None:
        self.body = body
        """The client's body (no kv_transfer_params): what every resumed leg sends."""
        self._sent: list[int] = [] if sent is None else sent
        self.unread: list[bytes] = []
        """Ids of :attr:`sent` not read into ints yet, in order after them: each
        decimal ids separated by spaces or newlines, or the ``: ids``/``: end``
        comment lines that carry them (read when :attr:`sent` is)."""
        self.choices = choices
        """The request's choices (``n`` × prompts); above 1 the engine names the
        choice of each event's ids, kept in :attr:`sent_of`."""
        self.sent_of: dict[int, list[int]] = {} if sent_of is None else sent_of
        """Per choice that went out (its opening chunk at least): its output token
        ids the client has received, in order (a request of several choices)."""
        self.finished: set[int] = set() if finished is None else finished
        """The choices whose last event went out (a request of one choice: ``{0}``
        once its ``: end`` event did)."""
        self.created = created
        """The first leg's ``created`` (kept by the resumed legs)."""
        self.moves = moves
        self.failed: set[str] = set() if failed is None else failed
        """Decode engines whose leg of this request failed."""
        self.pinned = pinned
        self.identity = identity
        """The first decode engine's resume identity: a leg resumes only on an
        engine of the same one (None: it published none)."""
        self.compat = compat
        """The first decode engine's compat hash: what a leg resumes within when
        that engine published no resume identity."""

    @property
    def sent(self) -> list[int]:
        """Output token ids the client has received, in order (a request of one
        choice). Read from the engine's comments only when asked (a move): a
        stream that never moves parses none of them."""
        if self.unread:
            text = b" ".join(self.unread).translate(None, b":idsen")
            self._sent.extend(map(int, text.split()))
            self.unread.clear()
        return self._sent

    def pin(self, first: EngineState) -> None:
        """Take the resume identity of the request's first decode engine (once)."""
        if not self.pinned:
            self.pinned = True
            self.identity = first.load.resume_identity
            self.compat = first.load.compat_hash

    def accepts(self, e: EngineState) -> bool:
        """Whether a leg of this request may resume on ``e``: the same resume
        identity (whatever its compat hash: the leg recomputes its tokens and
        reads no KV of the first engine); behind engines that publish none,
        the same compat hash."""
        if self.identity is not None:
            return e.load.resume_identity == self.identity
        return self.compat is None or e.load.compat_hash == self.compat

    def note(self, line: bytes) -> None:
        """Keep the ids of a ``: ids.I`` or ``: end.I`` comment line."""
        index, ids, end = parse_choice_ids(line)
        if 0 <= index < self.choices:
            self.sent_of.setdefault(index, []).extend(ids)
            if end:
                self.finished.add(index)

    def replayed(self) -> int:
        """The sent tokens a resumed leg carries to the new engine (what it
        recomputes: not those of finished choices)."""
        if self.choices == 1:
            return 0 if self.finished else len(self.sent)
        return len(self.sent) + sum(
            len(ids) for i, ids in self.sent_of.items() if i not in self.finished
        )

    def state(self) -> MigrationState:
        """A resumed leg's state: the tokens already sent (and the identity the
        engine must have to continue them). A request of several choices names
        them per choice; when none went out yet, it goes again whole."""
        if self.choices == 1 and self.finished:
            # Its finishing event went out: the choices form, which runs
            # nothing again and answers only usage and [DONE].
            return MigrationState(None, self.created, self.identity, (tuple(self.sent),), (0,))
        if self.choices == 1:
            return MigrationState(tuple(self.sent), self.created, self.identity)
        if not self.sent_of:
            return MigrationState(None, self.created, self.identity)
        per_choice = tuple(
            tuple(self.sent_of[i]) if i in self.sent_of else None for i in range(self.choices)
        )
        return MigrationState(
            None, self.created, self.identity, per_choice, tuple(sorted(self.finished))
        )

    def payload(self) -> bytes:
        """A resumed (decode-only) leg: the body plus its :meth:`state`."""
        return json.dumps(
            {**self.body, FIELD: self.state().to_json()}, separators=(",", ":")
        ).encode()


def migratable(body: dict[str, Any], chat: bool, max_migrations: int) -> int:
    """The choices of a request that can move between decode engines (``n``
    per prompt, ``best_of`` equal to ``n``: a larger one is refused before
    this); 0 when it cannot (``--max-migrations`` 0, or a shape the engine
    refuses anyway)."""
    n = body.get("n")
    n = 1 if n is None else n
    if max_migrations <= 0 or type(n) is not int or n < 1:
        return 0
    if body.get("best_of") not in (None, n):
        return 0
    prompts = 1
    if not chat:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompts = len(prompt)
    return n * prompts


def with_state(payload: bytes, body: dict[str, Any]) -> bytes:
    """``payload`` (``body``'s JSON bytes) with an empty migration state: the
    first decode leg (the engine annotates its stream for migration). UTF-8
    bytes are spliced (no second serialization); others are encoded again."""
    spliced = splice_state(payload, FIRST_LEG)
    return spliced if spliced is not None else json.dumps(add_state(body)).encode()


def add_state(body: dict[str, Any]) -> dict[str, Any]:
    """A decode leg's body with an empty migration state."""
    return {**body, FIELD: FIRST_LEG.to_json()}


def split_events(block: bytes, state: Migration) -> tuple[bytes, bool]:
    """Whole SSE events as they go to the client: the ``: ids`` comments taken
    off (their ids kept in ``state``); True when the block ends with the
    engine's ``: migrate``."""
    if not block.startswith(b":") and _COMMENT_LINE.search(block) is None:
        return block, False  # no comment line (events are cut whole)
    if block.startswith(IDS_PREFIX) and block.find(b"\n\n") == len(block) - 2:
        # One event (the usual block: an engine writes each event as it comes).
        line_end = block.find(b"\n")
        ids = block[len(IDS_PREFIX) : line_end]
        if ids.replace(b" ", b"").isdigit():  # (ASCII digits: reading them cannot fail)
            state.unread.append(ids)
        else:
            state.sent.extend(parse_ids(block[:line_end]))
        return block[line_end + 1 :] if line_end < len(block) - 2 else b"", False
    # Several events of one choice (events that piled up while the client
    # read, or an engine's whole answer), each a comment of its ids and one
    # data line, then at most one event without a comment (the ``[DONE]``):
    # its lines (``readlines`` finds them with ``memchr``) are a comment
    # every third one from the first, and a few passes in C over the lines
    # check that and take the comments off, without a pass of the regex.
    lines = BytesIO(block).readlines()
    count = len(lines) // 3
    text = b"\n" + b"".join(lines[0 : 3 * count : 3])  # each line after a newline
    tail = lines[3 * count :]
    if (
        count
        and lines[2 : 3 * count : 3].count(b"\n") == count  # each event's blank line
        and b"\n" not in (datas := lines[1 : 3 * count : 3])  # and its data line
        and (not tail or (tail[0] != b"\n" and not tail[0].startswith(b":")))
        and text.count(b"\n: ids ") + (ends := text.count(b"\n: end ")) == count
        and len(text.translate(None, b"0123456789 \n")) == 4 * count  # digits after each
    ):
        state.unread.append(text)  # (the comments' words go when the ids are read)
        if ends:
            state.finished.add(0)
        datas.append(b"".join(tail))
        return b"\n".join(datas), False
    parts = _ONE_CHOICE_IDS.split(b"\n\n" + block)
    comments = parts[1::2]
    if b":" not in comments:
        # Other blocks whose every comment is one of their ids: one pass over
        # the block instead of one per event. Each piece between two matches
        # is an event without its comment; the removed end of the event
        # before goes back between them. The ids are the comments' digits.
        text = b"".join(comments)
        state.unread.append(text)
        if text.find(b"end") >= 0:  # (find: ``in`` first tries the bytes as an int)
            state.finished.add(0)
        if not parts[0]:  # (the usual block: it opens with a comment, no copy to cut)
            return b"\n\n".join(parts[2::2]), False
        return b"\n\n".join(parts[0::2])[2:], False
    out: list[bytes] = []
    handed_back = False
    for event in block.split(b"\n\n")[:-1]:
        if event.startswith((IDS_PREFIX, END_ONE_PREFIX)):
            line, _, event = event.partition(b"\n")
            state.sent.extend(parse_ids(line))
            if line.startswith(END_ONE_PREFIX):
                state.finished.add(0)
        elif event.startswith((MULTI_IDS_PREFIX, END_PREFIX)):
            line, _, event = event.partition(b"\n")
            state.note(line)
        if event == _MIGRATE:
            handed_back = True
            continue
        if event:
            out.append(event + b"\n\n")
    return b"".join(out), handed_back


class Migrator:
    """Moves failed decode legs to other decode engines (``--max-migrations``)."""

    def __init__(self, legs: Legs) -> None:
        self.legs = legs
        self.max_migrations = legs.config.max_migrations
        self.resume = legs.metrics.fast_histogram(legs.metrics.migration_resume)

    # -- choosing the next engine -------------------------------------------------

    async def next_engine(self, call: Call, state: Migration) -> EngineState | None:
        """A routable decode engine that can continue the request
        (``Migration.accepts``) and whose leg of it did not fail; while there
        is none, up to --hold-timeout for one (a restarted engine comes back
        under its old URL: then it is taken too)."""
        legs = self.legs

        def candidates(exclude: set[str]) -> list[EngineState]:
            return [
                e
                for e in legs.pool.candidates("decode")
                if e.url not in exclude and state.accepts(e)
            ]

        found = candidates(state.failed)
        if not found:
            legs.metrics.held.inc()
            try:
                deadline = time.monotonic() + legs.config.hold_timeout
                while not found:
                    if not await legs.pool.wait_routable("decode", deadline):
                        break
                    found = candidates(state.failed) or candidates(set())
                    if not found:
                        if time.monotonic() >= deadline:
                            break
                        await asyncio.sleep(legs.config.scrape_interval)
            finally:
                legs.metrics.held.dec()
        if not found:
            return None
        info = legs.analyzed(call, call.info or NOT_ANALYZED)
        picked = legs.router.pick(found, info.block_hashes, info.exact_hashes)
        return picked[0] if picked is not None else None

    def moved(self, state: Migration, reason: str) -> bool:
        """Count a move; False when the request has used its last one."""
        m = self.legs.metrics
        if state.moves >= self.max_migrations:
            m.migrations.labels("exhausted").inc()
            return False
        state.moves += 1
        m.migrations.labels(reason).inc()
        replayed = state.replayed()
        if replayed:
            m.migration_replayed.inc(replayed)
        return True

    # -- a leg that sent the client nothing ---------------------------------------

    def handed_back(self, resp: UpstreamResponse) -> bool:
        """A non-streamed leg a stopping engine handed back (503 + the header)."""
        return resp.status_code == 503 and resp.header(MIGRATE_HEADER.encode()) is not None

    async def move_unsent(
        self, call: Call, e: EngineState, reason: str, first: EngineState
    ) -> tuple[EngineState, bytes] | None:
        """The next engine for a leg that failed on ``e`` before the client got
        any of it (a non-streamed leg; a stream before its headers; ``first``:
        the request's first decode engine): the leg goes again whole,
        decode-only. With its payload; None when it may not move (the cap, no
        engine)."""
        state = call.migration
        if state is None:
            return None
        state.pin(first)
        state.failed.add(e.url)
        if not self.moved(state, reason):
            return None
        started = time.perf_counter()
        nxt = await self.next_engine(call, state)
        if nxt is None:
            return None
        logger.warning(
            "request %s: decode leg on %s failed (%s); sent again to %s",
            call.request_id,
            e.url,
            reason,
            nxt.url,
        )
        tracing.migrated(reason, e.url, nxt.url, 0, started)
        return nxt, state.payload()

    # -- a stream -------------------------------------------------------------------

    def recovery(self, call: Call, engine: EngineState, opener: Opener) -> Migrating:
        """The relay's recovery for a migratable stream first on ``engine``."""
        return Migrating(self, call, engine, opener)


Opener = Callable[
    [Call, EngineState, bytes], Awaitable["tuple[UpstreamResponse, AsyncIterator[bytes]] | None"]
]
"""``opener(call, engine, payload)``: a decode leg opened on ``engine``
(``DecodeLeg._open`` with ``relayed=True``), holding it: (response, chunks),
None for an HTTP error; raises LegFailed for a transport failure."""


class Migrating(Recovery):
    """The relay's recovery for a migratable stream (see the module): takes
    the migration comments off the events (keeping the sent token ids), and
    moves a leg that ends short of its ``[DONE]`` to another decode engine."""

    def __init__(self, migrator: Migrator, call: Call, engine: EngineState, opener: Opener) -> None:
        super().__init__(migrator.legs, call)
        state = call.migration
        if state is None:
            raise RuntimeError("broken invariant: a migrating relay on a call that cannot move")
        self.migrator = migrator
        self.state: Migration = state
        self.opener = opener
        state.pin(engine)
        self.engine = engine
        """The engine of the leg being relayed."""
        self.capable = False
        """The leg's first event named token ids (see contracts/migration.py)."""
        self.failed_at: float | None = None
        """perf_counter of the failure being resumed (until the resumed leg's first event)."""
        self.moved_from, self.reason_of_move, self.replayed = "", "", 0

    def events(self, block: bytes, first: bool) -> tuple[bytes, bool]:
        """The block without its comments (the ids kept), and whether it ends
        with ``: migrate``; the first event of a resumed leg ends its move."""
        state = self.state
        if not first and not self.capable:
            # An engine that did not name its first event's tokens does not speak
            # the protocol (contracts/migration.py): its later events carry no
            # comment of it, and its leg is never moved once it sent an event.
            return block, False
        if first:
            self.capable = block.startswith(
                (IDS_PREFIX, END_ONE_PREFIX, MULTI_IDS_PREFIX, END_PREFIX)
            )
            if self.failed_at is not None:
                took = time.perf_counter() - self.failed_at
                self.migrator.resume.observe(took)
                logger.info(
                    "request %s: resumed on %s in %.3fs (%d tokens replayed)",
                    self.call.request_id,
                    self.engine.url,
                    took,
                    self.replayed,
                )
                tracing.migrated(
                    self.reason_of_move,
                    self.moved_from,
                    self.engine.url,
                    self.replayed,
                    self.failed_at,
                )
                self.failed_at = None
            if not self.capable and not block.startswith(b":"):
                # Its first event is OpenAI's alone: as above, for the whole block
                # (one comment first, a ``: migrate`` of a leg handed back before
                # its first token, is still read).
                return block, False
        out, handed_back = split_events(block, state)
        if out and state.created is None:
            # (find, then the regex where it found the key: a search from the
            # block's start walks it in the regex engine)
            at = out.find(b'"created":')
            found = None if at < 0 else _CREATED.match(out, at) or _CREATED.search(out, at + 1)
            if found is not None:
                state.created = int(found.group(1))
        return out, handed_back

    def idle_hold(self, engine: EngineState) -> Callable[[], float] | None:
        """A stream that can still move is not timed out as idle before the
        stall watchdog could judge its engine: a stopped engine's stream is
        moved, not failed, whatever --idle-timeout is next to its stall limit
        (which grows with its steps). Bounded: the limit is (--stall-max-step
        caps a step that counts). An engine the watchdog keeps (the last of
        its role, a slow fleet) times out once this has passed."""
        if not self.capable:
            return None
        pool, state, cap = self.legs.pool, self.state, self.migrator.max_migrations

        def hold() -> float:
            # The watchdog never ejects the last routable engine of a role:
            # there is nowhere to move to, so nothing to wait for.
            if state.moves >= cap or not pool.others_serve(engine):
                return 0.0
            return pool.stall_found_by(engine)

        return hold

    async def recover(self, end: LegEnd) -> Opened | StreamEnd:
        legs, engine, error, state = self.legs, end.engine, end.error, self.state
        if end.handed_back:
            reason = "drain"
        elif error is not None and error.kind == "stalled":
            reason = "stalled"
        else:
            reason = "died"
        failure_message = (
            error.message if error is not None else "the decode engine ended the stream early"
        )
        if reason != "drain":
            legs.pair_failed(self.call, engine)
        if end.got and not self.capable:
            # The engine does not name the tokens it sends (not a pdfleet
            # engine): no exact resume; the stream ends here.
            return StreamEnd(failure_message, 502 if error is None else error.status)
        if error is not None and error.kind == "timeout":
            # Slow, not stalled: moving it would only do the work twice.
            return StreamEnd(
                f"the decode engine sent nothing for {legs.config.idle_timeout:g}s"
                if end.got or end.client_started
                else "the decode engine sent no first token in time",
                error.status,
            )
        # Move the leg: this engine's stream has ended.
        self.failed_at = time.perf_counter()
        self.moved_from, self.reason_of_move = engine.url, reason
        self.replayed = state.replayed()
        state.failed.add(engine.url)
        opened = await self._reopen(engine, reason)
        if opened is None:
            capped = state.moves >= self.migrator.max_migrations
            return StreamEnd(
                f"{failure_message}; the request was moved {state.moves} "
                f"{'time' if state.moves == 1 else 'times'} "
                "(the most --max-migrations allows)"
                if capped
                else f"{failure_message}, and no other decode engine could take it"
                + (
                    f" (none of its resume identity {state.identity})"
                    if state.identity is not None
                    else ""
                ),
                502,
            )
        self.engine = opened[0]
        return opened

    async def _reopen(self, failed: EngineState, reason: str) -> Opened | None:
        """The resumed leg on another engine, or None (the cap reached, no
        engine took it within the bounds)."""
        call, state, migrator = self.call, self.state, self.migrator
        while True:
            if not migrator.moved(state, reason):
                return None
            nxt = await migrator.next_engine(call, state)
            if nxt is None:
                return None
            logger.warning(
                "request %s: decode leg on %s failed (%s) after %d tokens; resuming on %s",
                call.request_id,
                failed.url,
                reason,
                state.replayed(),
                nxt.url,
            )
            try:
                opened = await self.opener(call, nxt, state.payload())
            except LegFailed as failure:
                logger.warning("request %s: %s", call.request_id, failure.detail)
                opened = None
            if (
                opened is None
            ):  # refused: an HTTP error (a draining engine's 503), a transport failure
                state.failed.add(nxt.url)
                failed, reason = nxt, "refused"
                continue
            resp, chunks = opened
            return nxt, resp, chunks
