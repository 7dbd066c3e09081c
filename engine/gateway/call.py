"""One client request as the gateway carries it through the legs, and what is
checked of it before any leg: its id and its body."""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from json.scanner import make_scanner
from typing import Any

from .prompt import PromptInfo

# A client X-Request-Id is echoed and logged only when it is this tame.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")
# New request ids: 64 random bits per process (each worker of --workers N is
# its own interpreter) and a counter: unique across processes and replicas
# like a uuid4, without a system call per request.
_ID_PREFIX = os.urandom(8).hex()
_id_counter = itertools.count()
# A \uD800-\uDFFF escape: the body may hold a lone surrogate (checked only then).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
# ``json.loads``' own scan (a default decoder's, as JSONDecoder makes it; typeshed
# types the argument as the scanner class), called without its three Python
# layers; and the blanks JSON allows after a document.
_SCAN_JSON: Callable[[str, int], tuple[Any, int]] = make_scanner(json.JSONDecoder())  # type: ignore[arg-type]
_JSON_BLANKS = " \t\n\r"
# The prompt of a request routed without analysis (``Proxy._sole_route``).
NOT_ANALYZED = PromptInfo(0, analyzed=False)


@dataclass
class Call:
    """One request of the client, as it goes through the legs."""

    endpoint: str
    request_id: str
    start: float
    headers: dict[str, str]
    """What the legs add to the engine client's fixed headers (the request id)."""
    chat: bool
    prefill_url: str | None = None
    """The prefill engine whose KV the decode leg carries, if any."""
    plain_payload: bytes | None = None
    """The decode leg without kv_transfer_params (sent when the engine refuses
    the params: an expired lease, a restarted producer)."""
    body: dict[str, Any] | None = None
    """The parsed body (its prompt is analyzed on demand when it was routed
    without, see ``Proxy._sole_route``)."""
    info: PromptInfo | None = None
    """That analysis, once made."""
    slot: Any = None
    """The decode engine (``EngineState``) whose slot the request holds from its
    route to the end of its answer (``admission.py``); None before and after."""
    prefill_slot: Any = None
    """The prefill engine whose slot it holds from its route to the end of its
    prefill leg; None before and after."""
    id_from_body: bool = False
    """The client sent no X-Request-Id: a body's ``request_id`` names the call."""
    ticket: Any = None
    """Its tenant's hold (``flow.control.Ticket``) from admission to its end."""
    batch: bool = False
    """A Batch API request: runs in the batch band."""
    top: bool = False
    """Of the best band (``Admission.top_band``): its slots count in that
    band's share beyond an engine's capacity."""
    seqs: int = 1
    """Sequences it runs on its decode engine (``n`` or ``best_of``, × prompts):
    the slots it takes there (``admission.py``)."""
    migration: Any = None
    """A migratable request's state across decode legs (``migration.Migration``);
    None when it cannot move."""
    on_computed: Callable[[], None] | None = None
    """Peer pulls: takes its prompt tokens off its engine's predicted queue
    (``PeerPull.routed``); called once its prompt is computed, see ``computed``."""

    def computed(self) -> None:
        """Mutates: its prompt was computed (its prefill leg ended, its first
        event arrived, or it ended): it no longer queues at its engine."""
        hook, self.on_computed = self.on_computed, None
        if hook is not None:
            hook()


def tame_request_id(value: Any) -> bool:
    """A request id the gateway passes on as it is (logs and headers take it)."""
    return isinstance(value, str) and _REQUEST_ID.fullmatch(value) is not None


def client_request_id(header: str | None) -> str:
    """The client's X-Request-Id when it is a tame token, else a new id."""
    if header and _REQUEST_ID.fullmatch(header):
        return header
    return f"{_ID_PREFIX}{next(_id_counter):016x}"


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or ValueError saying what is wrong
    (invalid UTF-8 or JSON, nested too deeply, a lone surrogate, not an object)."""
    try:
        # A UTF-8 object (the usual case) decoded and scanned here: json.loads(bytes)
        # first guesses among UTF-8/16/32; anything else, or a scan that fails or
        # stops short of the end, keeps that path (its errors).
        if raw[:1] == b"{" and raw[1:2] != b"\x00":
            text = raw.decode()
            try:
                body, end = _SCAN_JSON(text, 0)
            except (ValueError, StopIteration):
                end = -1
            if end != len(text) and (end < 0 or text[end:].strip(_JSON_BLANKS)):
                body = json.loads(text)
        else:
            body = json.loads(raw)
    except RecursionError:
        raise ValueError("the request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"invalid JSON body: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("the request body must be a JSON object")
    if raw.find(b"\\u") >= 0 and _SURROGATE_ESCAPE.search(raw):  # (find: memchr, no regex walk)
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(
                "the request body holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                "escape), which is not text"
            ) from None
    return body


def field_of(message: str, body: dict[str, Any]) -> str | None:
    """The request field a check_sampling message names (its first word)."""
    name = re.split(r"[\s:(]", message, maxsplit=1)[0]
    # A nested field (response_format.json_schema.schema, tools[0].function.name).
    return name if re.split(r"[.\[]", name, maxsplit=1)[0] in body else None
