"""Engine identities in Kubernetes: the operator's side, for real.

The kopf operator runs against kmock on a thread of its own
(tests/helpers/identity_cluster.py) with its identity endpoint over real
HTTPS; the test answers the TokenReviews an API server would. The engine's
client (``engine/kv_transfer/identity_client.py``) is the one engines run.
"""

from __future__ import annotations

import concurrent.futures
import ssl
import time

import httpx
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from helpers.identity_cluster import CONFIGMAPS, IdentityCluster, engine_pod, pod_review
from helpers.kube_fake import DEPLOYMENTS, PODS, SECRETS
from helpers.server import free_port, wait_until

from pdfleet.engine.contracts import identity
from pdfleet.engine.contracts import identity_exchange as exchange
from pdfleet.engine.kv_transfer.identity_client import EndpointClient, Renewer
from pdfleet.operator.identity_endpoint import EndpointCertificate
from pdfleet.operator.manifests import (
    ANNOTATION_IDENTITY,
    ANNOTATION_IDENTITY_ROLE,
    identity_secret_name,
)

TTL = 4.0
SPEC = {
    "model": {"name": "tiny"},
    "engine": {"device": "cpu", "blockSize": 16},
    "kvTransfer": {"connector": "ZmqConnector"},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
}


@pytest.fixture(scope="module")
def cluster():
    started = IdentityCluster({"demo": SPEC, "other": SPEC}, ttl_seconds=TTL).start()
    try:
        started.add_engine_pod("demo-decode-a", "demo", "decode", "sa-decode-a")
        started.add_engine_pod("demo-prefill-a", "demo", "prefill", "sa-prefill-a")
        started.add_engine_pod("other-decode-a", "other", "decode", "sa-other-decode")
        yield started
    finally:
        started.stop()


def public(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)


def ask(cluster, sa_token: str | None, body: bytes, service: str = "demo") -> httpx.Response:
    data = cluster.published(service)
    headers = {"Authorization": f"Bearer {sa_token}"} if sa_token is not None else {}
    return httpx.post(
        data["endpoint"] + exchange.PATH,
        content=body,
        headers=headers,
        verify=ssl.create_default_context(cadata=data["ca.crt"]),
        timeout=10,
    )


def request(role: str = "decode", service: str = "demo") -> bytes:
    return exchange.IdentityRequest(public(Ed25519PrivateKey.generate()), role, service).encode()


def client_for(
    cluster, tmp_path, sa_token: str, role: str, service: str = "demo"
) -> EndpointClient:
    env = cluster.engine_env(service, tmp_path, f"{service}-{role}-{sa_token}", sa_token)
    return EndpointClient(
        env[exchange.ENDPOINT_ENV],
        env[exchange.CA_FILE_ENV],
        env[exchange.SA_TOKEN_FILE_ENV],
        env["PDFLEET_IDENTITY_AUTHORITY"],
        service,
        role,
        Ed25519PrivateKey.generate(),
    )


def issued(cluster, result: str) -> float:
    value = cluster.k.state.metrics.get_sample_value(
        "pdfleet_operator_identity_requests_total", {"result": result}
    )
    return value or 0.0


def test_an_engine_pod_gets_a_token_for_its_key_with_the_pod_as_subject(cluster, tmp_path):
    data = cluster.published("demo")
    assert data["endpoint"].startswith("https://127.0.0.1:")
    before = issued(cluster, "issued")
    client = client_for(cluster, tmp_path, "sa-decode-a", "decode")
    own = client.obtain(10)
    claims = identity.verify_token(data["authority"], own.token)
    assert (claims.subject, claims.role, claims.service) == ("demo-decode-a", "decode", "demo")
    assert claims.public_key == public(client.key)
    assert 0 < claims.expires - time.time() <= TTL
    assert issued(cluster, "issued") == before + 1
    # The authority's private key is in the operator's Secret, never in the ConfigMap.
    secret = cluster.get(SECRETS, identity_secret_name("demo"))
    assert secret["immutable"] is True
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-demo"
    assert set(data) == {"authority", "ca.crt", "endpoint"}
    # Another service's authority vouches for nothing here.
    other = client_for(cluster, tmp_path, "sa-other-decode", "decode", "other").obtain(10)
    assert other.claims.service == "other"
    with pytest.raises(identity.InvalidIdentity, match="not signed by this fleet's authority"):
        identity.verify_token(data["authority"], other.token)


