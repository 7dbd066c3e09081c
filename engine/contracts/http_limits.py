"""What one HTTP request may cost a pdfleet server: body and head sizes, and the
time a client may take to send them.

One definition for both servers that face clients, the engine's API server
(``pdfleet serve``, docs/serving.md) and the gateway (``pdfleet gateway``,
docs/gateway.md), which serve through one HTTP server (``engine/http/``: the
head and chunk bounds are its own, the body bounds its body readers').
Each server's flags take their defaults from :class:`RequestLimits`, so a
request the gateway accepts is one its engines would accept too.
"""

from __future__ import annotations

from dataclasses import dataclass

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True)
class RequestLimits:
    """Per-request bounds of an HTTP server (flags of ``pdfleet serve`` and
    ``pdfleet gateway``)."""

    max_body_bytes: int = 8 * MiB
    """Largest request body: a larger ``Content-Length`` is a 413 before a byte
    of the body is read; a chunked body is counted as it arrives."""
    max_chunk_bytes: int = 1 * MiB
    """Largest chunk a chunked body's size line may announce, or a chunk may
    hold (413, then the connection closes): refused on its size line, before
    its bytes arrive."""
    max_head_bytes: int = 64 * KiB
    """Largest request line plus headers."""
    header_timeout: float = 10.0
    """Seconds a client may take to send a request's headers (from its first
    byte, or from the connection's opening)."""
    body_timeout: float = 60.0
    """Seconds a client may take to send a request's body after its headers
    (408 beyond)."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_chunk_bytes", "max_head_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout", "body_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")


DEFAULT_LIMITS = RequestLimits()
