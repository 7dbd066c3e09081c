"""The whole flow on a real cluster: helm install, apply the CPU example, serve, scale, delete.

Runs when KUBECONFIG points at a cluster whose nodes can run the images
(kind: ``kind load docker-image pdfleet:0.1.0 pdfleet-operator:0.1.0``);
skipped otherwise. Images: $PDFLEET_IMAGE and $PDFLEET_OPERATOR_IMAGE.
Everything happens in a fresh namespace, removed at the end.
"""

from __future__ import annotations

import os
import pathlib
import queue
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import yaml
from helpers.helm_tool import helm, kubectl_binary

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    not os.environ.get("KUBECONFIG"),
    reason="KUBECONFIG is not set: the cluster test needs a real cluster with the pdfleet "
    "and pdfleet-operator images available to its nodes",
)

ENGINE_IMAGE = os.environ.get("PDFLEET_IMAGE", "pdfleet:0.1.0")
OPERATOR_IMAGE = os.environ.get("PDFLEET_OPERATOR_IMAGE", "pdfleet-operator:0.1.0")
GROUP, VERSION, PLURAL = "pdfleet.dev", "v1alpha1", "inferenceservices"


def wait_for(predicate: Callable[[], Any], *, timeout: float, what: str, every: float = 2.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


@pytest.fixture(scope="module")
def kube():
    from kubernetes import client, config

    config.load_kube_config()
    return client


@pytest.fixture(scope="module")
def namespace(kube) -> Iterator[str]:
    name = f"pdfleet-e2e-{uuid.uuid4().hex[:6]}"
    helm(
        "install", "pdfleet", str(ROOT / "charts" / "pdfleet"),
        "--namespace", name, "--create-namespace",
        "--set", "namespaced=true",
        "--set", f"image={OPERATOR_IMAGE}",
        "--set", f"engineImage={ENGINE_IMAGE}",
        "--wait", "--timeout", "5m",
    )  # fmt: skip
    try:
        yield name
    finally:
        helm("uninstall", "pdfleet", "--namespace", name, "--wait", "--timeout", "3m")
        kube.CoreV1Api().delete_namespace(name)


@pytest.fixture
def port_forward(namespace) -> Iterator[Callable[[str, int], int]]:
    """``forward(service, port) -> local port`` via kubectl port-forward (stopped after)."""
    processes: list[subprocess.Popen] = []

    def forward(service: str, port: int) -> int:
        proc = subprocess.Popen(
            [str(kubectl_binary()), "port-forward", "-n", namespace, f"svc/{service}", f"0:{port}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        processes.append(proc)
        lines: queue.Queue[str] = queue.Queue()

        def pump() -> None:
            for line in proc.stdout:
                lines.put(line)

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            match = re.search(r"Forwarding from 127\.0\.0\.1:(\d+)", line)
            if match:
                return int(match.group(1))
        raise AssertionError("kubectl port-forward did not start within 30 s")

    yield forward
    for proc in processes:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def test_cpu_example_serves_scales_and_cleans_up(kube, namespace, port_forward):
    from openai import OpenAI

    custom = kube.CustomObjectsApi()
    apps = kube.AppsV1Api()
    body = yaml.safe_load((ROOT / "examples" / "inferenceservice-cpu.yaml").read_text())
    name = body["metadata"]["name"]
    custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)

    def svc() -> dict:
        return custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)

    def ready() -> bool:
        conditions = (svc().get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    wait_for(ready, timeout=900, what="Ready=True")
    status = svc()["status"]
    assert status["url"] == f"http://{name}.{namespace}.svc:8000/v1"
    assert status["roles"]["prefill"]["summary"] == "1/1"
    # The fleet secret exists and every role has its NetworkPolicy; the request
    # below crosses them (gateway -> engines).
    assert kube.CoreV1Api().read_namespaced_secret(f"{name}-fleet", namespace).data
    policies = kube.NetworkingV1Api().list_namespaced_network_policy(
        namespace, label_selector=f"pdfleet.dev/service={name}"
    )
    assert len(policies.items) == 3

    port = port_forward(name, 8000)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
    completion = client.completions.create(model="tiny", prompt="Hello, world", max_tokens=8)
    assert completion.choices[0].text
    assert completion.usage.completion_tokens >= 1

    custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, name, {"spec": {"decode": {"replicas": 2}}}
    )
    wait_for(
        lambda: (
            (svc().get("status") or {}).get("roles", {}).get("decode", {}).get("readyReplicas") == 2
        ),
        timeout=600,
        what="2 ready decode pods",
    )

    custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    selector = f"pdfleet.dev/service={name}"
    wait_for(
        lambda: not apps.list_namespaced_deployment(namespace, label_selector=selector).items,
        timeout=300,
        what="children garbage-collected",
    )
