"""`pdfleet operator` as a process: logs in from a kubeconfig, reconciles, serves
its liveness and metrics endpoints, and stops on SIGTERM."""

from __future__ import annotations

import asyncio
import inspect
import os
import pathlib
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import kmock
import yaml
from helpers.kube_fake import DEPLOYMENTS, IS_RESOURCE, NAMESPACE, inference_service, run
from helpers.server import free_port
from prometheus_client.parser import text_string_to_metric_families

from pdfleet.engine.contracts.launch import python_module

SPEC = {"model": {"name": "tiny"}, "kvTransfer": {"connector": "ZmqConnector"}}


def reconciles_ok(text: str) -> float:
    """The value of ``pdfleet_operator_reconciles_total{result="ok"}`` (0 if absent)."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdfleet_operator_reconciles_total" and sample.labels == {
                "result": "ok"
            }:
                return sample.value
    return 0.0


async def eventually(
    probe: Callable[[], Any], timeout: float, what: str, tmp_path: pathlib.Path
) -> Any:
    """Poll ``probe`` (sync or async) until it returns something truthy, bounded."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(
        f"no {what} within {timeout:g} s; operator log:\n"
        + (tmp_path / "operator.log").read_text()[-3000:]
    )


def test_operator_command_reconciles_and_exposes_health_and_metrics(tmp_path):
    async def scenario():
        async with kmock.KubernetesEmulator() as api, kmock.Server(api) as server:
            api.resources.load_bundled()
            api.resources[IS_RESOURCE] = kmock.ResourceInfo(
                kind="InferenceService",
                namespaced=True,
                verbs={"get", "list", "watch", "patch"},
                subresources={"status"},
            )
            api.objects[IS_RESOURCE, NAMESPACE, "demo"] = inference_service("demo", SPEC)
            kubeconfig = tmp_path / "kubeconfig"
            kubeconfig.write_text(
                yaml.safe_dump(
                    {
                        "apiVersion": "v1",
                        "kind": "Config",
                        "clusters": [{"name": "k", "cluster": {"server": str(server.url)}}],
                        "users": [{"name": "u", "user": {"token": "t"}}],
                        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                        "current-context": "c",
                    }
                )
            )
            liveness, metrics, identity = free_port(), free_port(), free_port()
            log = (tmp_path / "operator.log").open("wb")
            proc = await asyncio.create_subprocess_exec(
                *python_module("pdfleet.engine.cli"), "operator",
                "--namespace", NAMESPACE,
                "--liveness-port", str(liveness), "--metrics-port", str(metrics),
                "--identity-port", str(identity),
                "--default-image", "reg/pdfleet:test",
                env={**os.environ, "KUBECONFIG": str(kubeconfig)},
                stdout=asyncio.subprocess.DEVNULL,
                stderr=log,
            )  # fmt: skip
            try:
                key = (DEPLOYMENTS, NAMESPACE, "demo-decode")

                def created() -> Any:
                    try:
                        return api.objects[key]
                    except KeyError:
                        return None

                deployment = await eventually(created, 60, "a decode Deployment", tmp_path)
                pod = deployment.raw["spec"]["template"]["spec"]
                assert pod["containers"][0]["image"] == "reg/pdfleet:test"
                async with httpx.AsyncClient(timeout=5) as http:

                    async def healthy() -> bool:
                        try:
                            r = await http.get(f"http://127.0.0.1:{liveness}/healthz")
                        except httpx.HTTPError:
                            return False
                        return r.status_code == 200

                    async def reconciled_ok() -> float:
                        # The reconcile that created the Deployment counts itself
                        # after its last patch: wait for the counter, not the object.
                        try:
                            text = (await http.get(f"http://127.0.0.1:{metrics}/metrics")).text
                        except httpx.HTTPError:
                            return 0.0
                        return reconciles_ok(text)

                    await eventually(healthy, 30, "a healthy liveness endpoint", tmp_path)
                    assert await eventually(reconciled_ok, 30, "an ok reconcile", tmp_path) >= 1
            finally:
                # The operator exits within a couple of seconds of SIGTERM and kills
                # itself after 20 s (operator/handlers.py); wait on the exit itself.
                proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), timeout=40)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
                log.close()
            assert proc.returncode == 0, (tmp_path / "operator.log").read_text()[-3000:]

    run(scenario(), timeout=90)