def test_tokens_pods_and_requests_that_do_not_qualify_are_refused(cluster):
    pods = {
        "demo-decode-gone": engine_pod("demo-decode-gone", "demo", "decode", "uid-gone"),
        "demo-decode-old": engine_pod("demo-decode-old", "demo", "decode", "uid-new"),
        "demo-decode-default-sa": engine_pod(
            "demo-decode-default-sa", "demo", "decode", "uid-default-sa", account="default"
        ),
        "not-an-engine": {
            **engine_pod("not-an-engine", "demo", "decode", "uid-not-an-engine"),
            "metadata": {"name": "not-an-engine", "namespace": "ns1", "uid": "uid-not-an-engine"},
        },
    }
    for name, pod in pods.items():
        if name != "demo-decode-gone":
            cluster.put(PODS, pod)
    cluster.reviews.update(
        {
            "sa-gone": pod_review("demo-decode-gone", "uid-gone", "demo-engine"),
            "sa-old": pod_review("demo-decode-old", "uid-old", "demo-engine"),
            "sa-default": pod_review("demo-decode-default-sa", "uid-default-sa", "default"),
            "sa-not-engine": pod_review("not-an-engine", "uid-not-an-engine", "demo-engine"),
            "sa-api-audience": pod_review(
                "demo-decode-a", "uid-demo-decode-a", "demo-engine", audiences=()
            ),
            "sa-unbound": {
                **pod_review("demo-decode-a", "uid-demo-decode-a", "demo-engine"),
                "user": {"username": "system:serviceaccount:ns1:demo-engine"},
            },
        }
    )
    before = issued(cluster, "refused")
    cases = [
        ("an unknown token", "sa-nobody", request(), 401, "not accepted"),
        ("no token", None, request(), 401, "bearer"),
        ("a token of another audience", "sa-api-audience", request(), 401, "audience"),
        ("a token bound to no pod", "sa-unbound", request(), 403, "not bound to a pod"),
        ("a prefill pod asking as decode", "sa-prefill-a", request("decode"), 403, "prefill"),
        ("another service's pod", "sa-other-decode", request(), 403, "belongs to"),
        ("a deleted pod", "sa-gone", request(), 403, "does not exist"),
        ("an earlier pod of the name", "sa-old", request(), 403, "earlier pod"),
        ("a pod of another account", "sa-default", request(), 403, "ServiceAccount default"),
        ("a pod that is no engine", "sa-not-engine", request(), 403, "not an engine pod"),
        ("a malformed body", "sa-decode-a", b"{", 400, "not JSON"),
        (
            "a key that is no key",
            "sa-decode-a",
            b'{"public_key": "AA", "role": "decode", "service": "demo"}',
            400,
            "public_key",
        ),
        ("an oversized body", "sa-decode-a", b"x" * (exchange.MAX_REQUEST_BYTES + 1), 413, "over"),
    ]
    for what, token, body, status, needle in cases:
        r = ask(cluster, token, body)
        assert r.status_code == status, (what, r.text)
        assert needle in exchange.error_of(r.content), (what, r.text)
        assert "token" not in r.json() or "pdfleet-id1" not in r.text, what
    assert issued(cluster, "refused") == before + len(cases)


def test_a_pod_whose_engine_lends_and_pulls_gets_an_identity_of_both(cluster, tmp_path):
    """A kv_both engine (peer pulls) asks as ``both``: its pod template says it may."""
    pod = engine_pod("demo-prefill-both", "demo", "prefill", "uid-demo-prefill-both")
    pod["metadata"]["annotations"] = {ANNOTATION_IDENTITY_ROLE: "both"}
    cluster.put(PODS, pod)
    cluster.reviews["sa-prefill-both"] = pod_review(
        "demo-prefill-both", "uid-demo-prefill-both", "demo-engine"
    )
    own = client_for(cluster, tmp_path, "sa-prefill-both", "both").obtain(10)
    assert (own.claims.subject, own.claims.role) == ("demo-prefill-both", "both")
    assert own.claims.consumes  # it may claim a peer's lease
    # A pod that does not say so is its role label only.
    r = ask(cluster, "sa-prefill-a", request("both"))
    assert r.status_code == 403, r.text
    assert "is a prefill engine, not both" in exchange.error_of(r.content)


