"""What an engine and its grammar compile workers exchange
(``sample/grammar_worker.py``: a child process per worker, on its stdin and
stdout; nothing is pickled).

Every message is a frame: :data:`FRAME_HEADER` bytes of big-endian length,
then that many bytes (:func:`frame`). The engine sends the tokenizer
(xgrammar's ``TokenizerInfo.serialize_json``, as is) once, and the child
answers :data:`READY` ``{"ready": true}``. Then, per compile:

* the engine sends a :class:`CompileRequest` ``{"kind": ..., "text": ...,
  "max_bytes": N}`` (``kind`` one of :data:`KINDS`);
* the child answers one JSON header (:func:`decode_answer`): a
  :class:`Compiled` ``{"ok": true, "bytes": N}``, followed by a frame of the
  serialized grammar; a :class:`TooLarge` ``{"ok": false, "too_large": N}``
  (it compiled to N bytes, over ``max_bytes``); or a :class:`Failed`
  ``{"ok": false, "error": "..."}`` (the input does not compile).

Decoders raise ``ValueError`` naming what is malformed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

FRAME_HEADER = 8
"""Bytes of a frame's big-endian length."""
KINDS = ("json_schema", "json_object", "regex", "grammar", "lark")
"""What a compile request may ask for."""
READY = json.dumps({"ready": True}).encode()
"""The child's first answer, once it has read the tokenizer."""


def frame(data: bytes) -> bytes:
    """``data`` as one frame: its length, then itself."""
    return len(data).to_bytes(FRAME_HEADER, "big") + data


def frame_size(header: bytes) -> int:
    """The length a frame's :data:`FRAME_HEADER` bytes announce."""
    if len(header) != FRAME_HEADER:
        raise ValueError(f"a frame header is {FRAME_HEADER} bytes")
    return int.from_bytes(header, "big")


def _object(data: bytes, what: str) -> dict[str, Any]:
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{what} is not JSON") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{what} is not a JSON object")
    return raw


def _count(raw: dict[str, Any], name: str, what: str) -> int:
    value = raw.get(name)
    if type(value) is not int or value < 0:
        raise ValueError(f"{what}: {name} is not a byte count")
    return value


def is_ready(data: bytes) -> bool:
    """Whether the child's first frame is :data:`READY`."""
    try:
        return _object(data, "a grammar worker's first answer").get("ready") is True
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class CompileRequest:
    """One compile: the grammar's ``kind`` and ``text`` (ignored for
    ``json_object``), and the most bytes its compiled form may take."""

    kind: str
    text: str
    max_bytes: int

    def encode(self) -> bytes:
        return json.dumps(
            {"kind": self.kind, "text": self.text, "max_bytes": self.max_bytes}
        ).encode()

    @classmethod
    def decode(cls, data: bytes) -> CompileRequest:
        what = "a grammar compile request"
        raw = _object(data, what)
        kind, text = raw.get("kind"), raw.get("text")
        if kind not in KINDS:
            raise ValueError(f"{what}: kind {kind!r} is not one of {', '.join(KINDS)}")
        if not isinstance(text, str):
            raise ValueError(f"{what}: text is not a string")
        return cls(kind, text, _count(raw, "max_bytes", what))


@dataclass(frozen=True, slots=True)
class Compiled:
    """The grammar compiled to ``size`` bytes; its serialization is the next frame."""

    size: int

    def encode(self) -> bytes:
        return json.dumps({"ok": True, "bytes": self.size}).encode()


@dataclass(frozen=True, slots=True)
class TooLarge:
    """The grammar compiled to ``size`` bytes, more than the request allowed."""

    size: int

    def encode(self) -> bytes:
        return json.dumps({"ok": False, "too_large": self.size}).encode()


@dataclass(frozen=True, slots=True)
class Failed:
    """The input does not compile; ``error`` is the library's reason."""

    error: str

    def encode(self) -> bytes:
        return json.dumps({"ok": False, "error": self.error}).encode()


CompileAnswer = Compiled | TooLarge | Failed


def decode_answer(data: bytes) -> CompileAnswer:
    """The child's answer header; ValueError when it is malformed."""
    what = "a grammar compile answer"
    raw = _object(data, what)
    ok = raw.get("ok")
    if ok is True:
        return Compiled(_count(raw, "bytes", what))
    if ok is not False:
        raise ValueError(f"{what}: ok is not a boolean")
    if "too_large" in raw:
        return TooLarge(_count(raw, "too_large", what))
    error = raw.get("error")
    if not isinstance(error, str):
        raise ValueError(f"{what}: error is not a string")
    return Failed(error)
