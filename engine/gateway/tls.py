"""TLS to engines: one verified client context for every ``https://`` engine URL.

Certificates are always verified (``ssl.create_default_context``: the peer's
chain and its host name), against ``--ca-bundle`` when given, else the
system's trust store; ``--client-cert``/``--client-key`` add a client
certificate for engines that require mutual TLS. Plain ``http://`` to a host
that is not loopback is allowed (a pod network may be private) but logged
once, since the fleet token then crosses the network in clear.
"""

from __future__ import annotations

import ipaddress
import logging
import ssl
from urllib.parse import urlsplit

from ..config.gateway import GatewayConfig

logger = logging.getLogger("pdfleet.gateway")


def client_context(config: GatewayConfig) -> ssl.SSLContext:
    """The verifying client context for ``https://`` engines (ValueError if a file is bad)."""
    try:
        ctx = ssl.create_default_context(cafile=config.ca_bundle)
        if config.client_cert:
            ctx.load_cert_chain(config.client_cert, config.client_key)
    except (OSError, ssl.SSLError) as e:
        raise ValueError(
            f"TLS files (--ca-bundle / --client-cert / --client-key) cannot be loaded: {e}"
        ) from e
    return ctx


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class PlaintextWarning:
    """Logs once per gateway that a non-loopback engine is reached over plain http://."""

    def __init__(self) -> None:
        self.warned = False

    def check(self, url: str) -> None:
        parts = urlsplit(url)
        if self.warned or parts.scheme != "http" or is_loopback(parts.hostname or ""):
            return
        self.warned = True
        logger.warning(
            "engine %s is reached over plain http:// on a non-loopback host: requests and the "
            "fleet token cross the network unencrypted; use https:// engine URLs (see "
            "docs/gateway.md) or keep engines on a private network",
            url,
        )
