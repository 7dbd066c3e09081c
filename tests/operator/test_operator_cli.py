"""`pdfleet operator` as a process: logs in from a kubeconfig, reconciles, serves
its liveness and metrics endpoints, and stops on SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

import httpx
import kmock
import yaml
from helpers.kube_fake import DEPLOYMENTS, IS_RESOURCE, NAMESPACE, inference_service, run

SPEC = {"model": {"name": "tiny"}, "kvTransfer": {"connector": "ZmqConnector"}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
            liveness, metrics = free_port(), free_port()
            log = (tmp_path / "operator.log").open("wb")
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "pdfleet.engine.cli", "operator",
                "--namespace", NAMESPACE,
                "--liveness-port", str(liveness), "--metrics-port", str(metrics),
                "--default-image", "reg/pdfleet:test",
                env={**os.environ, "KUBECONFIG": str(kubeconfig)},
                stdout=asyncio.subprocess.DEVNULL,
                stderr=log,
            )  # fmt: skip
            try:
                for _ in range(300):
                    key = (DEPLOYMENTS, NAMESPACE, "demo-decode")
                    try:
                        deployment = api.objects[key]
                        break
                    except KeyError:
                        await asyncio.sleep(0.1)
                else:
                    raise AssertionError(
                        "the operator created no decode Deployment in 30 s:\n"
                        + (tmp_path / "operator.log").read_text()[-3000:]
                    )
                pod = deployment.raw["spec"]["template"]["spec"]
                assert pod["containers"][0]["image"] == "reg/pdfleet:test"
                async with httpx.AsyncClient(timeout=5) as http:
                    health = await http.get(f"http://127.0.0.1:{liveness}/healthz")
                    assert health.status_code == 200
                    text = (await http.get(f"http://127.0.0.1:{metrics}/metrics")).text
                assert 'pdfleet_operator_reconciles_total{result="ok"}' in text
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), timeout=20)
                except TimeoutError:
                    proc.kill()
                    await proc.wait()
                log.close()
            assert proc.returncode == 0, (tmp_path / "operator.log").read_text()[-3000:]

    run(scenario(), timeout=90)
