"""An engine's identity: from the operator's endpoint (Kubernetes) or a file (``pdfleet up``).

In Kubernetes (``$PDFLEET_IDENTITY_ENDPOINT`` set) the engine makes its own
Ed25519 key pair at start, in memory, and never writes or sends the private
key. It asks the operator's identity endpoint for a token naming the public
key (``engine/contracts/identity_exchange.py`` has the exchange), presenting the
pod's projected ServiceAccount token; TLS is verified against the CA file the
operator publishes. The engine waits for the endpoint at most
``$PDFLEET_IDENTITY_WAIT_SECONDS`` (120 s), then exits with an error saying
what it tried: an engine of a fleet with identities cannot take part in KV
transfer without one, and running without would only hide that. A refusal
(the operator answered 400, 401 or 403) ends the wait at once.

A :class:`Renewer` thread then asks for a new token for the same key when
half of the current one's lifetime has passed, retrying every few seconds on
failure. The token swaps atomically (:class:`RenewableIdentity`); KV
side-channel sessions re-authenticate with the new token before the old one
expires (``side_channel.py``), and a lease, bound to the subject (the pod's
name), stays bound across renewals. If the operator stays away past the
expiry, peers refuse this engine's side channel and decode engines recompute,
until a renewal succeeds.
"""

from __future__ import annotations

import base64
import binascii
import logging
import os
import ssl
import threading
import time
from collections.abc import Mapping

import httpx
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from ..contracts import identity as ident
from ..contracts import identity_exchange as exchange

logger = logging.getLogger(__name__)

# Seconds one request to the endpoint may take.
REQUEST_SECONDS = 10.0
# Waits between attempts (seconds): at start, doubling from the first to the
# last; during renewal, at most RENEW_RETRY_SECONDS.
FIRST_RETRY_SECONDS = 0.5
LAST_RETRY_SECONDS = 5.0
RENEW_RETRY_SECONDS = 15.0
KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}


class IdentityUnavailable(RuntimeError):
    """The endpoint did not answer, or answered "try again" (429, 503)."""


class IdentityDenied(ValueError):
    """The operator refused this engine an identity (400, 401, 403): waiting will not help."""


class RenewableIdentity(ident.EngineIdentity):
    """An engine identity whose token can be replaced by a renewal for the same key.

    Readers (the side channel's threads) see the old token and claims or the
    new ones, never one of each: both live in one tuple, swapped at once."""

    _current: tuple[str, ident.IdentityClaims]

    def __init__(self, key: Ed25519PrivateKey, token: str, claims: ident.IdentityClaims) -> None:
        self._current = (token, claims)
        super().__init__(key, token, claims)

    @property
    def token(self) -> str:
        return self._current[0]

    @token.setter
    def token(self, value: str) -> None:
        self._current = (value, self._current[1])

    @property
    def claims(self) -> ident.IdentityClaims:
        return self._current[1]

    @claims.setter
    def claims(self, value: ident.IdentityClaims) -> None:
        self._current = (self._current[0], value)

    def renew(self, token: str, claims: ident.IdentityClaims) -> None:
        """Take ``token`` (verified: ``claims``) in place of the current one."""
        old = self.claims
        if (claims.subject, claims.role, claims.service, claims.public_key) != (
            old.subject,
            old.role,
            old.service,
            old.public_key,
        ):
            raise ValueError(
                f"the renewed identity is {claims.role} {claims.subject} of {claims.service}, "
                f"not {old.role} {old.subject} of {old.service}"
            )
        self._current = (token, claims)


