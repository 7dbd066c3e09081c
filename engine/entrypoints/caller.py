"""Who a request is for: the identity that per-caller bounds count against.

A client calling an engine directly is its API key (a digest of it,
``security.caller_id``), or its address on an engine without keys. A
request forwarded by a gateway (or any holder of the fleet token) is the
client that gateway names in ``X-Pdfleet-Caller``; the header is ignored from
anyone else, so a client cannot pose as another. See docs/security.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ..contracts import security
from .auth import EngineAuth

# What a named caller may look like (the gateway sends "key:<hex>" or "addr:<host>").
_TAME = re.compile(r"[A-Za-z0-9._:@/+=\[\]-]{1,128}")


def request_caller(headers: Mapping[str, str], client_host: str | None, auth: EngineAuth) -> str:
    """The caller of one request (``headers`` with lower-case names)."""
    authorization = headers.get("authorization")
    if auth.is_internal(authorization):
        named = headers.get(security.CALLER_HEADER)
        return named if named and _TAME.fullmatch(named) else "internal"
    # On an engine without credentials a key is not checked: it names no one.
    token = None if auth.open else security.bearer_token(authorization)
    return security.caller_id(token, client_host)
