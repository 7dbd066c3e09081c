"""`pdfleet status` reads a cluster through the installed kubernetes client: a
real ApiClient, configured from a kubeconfig, against a local HTTP server."""

from __future__ import annotations

import http.server
import threading
from typing import ClassVar

import pytest

from pdfleet.operator.status_cmd import ClusterSource

TOKEN = "status-test-token"


class _API(http.server.BaseHTTPRequestHandler):
    seen: ClassVar[list[tuple[str, str | None]]] = []

    def do_GET(self) -> None:
        self.seen.append((self.path, self.headers.get("authorization")))
        if self.path.endswith("/proxy/metrics"):
            body, status = b"pdfleet_engine_up 1\n", 200
        else:
            body, status = b'{"kind":"Status","code":404}', 404
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _API)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    kubeconfig = tmp_path_factory.mktemp("kube") / "kubeconfig"
    kubeconfig.write_text(
        f"""apiVersion: v1
kind: Config
clusters: [{{name: c, cluster: {{server: "http://127.0.0.1:{server.server_port}"}}}}]
users: [{{name: u, user: {{token: {TOKEN}}}}}]
contexts: [{{name: x, context: {{cluster: c, user: u}}}}]
current-context: x
"""
    )
    from kubernetes.config import kube_config

    with pytest.MonkeyPatch.context() as env:
        # kubernetes reads $KUBECONFIG once, when it is first imported.
        env.setenv("KUBECONFIG", str(kubeconfig))
        env.setattr(kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        src = ClusterSource("ns", "demo")
    yield src
    src.close()
    server.shutdown()
    server.server_close()


def test_cluster_source_gets_pod_metrics_with_the_kubeconfig_token(source):
    path = "/api/v1/namespaces/ns/pods/p-0:8000/proxy/metrics"
    _API.seen.clear()
    assert source._get(path) == "pdfleet_engine_up 1\n"
    assert _API.seen == [(path, f"Bearer {TOKEN}")]


def test_cluster_source_names_a_missing_service_and_raises_on_a_missing_pod(source):
    from kubernetes.client.rest import ApiException

    with pytest.raises(ValueError, match="wrong --namespace or --name"):
        source._get("/apis/pdfleet.dev/v1alpha1/namespaces/ns/inferenceservices/demo")
    with pytest.raises(ApiException) as missing:
        source._get("/api/v1/namespaces/ns/pods/gone:8000/proxy/other")
    assert missing.value.status == 404


def test_cluster_views_read_the_status_through_its_model():
    import json

    from pdfleet.operator.status_cmd import cluster_views, describe_decision

    decision = {"role": "decode", "from": 1, "to": 2, "reason": "queue", "time": "t"}
    services = {
        "items": [
            {
                "metadata": {"name": "a"},
                "status": {
                    "phase": "Ready",
                    "roles": {"decode": {"summary": "2/2"}},
                    "autoscaling": {"lastDecisions": [decision]},
                },
            },
            {"metadata": {"name": "b"}},  # no status yet
            {"metadata": {"name": "c"}, "status": {"phase": "Sideways", "url": "http://x"}},
        ]
    }

    def get(path: str) -> str:
        return json.dumps(services if "inferenceservices" in path else {"items": []})

    a, b, c = cluster_views(get, "ns", None, {})
    assert (a.where, a.gateway) == ("ns/ns Ready", "decode 2/2")
    assert a.decision is not None and describe_decision(a.decision) == ("decode 1 -> 2 at t: queue")
    assert (b.where, b.gateway, b.decision) == ("ns/ns Unknown", "", None)
    assert c.where == "ns/ns Unknown"  # unreadable (another version's): shown as unknown
