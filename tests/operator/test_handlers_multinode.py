"""Multi-node roles through the real kopf handlers against kmock: a role with
nodesPerReplica > 1 is a LeaderWorkerSet that status, autoscaling and a change
of layout act on as whole groups."""

from __future__ import annotations

from typing import Any

from helpers.kube_fake import (
    DEPLOYMENTS,
    IS_RESOURCE,
    LEADER_WORKER_SETS,
    inference_service,
    run,
    running_operator,
)

from pdfleet.operator.cluster_autoscaler import ScaleDecision
from pdfleet.operator.handlers import OperatorConfig

SPEC: dict[str, Any] = {
    "model": {"name": "tiny"},
    "engine": {"device": "cpu", "tensorParallelSize": 2},
    "kvTransfer": {"connector": "NixlConnector"},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1, "nodesPerReplica": 2},
    "autoscaling": {"periodSeconds": 0.1, "decode": {"maxReplicas": 5}},
}


def test_a_multi_node_role_is_a_leader_worker_set_scaled_and_reported_by_groups():
    def decide(service, policy, samples, replicas, now):
        if replicas["decode"] == 1:
            return [ScaleDecision("decode", 3, "queue above target", victims=("demo-decode-0",))]
        return []

    def replicas(resource: str, name: str) -> int | None:
        return ((k.get(resource, name) or {}).get("spec") or {}).get("replicas")

    def decode_status() -> dict[str, Any]:
        status = (k.get(IS_RESOURCE, "demo") or {}).get("status") or {}
        return (status.get("roles") or {}).get("decode") or {}

    async def scenario():
        nonlocal k
        config = OperatorConfig(timer_interval_seconds=1.0, rollout_poll_seconds=0.3, decide=decide)
        async with running_operator([inference_service("demo", SPEC)], config) as cluster:
            k = cluster
            await k.wait_for(
                lambda: replicas(LEADER_WORKER_SETS, "demo-decode") == 3, what="3 groups"
            )
            assert k.names(DEPLOYMENTS) == {"demo-gateway", "demo-prefill"}
            lws = k.get(LEADER_WORKER_SETS, "demo-decode")
            assert lws["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
            assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
            # P/D across pods: the workers (headless) hold KV shards and pull over NIXL.
            worker = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]
            command = worker["containers"][0]["command"]
            assert "--headless" in command and "--kv-transfer-config" in command
            assert "PDFLEET_KV_IP" in {e["name"] for e in worker["containers"][0]["env"]}
            record = await k.wait_for(
                lambda: (
                    (k.get(IS_RESOURCE, "demo").get("status") or {}).get("autoscaling") or {}
                ).get("lastDecisions", [None])[-1],
                what="decision recorded",
            )
            assert (record["role"], record["from"], record["to"]) == ("decode", 1, 3)
            # Status counts the LeaderWorkerSet's groups (its controller writes them).
            generation = lws["metadata"].get("generation", 1)
            groups = {"replicas": 3, "readyReplicas": 2, "updatedReplicas": 3}
            await k.patch(
                LEADER_WORKER_SETS,
                "demo-decode",
                {"status": {**groups, "observedGeneration": generation}},
            )
            await k.wait_for(lambda: decode_status().get("summary") == "2/3", what="2/3 groups")
            # Back to one pod per engine: a Deployment takes over, the groups go to zero.
            await k.patch(IS_RESOURCE, "demo", {"spec": {"decode": {"nodesPerReplica": 1}}})
            await k.wait_for(lambda: replicas(DEPLOYMENTS, "demo-decode") == 3, what="deployment")
            await k.wait_for(lambda: replicas(LEADER_WORKER_SETS, "demo-decode") == 0, what="lws 0")

    k: Any = None
    run(scenario())


def test_an_operator_without_leader_worker_sets_refuses_multi_node_roles():
    async def scenario():
        config = OperatorConfig(timer_interval_seconds=1.0, rollout_poll_seconds=0.3)
        config.install = type(config.install)(leader_worker_set=False)
        async with running_operator([inference_service("demo", SPEC)], config) as k:
            svc = await k.wait_for(
                lambda: (
                    ((k.get(IS_RESOURCE, "demo") or {}).get("status") or {}).get("phase")
                    == "Failed"
                    and k.get(IS_RESOURCE, "demo")
                ),
                what="Failed phase",
            )
            ready = next(c for c in svc["status"]["conditions"] if c["type"] == "Ready")
            assert "spec.decode.nodesPerReplica" in ready["message"]
            assert "leaderWorkerSet.enabled=true" in ready["message"]
            assert k.names(LEADER_WORKER_SETS) == set() and k.names(DEPLOYMENTS) == set()

    run(scenario())
