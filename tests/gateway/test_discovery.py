"""Engine discovery: the engines file (re-read at runtime) and Kubernetes pods."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import sys
from pathlib import Path

import httpx
import openai
import pytest
import yaml
from helpers.fleet import engines_view, metric, start_gateway
from helpers.server import wait_until

from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.gateway.discovery import (
    Endpoint,
    EnginesFileDiscovery,
    KubernetesDiscovery,
    make_discovery,
    parse_engines,
    pod_endpoint,
)


def write_atomically(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(yaml.safe_dump(data) if path.suffix == ".yaml" else json.dumps(data))
    os.replace(tmp, path)


def test_engines_file_is_reread_when_it_changes_and_a_bad_version_is_ignored(tmp_path, caplog):
    path = tmp_path / "engines.yaml"
    write_atomically(path, {"engines": [{"url": "http://d1:8000/", "role": "decode"}]})
    static = [Endpoint("http://p0", "prefill")]
    disc = EnginesFileDiscovery(str(path), static)
    assert asyncio.run(disc.poll()) == [*static, Endpoint("http://d1:8000", "decode")]
    write_atomically(
        path,
        {
            "engines": [
                {"url": "http://d1:8000", "role": "decode"},
                {"url": "http://p1:8000", "role": "prefill", "name": "p-1"},
            ]
        },
    )
    assert [e.url for e in asyncio.run(disc.poll())] == [
        "http://p0",
        "http://d1:8000",
        "http://p1:8000",
    ]
    path.write_text("engines: [unterminated")
    assert len(asyncio.run(disc.poll())) == 3  # kept the last good list
    # A file that parses but holds a bad entry: kept too, the field logged.
    write_atomically(path, {"engines": [{"url": "http://d2:8000", "role": "router"}]})
    assert len(asyncio.run(disc.poll())) == 3
    assert "engines[0].role: " in caplog.text


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "expected an object"),
        ({"engines": [{"url": "http://x"}]}, r"engines\[0\]\.role: required"),
        ({"engines": [{"url": "http://x", "role": "router"}]}, r"engines\[0\]\.role: .*'router'"),
        (
            {"engines": [{"url": "http://x", "role": "decode", "weight": 2}]},
            r"engines\[0\]\.weight: unknown field",
        ),
        (
            {"engines": [{"url": "x:80", "role": "decode"}]},
            r"engines\[0\]\.url: .*must start with http",
        ),
        (
            {"engines": [{"url": "http://x", "role": "decode", "kv_events": "http://e"}]},
            r"engines\[0\]\.kv_events: .*ZMQ endpoint",
        ),
        ({"engines": [], "extra": 1}, "extra: unknown field"),
    ],
)
def test_engines_file_errors_name_the_problem(data, message):
    with pytest.raises(ValueError, match=message):
        parse_engines(data, "engines.json")


def test_gateway_follows_the_engines_file_at_runtime(engines, tmp_path):
    prefill, decode = engines
    path = tmp_path / "engines.json"
    write_atomically(path, {"engines": [{"url": decode.url, "role": "decode"}]})
    gw = start_gateway(
        [
            "--engines-file",
            str(path),
            "--scrape-interval",
            "0.2",
            "--disaggregation-mode",
            "Always",
            "--hold-timeout",
            "1",
        ],
        tmp_path,
    )
    try:

        def routable() -> dict:
            return engines_view(gw.url)["routable"]

        assert routable() == {"prefill": 0, "decode": 1}
        write_atomically(
            path,
            {
                "engines": [
                    {"url": decode.url, "role": "decode"},
                    {"url": prefill.url, "role": "prefill"},
                ]
            },
        )
        assert wait_until(lambda: routable() == {"prefill": 1, "decode": 1}, 10)
        client = openai.OpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=0, timeout=30)
        client.completions.create(model="tiny", prompt="hello", max_tokens=2)
        assert (
            metric(gw.url, "pdfleet_gateway_disagg_decisions_total", decision="prefill_decode") == 1
        )

        write_atomically(path, {"engines": [{"url": prefill.url, "role": "prefill"}]})
        assert wait_until(lambda: routable() == {"prefill": 1, "decode": 0}, 10)
        assert httpx.get(gw.url + "/health", timeout=5).status_code == 503
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model="tiny", prompt="hello", max_tokens=2)
        assert err.value.status_code == 503 and "no decode engine is available" in err.value.message
        # The removed engine's series are gone, not left stale.
        assert metric(gw.url, "pdfleet_gateway_engine_healthy", engine=decode.url) == 0
        assert f'engine="{decode.url}"' not in httpx.get(gw.url + "/metrics", timeout=5).text
    finally:
        gw.stop()


# -- Kubernetes --------------------------------------------------------------------


def pod(name: str, role: str | None, ip: str | None = "10.1.2.3", **kw):
    from kubernetes import client

    return client.V1Pod(
        metadata=client.V1ObjectMeta(
            name=name,
            labels={"pdfleet.dev/role": role} if role else {},
            annotations=kw.get("annotations"),
            deletion_timestamp=kw.get("deleting"),
        ),
        status=client.V1PodStatus(phase=kw.get("phase", "Running"), pod_ip=ip),
    )


def test_pod_to_endpoint_mapping():
    pytest.importorskip("kubernetes")
    assert pod_endpoint(pod("p", "prefill"), 8000) == Endpoint(
        "http://10.1.2.3:8000", "prefill", "p"
    )
    ann = {"pdfleet.dev/port": "9001"}
    assert pod_endpoint(pod("d", "decode", annotations=ann), 8000).url == "http://10.1.2.3:9001"
    assert pod_endpoint(pod("v6", "both", ip="fd00::5"), 8000).url == "http://[fd00::5]:8000"
    now = datetime.datetime.now(datetime.UTC)
    for skipped in (
        pod("no-role", None),
        pod("gateway", "gateway"),
        pod("no-ip", "decode", ip=None),
        pod("pending", "decode", phase="Pending"),
        pod("terminating", "decode", deleting=now),
        pod("bad-port", "decode", annotations={"pdfleet.dev/port": "http"}),
    ):
        assert pod_endpoint(skipped, 8000) is None, skipped.metadata.name


class FakeCoreV1:
    """In-memory stand-in for the Kubernetes API's pod listing."""

    def __init__(self, pods: list) -> None:
        self.pods = pods
        self.calls: list[tuple[str, str]] = []
        self.fail = False

    def list_namespaced_pod(self, namespace: str, label_selector: str, _request_timeout: float):
        from kubernetes import client

        self.calls.append((namespace, label_selector))
        if self.fail:
            raise RuntimeError("API server unreachable")
        return client.V1PodList(items=list(self.pods))


