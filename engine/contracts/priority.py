"""The trusted ``priority`` the gateway sends engines: a band and a fair-share tag.

With ``--engine-priority`` the gateway sends each request's priority as
``band << TAG_BITS | tag``: its tenant's band (a lower value is served
first, vLLM's convention) in the high bits and its fair-share tag (tokens
over weight since the gateway started, at most ``MAX_TAG``) in the low ones.
An engine scheduling by priority orders its queue by the whole value (so by
band, then fairly within one) and uses the band alone for what must not
churn within a band: a request of a better band may preempt one of a worse
band for a slot, and a step in which it prefills leaves out the requests of
worse bands (its first token waits for no one's decode). A client's small
priorities (vLLM's 0, 1, -3) are all band 0 or -1 here: within them the
engine schedules by priority as vLLM does.
"""

from __future__ import annotations

TAG_BITS = 40
MAX_TAG = (1 << TAG_BITS) - 1
MAX_BAND = (1 << 19) - 1
"""Online bands are within ±MAX_BAND."""
BATCH_BAND = MAX_BAND + 1
"""The band of batch requests (the OpenAI Batch API): below every online band."""


def encode(band: int, tag: float) -> int:
    """The engine priority of a request of ``band`` whose fair-share tag is
    ``tag`` (capped at ``MAX_TAG``): the band in the high bits, the tag below."""
    return (band << TAG_BITS) + min(int(tag), MAX_TAG)


def band_of(priority: int) -> int:
    """The band of an engine priority (floor division: negative bands hold)."""
    return priority >> TAG_BITS