def test_the_endpoint_speaks_tls_with_a_certificate_of_the_published_ca_only(cluster):
    data = cluster.published("demo")
    plain = data["endpoint"].replace("https://", "http://") + exchange.PATH
    with pytest.raises(httpx.HTTPError):
        httpx.post(plain, content=request(), timeout=5)
    for verify in (ssl.create_default_context(), True):  # the system's CAs do not vouch for it
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.post(data["endpoint"] + exchange.PATH, content=request(), verify=verify)
    # Another service gets the same endpoint and CA (one endpoint per operator).
    assert cluster.published("other")["ca.crt"] == data["ca.crt"]


def test_requests_past_the_concurrency_bound_get_a_429_and_the_held_ones_complete(cluster):
    # The API server is slow: every review waits. The endpoint serves at most
    # max_concurrent requests at once; one more is told to come back, at once,
    # without a review of its own.
    bound = cluster.config.identity.max_concurrent
    token = "sa-decode-a"
    reviewed = cluster.reviewed[token]
    busy = issued(cluster, "busy")
    cluster.hold_reviews(True)
    with concurrent.futures.ThreadPoolExecutor(bound) as pool:
        try:
            held = [pool.submit(ask, cluster, token, request()) for _ in range(bound)]
            assert wait_until(lambda: cluster.reviewed[token] == reviewed + bound, timeout=30)
            extra = ask(cluster, token, request())
            assert extra.status_code == 429, extra.text
            assert "busy" in exchange.error_of(extra.content)
            assert cluster.reviewed[token] == reviewed + bound
        finally:
            cluster.hold_reviews(False)
        assert [f.result(30).status_code for f in held] == [200] * bound
    assert issued(cluster, "busy") == busy + 1


def test_an_engine_waits_for_an_unreachable_endpoint_then_fails_saying_why(tmp_path):
    (tmp_path / "token").write_text("sa")
    (tmp_path / "ca.crt").write_text(EndpointCertificate(["localhost"]).ca_pem)
    client = EndpointClient(
        f"https://127.0.0.1:{free_port()}",  # nothing listens there
        str(tmp_path / "ca.crt"),
        str(tmp_path / "token"),
        identity.Authority.generate().public_key,
        "demo",
        "decode",
        Ed25519PrivateKey.generate(),
    )
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"did not answer within 1s \(\d+ attempts"):
        client.obtain(1.0)
    assert 1.0 <= time.monotonic() - started < 5.0


def test_a_refusal_ends_the_wait_at_once(cluster, tmp_path):
    client = client_for(cluster, tmp_path, "sa-prefill-a", "decode")
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"refused this engine an identity \(403\).*prefill"):
        client.obtain(60.0)
    assert time.monotonic() - started < 10.0


def test_the_renewer_swaps_in_new_tokens_for_the_same_key(cluster, tmp_path):
    client = client_for(cluster, tmp_path, "sa-decode-a", "decode")
    own = client.obtain(10)
    first = own.token
    renewer = Renewer(client, own)
    try:
        assert wait_until(lambda: renewer.renewals >= 2, timeout=3 * TTL)
    finally:
        renewer.stop()
    assert own.token != first
    assert own.claims.public_key == public(client.key)
    assert own.claims.subject == "demo-decode-a"
    assert identity.verify_token(cluster.published("demo")["authority"], own.token) == own.claims


def test_deleting_the_identity_secret_rotates_the_authority_and_rolls_the_engines(cluster):
    before = cluster.published("other")["authority"]

    def engine_annotation() -> str | None:
        deployment = cluster.get(DEPLOYMENTS, "other-decode") or {}
        meta = deployment.get("spec", {}).get("template", {}).get("metadata", {})
        return (meta.get("annotations") or {}).get(ANNOTATION_IDENTITY)

    old = engine_annotation()
    assert old is not None
    cluster.delete(SECRETS, identity_secret_name("other"))
    assert wait_until(lambda: cluster.published("other")["authority"] != before, timeout=30)
    assert wait_until(lambda: engine_annotation() not in (None, old), timeout=30)
    gateway = cluster.get(DEPLOYMENTS, "other-gateway")["spec"]["template"]["metadata"]
    assert ANNOTATION_IDENTITY not in (gateway.get("annotations") or {})
    assert cluster.get(CONFIGMAPS, "other-identity")["metadata"]["ownerReferences"]