def _public_bytes(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


class EndpointClient:
    """Asks the operator's identity endpoint for tokens for one key."""

    def __init__(
        self,
        endpoint: str,
        ca_file: str,
        sa_token_file: str,
        authority: str,
        service: str,
        role: str,
        key: Ed25519PrivateKey,
    ) -> None:
        if not endpoint.startswith("https://"):
            raise ValueError(f"${exchange.ENDPOINT_ENV} must be an https:// URL, not {endpoint!r}")
        self.url = endpoint.rstrip("/") + exchange.PATH
        self.ca_file = ca_file
        self.sa_token_file = sa_token_file
        self.authority = authority
        self.key = key
        self.want = exchange.IdentityRequest(_public_bytes(key), role, service)

    def request(self) -> tuple[str, ident.IdentityClaims]:
        """One attempt: a verified token for this key, or IdentityUnavailable /
        IdentityDenied. The CA and the ServiceAccount token are read afresh (the
        kubelet updates both files in place)."""
        try:
            with open(self.sa_token_file, encoding="utf-8") as f:
                sa_token = f.read().strip()
            tls = ssl.create_default_context(cafile=self.ca_file)
        except (OSError, ssl.SSLError) as e:
            raise IdentityUnavailable(f"cannot read {e.filename or 'a file'}: {e}") from None
        try:
            response = httpx.post(
                self.url,
                content=self.want.encode(),
                headers={
                    "Authorization": f"Bearer {sa_token}",
                    "Content-Type": "application/json",
                },
                verify=tls,
                timeout=REQUEST_SECONDS,
                trust_env=False,  # never through a proxy: the token is a credential
            )
        except httpx.HTTPError as e:
            raise IdentityUnavailable(f"{self.url}: {e!r}") from None
        if response.status_code in (400, 401, 403, 404, 413):
            raise IdentityDenied(
                f"{self.url} refused this engine an identity ({response.status_code}): "
                f"{exchange.error_of(response.content)}"
            )
        if response.status_code != 200:
            raise IdentityUnavailable(
                f"{self.url} answered {response.status_code}: {exchange.error_of(response.content)}"
            )
        try:
            token = exchange.IdentityGrant.decode(response.content).token
            claims = ident.verify_token(self.authority, token)
        except ValueError as e:  # InvalidIdentity is one
            raise IdentityDenied(f"{self.url} answered an unusable token: {e}") from None
        if claims.public_key != self.want.public_key:
            raise IdentityDenied(f"{self.url} answered a token for another key")
        if (claims.role, claims.service) != (self.want.role, self.want.service):
            raise IdentityDenied(
                f"{self.url} answered a {claims.role} identity of {claims.service}, "
                f"not {self.want.role} of {self.want.service}"
            )
        return token, claims

    def obtain(self, wait_seconds: float) -> RenewableIdentity:
        """The first token, waiting for the endpoint at most ``wait_seconds``."""
        deadline = time.monotonic() + wait_seconds
        delay = FIRST_RETRY_SECONDS
        attempts = 0
        while True:
            attempts += 1
            try:
                token, claims = self.request()
                break
            except IdentityDenied as e:
                raise ValueError(f"no identity for this engine: {e}") from None
            except IdentityUnavailable as e:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ValueError(
                        f"no identity for this engine: the operator's identity endpoint did "
                        f"not answer within {wait_seconds:.0f}s ({attempts} attempts; last: "
                        f"{e}). Engines of a service with kvTransfer.identity: Required get "
                        "their identity from the operator: check that it runs and that this "
                        'pod may reach its identity Service (docs/security.md, "Identities")'
                    ) from None
                if attempts == 1:
                    logger.warning("waiting for the identity endpoint: %s", e)
                time.sleep(min(delay, left))
                delay = min(delay * 2, LAST_RETRY_SECONDS)
        logger.info(
            "identity: %s engine %s of %s, valid %.0fs",
            claims.role,
            claims.subject,
            claims.service,
            claims.expires - time.time(),
        )
        return RenewableIdentity(self.key, token, claims)


class Renewer:
    """Renews an identity at half its remaining lifetime until stopped."""

    def __init__(self, client: EndpointClient, own: RenewableIdentity) -> None:
        self.client = client
        self.own = own
        self.renewals = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="identity-renewer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        delay = max(0.0, self.own.claims.expires - time.time()) / 2
        expired_said = False
        while not self._stop.wait(delay):
            try:
                token, claims = self.client.request()
                self.own.renew(token, claims)
            except (IdentityUnavailable, IdentityDenied, ValueError) as e:
                left = self.own.claims.expires - time.time()
                if left <= 0 and not expired_said:
                    expired_said = True
                    logger.error(
                        "identity %s has expired and cannot be renewed (%s): peers refuse this "
                        "engine's KV side channel until a renewal succeeds",
                        self.own.claims.subject,
                        e,
                    )
                elif left > 0:
                    logger.warning("identity renewal failed (%.0fs left): %s", left, e)
                delay = min(RENEW_RETRY_SECONDS, max(1.0, left / 4))
                continue
            self.renewals += 1
            expired_said = False
            delay = max(1.0, (claims.expires - time.time()) / 2)
            logger.info(
                "identity renewed: %s, valid %.0fs", claims.subject, claims.expires - time.time()
            )

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(REQUEST_SECONDS + 1)


def engine_identity(
    kv_role: str, environ: Mapping[str, str] | None = None
) -> tuple[ident.FleetIdentity, Renewer | None]:
    """This engine's identity and the renewer keeping it fresh (None: nothing to renew).

    ``$PDFLEET_IDENTITY_ENDPOINT`` set: from the operator (above). Otherwise as
    :func:`~pdfleet.engine.contracts.identity.fleet_identity_from_env` says: the
    file ``$PDFLEET_IDENTITY_FILE`` names (``pdfleet up``), or no identities."""
    environ = os.environ if environ is None else environ
    endpoint = environ.get(exchange.ENDPOINT_ENV, "").strip()
    if not endpoint:
        return ident.fleet_identity_from_env(environ), None
    if environ.get(ident.IDENTITY_FILE_ENV, "").strip():
        raise ValueError(
            f"${exchange.ENDPOINT_ENV} and ${ident.IDENTITY_FILE_ENV} are both set: an engine "
            "gets its identity from the operator or from a file, not both"
        )
    names = (
        ident.IDENTITY_AUTHORITY_ENV,
        exchange.CA_FILE_ENV,
        exchange.SA_TOKEN_FILE_ENV,
        exchange.SERVICE_ENV,
    )
    values = {name: environ.get(name, "").strip() for name in names}
    missing = [name for name, value in values.items() if not value]
    if missing:
        raise ValueError(f"${exchange.ENDPOINT_ENV} is set but ${missing[0]} is not")
    if kv_role not in KV_ROLES:
        raise ValueError(
            f"kv_role {kv_role}: engines get identities from the operator as prefill "
            "(kv_producer), decode (kv_consumer) or both (kv_both) engines"
        )
    authority = values[ident.IDENTITY_AUTHORITY_ENV]
    try:
        if len(base64.urlsafe_b64decode(authority + "=" * (-len(authority) % 4))) != 32:
            raise ValueError
    except (ValueError, binascii.Error):
        raise ValueError(
            f"${ident.IDENTITY_AUTHORITY_ENV} is not a base64 Ed25519 public key"
        ) from None
    try:
        wait = float(environ.get(exchange.WAIT_ENV, "") or exchange.DEFAULT_WAIT_SECONDS)
    except ValueError:
        raise ValueError(f"${exchange.WAIT_ENV} is not a number of seconds") from None
    client = EndpointClient(
        endpoint,
        values[exchange.CA_FILE_ENV],
        values[exchange.SA_TOKEN_FILE_ENV],
        authority,
        values[exchange.SERVICE_ENV],
        KV_ROLES[kv_role],
        Ed25519PrivateKey.generate(),
    )
    own = client.obtain(wait)
    return ident.FleetIdentity(authority, own), Renewer(client, own)
