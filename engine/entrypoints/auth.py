"""Who may call an engine's HTTP routes: the fleet token or one of its API keys.

An engine accepts ``Authorization: Bearer T`` (scheme case-insensitive) where
``T`` is the fleet token derived from the fleet secret (what the gateway and
the operator present), one of its internal keys (an internal caller that is
not a fleet member, e.g. vLLM's P/D router), or one of the engine's own API
keys (for clients that call an engine directly). The first two are
*internal* callers: only they may send internal fields such as
``kv_transfer_params`` (:meth:`EngineAuth.is_internal`); a client API key
never may. Every comparison is constant-time
(``security.key_matches``). Health probes stay open so that kubelets and
supervisors need no credential. An engine with neither a fleet secret nor an
API key is open (single-engine development) and says so once in its log.

See docs/security.md for the trust model and docs/serving.md for the flags.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

from ..contracts import security

logger = logging.getLogger("pdfleet.serve")

# Liveness/readiness probes: answered without a credential.
PROBE_PATHS = frozenset({"/health", "/ping"})


def keys_from_sources(
    flag_values: Iterable[str] = (),
    key_files: Iterable[str] = (),
    environ: Mapping[str, str] | None = None,
    flag: str = "--api-key-file",
) -> list[str]:
    """API keys from ``--api-key`` values (comma-separated, repeatable),
    ``--api-key-file`` paths, and ``$PDFLEET_API_KEY`` / ``$PDFLEET_API_KEY_FILE``.

    Flags and files add to each other; the environment is read only when no
    flag or file gave a key (as the gateway does), so a key in the env can be
    overridden per process.
    """
    keys: list[str] = []
    for value in flag_values:
        keys += security.split_keys(value)
    for path in key_files:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None
        found = security.split_keys(text)
        if not found:
            raise ValueError(f"{flag}: {path} holds no key")
        keys += found
    if not keys:
        keys = security.api_keys_from_env(os.environ if environ is None else environ)
    return list(dict.fromkeys(keys))


class EngineAuth:
    """The credentials an engine accepts."""

    def __init__(
        self,
        api_keys: Iterable[str] = (),
        fleet_secret: bytes | None = None,
        internal_keys: Iterable[str] = (),
    ) -> None:
        self.api_keys = [k for k in api_keys if k]
        self.has_fleet_secret = fleet_secret is not None
        self._internal = [k for k in internal_keys if k]
        if fleet_secret is not None:
            self._internal.append(security.fleet_token(fleet_secret))
        self._accepted = [*self.api_keys, *self._internal]

    @property
    def open(self) -> bool:
        return not self._accepted

    def warn_if_open(self) -> None:
        """Log once, at startup, that this engine takes requests from anyone."""
        if self.open:
            logger.warning(
                "this engine accepts requests without credentials: set $%s (or $%s) or an "
                "API key ($%s, --api-key-file) to require one",
                security.FLEET_SECRET_ENV,
                security.FLEET_SECRET_FILE_ENV,
                security.API_KEY_FILE_ENV,
            )

    def allows(self, authorization: str | None) -> bool:
        """Whether a request with this ``Authorization`` header may proceed."""
        if self.open:
            return True
        return security.key_matches(security.bearer_token(authorization), self._accepted)

    def is_internal(self, authorization: str | None) -> bool:
        """Whether the caller is internal (fleet token or an internal key), and so may
        send internal fields. An open engine (no credential at all) trusts everyone."""
        if self.open:
            return True
        return security.key_matches(security.bearer_token(authorization), self._internal)
