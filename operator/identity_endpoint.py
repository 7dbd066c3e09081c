"""The operator's identity endpoint: HTTPS, one route, engine pods its only callers.

``POST /v1/identity`` with ``Authorization: Bearer <projected ServiceAccount
token>`` and an :class:`~pdfleet.engine.contracts.identity_exchange.IdentityRequest`
body answers an identity token (:mod:`.identity_issuer` decides), or a JSON
``{"error": ...}`` with 400 (the body), 401 (the token), 403 (the pod), 413
(too large), 429 (too many requests at once) or 503 (try again later).

Why TLS: the ServiceAccount token is a bearer credential. Anyone who saw it
on the wire could, until it expires, ask for an identity for a key of their
own. So the endpoint serves TLS with a certificate of a CA the operator makes
at start, in memory: its private key signs the one server certificate and is
then dropped; the server's key never touches a disk (a memfd on Linux). Engine
pods trust only that CA (the ``ca.crt`` of each service's ``NAME-identity``
ConfigMap) and check the host name. A restarted operator has a new CA; it
rewrites the ConfigMaps as it resumes each service, and the kubelet updates
the mounted file, which engines re-read on every request.
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import logging
import os
import shutil
import ssl
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ..engine.contracts import identity_exchange as exchange
from .identity_issuer import IdentityRefused, issue_identity
from .kube import KubeClient

logger = logging.getLogger(__name__)

# Seconds one request may take (TokenReview, pod and Secret reads).
REQUEST_SECONDS = 10.0
# The server certificate's lifetime: its CA lives only as long as the process.
CERT_DAYS = 3650


@dataclass(frozen=True)
class IdentityEndpointConfig:
    """Where the endpoint listens, what engines are told, what tokens it signs."""

    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0`` in a pod)."""
    port: int = 0
    """Port to listen on (0: any free one, as tests use)."""
    service: str | None = None
    """The Service fronting the endpoint in the operator's namespace: engines
    are told ``https://SERVICE.NAMESPACE.svc:PORT``; None: ``https://HOST:PORT``
    (the bound port; for tests and ``pdfleet operator`` run by hand)."""
    ttl_seconds: float = 3600.0
    """Lifetime of an identity token; engines renew at half of it."""
    max_concurrent: int = 8
    """Requests served at once; more get a 429 (engines retry)."""
    dns_names: tuple[str, ...] = field(default_factory=tuple)
    """Extra host names for the certificate."""


class EndpointCertificate:
    """A CA and a server certificate for ``hosts``, made now, in memory."""

    def __init__(self, hosts: list[str]) -> None:
        now = datetime.datetime.now(datetime.UTC)
        not_before = now - datetime.timedelta(minutes=5)  # nodes' clocks differ a little
        not_after = now + datetime.timedelta(days=CERT_DAYS)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdfleet identity CA")])
        ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
        ca = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(ca_ski, critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        self._key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(ca_name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self._key.public_key()), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        # The CA's key is dropped here: no other certificate can ever chain to it.
        self.ca_pem = ca.public_bytes(serialization.Encoding.PEM).decode()

    def server_context(self) -> ssl.SSLContext:
        """A TLS 1.2+ server context with the certificate and its key."""
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        pem = self._cert.public_bytes(serialization.Encoding.PEM) + self._key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        _load_chain(context, pem)
        return context


def _load_chain(context: ssl.SSLContext, pem: bytes) -> None:
    """``load_cert_chain`` reads files only: hand it an in-memory file (Linux), else
    a private temporary directory removed at once."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("pdfleet-identity-tls", 0)
        try:
            os.write(fd, pem)
            context.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return
    folder = tempfile.mkdtemp()
    try:
        path = os.path.join(folder, "server.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
        context.load_cert_chain(path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


class IdentityEndpoint:
    """The HTTPS server (aiohttp, on the operator's event loop)."""

    def __init__(
        self,
        config: IdentityEndpointConfig,
        client: Callable[[], KubeClient],
        *,
        namespace: str | None,
        counter: Any = None,
    ) -> None:
        self.config = config
        self._client = client
        self._namespace = namespace
        self._counter = counter  # pdfleet_operator_identity_requests_total{result}
        self._busy = 0
        self._runner: web.AppRunner | None = None
        self.port = 0
        hosts = ["localhost", "127.0.0.1", *config.dns_names]
        if config.service is not None and namespace is not None:
            base = f"{config.service}.{namespace}"
            hosts = [f"{base}.svc", base, f"{base}.svc.cluster.local", config.service, *hosts]
        self.certificate = EndpointCertificate(hosts)

    @property
    def ca_pem(self) -> str:
        return self.certificate.ca_pem

    @property
    def url(self) -> str:
        """What engine pods are told (``$PDFLEET_IDENTITY_ENDPOINT``)."""
        if self.config.service is not None and self._namespace is not None:
            return f"https://{self.config.service}.{self._namespace}.svc:{self.port}"
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host  # noqa: S104 (compared, not bound)
        return f"https://{host}:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=exchange.MAX_REQUEST_BYTES)
        app.router.add_post(exchange.PATH, self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(
            self._runner,
            self.config.host,
            self.config.port,
            ssl_context=self.certificate.server_context(),
        )
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        logger.info("identity endpoint on %s (listening on port %d)", self.url, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _answer(self, result: str, status: int, body: bytes) -> web.Response:
        if self._counter is not None:
            self._counter.labels(result).inc()
        return web.Response(status=status, body=body, content_type="application/json")

    def _refuse(self, status: int, message: str) -> web.Response:
        return self._answer("refused", status, exchange.error_body(message))

    async def _handle(self, request: web.Request) -> web.Response:
        scheme, _, sa_token = request.headers.get("Authorization", "").partition(" ")
        sa_token = sa_token.strip()
        if scheme.lower() != "bearer" or not sa_token:
            return self._refuse(401, "send the pod's ServiceAccount token as a bearer token")
        if len(sa_token) > exchange.MAX_SA_TOKEN_CHARS:
            return self._refuse(401, "the ServiceAccount token is too long")
        try:
            want = exchange.IdentityRequest.decode(await request.read())
        except web.HTTPRequestEntityTooLarge:
            return self._refuse(413, f"the request is over {exchange.MAX_REQUEST_BYTES} bytes")
        except ValueError as e:
            return self._refuse(400, str(e))
        if self._busy >= self.config.max_concurrent:
            return self._answer("busy", 429, exchange.error_body("busy: try again shortly"))
        self._busy += 1
        try:
            client = self._client()
            issued = await asyncio.wait_for(
                issue_identity(client, sa_token, want, ttl=self.config.ttl_seconds),
                REQUEST_SECONDS,
            )
        except IdentityRefused as e:
            logger.warning("identity refused (%d): %s", e.status, e)
            if e.status == 503:
                return self._answer("error", 503, exchange.error_body(str(e)))
            return self._refuse(e.status, str(e))
        except Exception as e:  # not logged in yet, the API server too slow, ...
            logger.warning("identity request failed: %r", e)
            return self._answer("error", 503, exchange.error_body("the operator is not ready"))
        finally:
            self._busy -= 1
        logger.info(
            "identity issued to %s engine %s/%s of %s",
            issued.role,
            issued.namespace,
            issued.pod,
            issued.service,
        )
        return self._answer("issued", 200, exchange.IdentityGrant(issued.token).encode())