def test_kubernetes_discovery_lists_matching_pods_and_keeps_the_last_list_on_errors():
    pytest.importorskip("kubernetes")
    api = FakeCoreV1([pod("d-0", "decode", ip="10.0.0.2"), pod("p-0", "prefill", ip="10.0.0.1")])
    disc = KubernetesDiscovery("llm", "pdfleet.dev/service=llama", 8000, interval=0.0, api=api)
    first = asyncio.run(disc.poll())
    assert [(e.url, e.role) for e in first] == [
        ("http://10.0.0.1:8000", "prefill"),
        ("http://10.0.0.2:8000", "decode"),
    ]
    assert api.calls == [("llm", "pdfleet.dev/service=llama")]
    api.pods.append(pod("d-1", "decode", ip="10.0.0.3"))
    assert len(asyncio.run(disc.poll())) == 3
    api.fail = True
    assert len(asyncio.run(disc.poll())) == 3
    slow = KubernetesDiscovery("llm", "a=b", 8000, interval=3600, api=api)
    api.fail = False
    asyncio.run(slow.poll())
    asyncio.run(slow.poll())
    assert len(api.calls) == 4  # the second poll of `slow` came within its interval


def test_kubernetes_discovery_without_the_client_package_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "kubernetes", None)  # makes `import kubernetes` fail
    config = GatewayConfig(discovery="kubernetes", selector="pdfleet.dev/service=x")
    with pytest.raises(ValueError, match="needs the `kubernetes` Python package"):
        make_discovery(config)
