"""The kopf handlers, running for real against an in-memory API server (kmock)."""

from __future__ import annotations

import asyncio
from typing import Any

import kopf
from aiohttp import web
from helpers.kube_fake import (
    DEPLOYMENTS,
    EVENTS,
    IS_RESOURCE,
    NAMESPACE,
    SECRETS,
    inference_service,
    run,
    running_operator,
)
from prometheus_client import generate_latest

from pdfleet.engine.contracts import security
from pdfleet.operator.cluster_autoscaler import PolicyDecider, ScaleDecision
from pdfleet.operator.fleet_secret import secret_value, secret_version
from pdfleet.operator.handlers import OperatorConfig
from pdfleet.operator.manifests import (
    ANNOTATION_FLEET_SECRET,
    GRACE_MARGIN_SECONDS,
    LABEL_COMPAT,
)

SPEC: dict[str, Any] = {
    "model": {"name": "tiny"},
    "engine": {"device": "cpu", "blockSize": 16},
    "kvTransfer": {"connector": "ZmqConnector"},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
}
CHILD_DEPLOYMENTS = {"demo-prefill", "demo-decode", "demo-gateway"}


def fast_config(**kwargs: Any) -> OperatorConfig:
    # A 1 s timer: faster ticks crowd the handlers out of a loaded machine.
    return OperatorConfig(timer_interval_seconds=1.0, rollout_poll_seconds=0.3, **kwargs)


def condition(obj: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    for c in ((obj or {}).get("status") or {}).get("conditions") or []:
        if c["type"] == type_:
            return c
    return None


def test_create_makes_every_child_owned_by_the_service_and_writes_status():
    async def scenario():
        async with running_operator([inference_service("demo", SPEC)], fast_config()) as k:
            await k.wait_for(lambda: k.names(DEPLOYMENTS) >= CHILD_DEPLOYMENTS, what="deployments")
            svc = await k.wait_for(
                lambda: (
                    (k.get(IS_RESOURCE, "demo") or {}).get("status", {}).get("observedGeneration")
                    and k.get(IS_RESOURCE, "demo")
                ),
                what="status",
            )
            assert k.names("v1/services") == {"demo", "demo-prefill", "demo-decode"}
            assert k.names("v1/configmaps") == {"demo-config", "demo-identity"}
            assert k.names("v1/serviceaccounts") == {"demo-gateway", "demo-engine"}
            assert k.names("policy/v1/poddisruptionbudgets") == {
                "demo-prefill",
                "demo-decode",
                "demo-gateway",
            }
            for name in CHILD_DEPLOYMENTS:
                owner = k.get(DEPLOYMENTS, name)["metadata"]["ownerReferences"][0]
                assert (owner["kind"], owner["uid"], owner["controller"]) == (
                    "InferenceService",
                    "uid-1",
                    True,
                )
            status = svc["status"]
            assert status["url"] == f"http://demo.{NAMESPACE}.svc:8000/v1"
            assert status["roles"]["decode"]["desiredReplicas"] == 1
            assert condition(svc, "Ready")["status"] == "False"  # no pods in a fake cluster

    run(scenario())


def test_update_patches_the_children_in_place():
    async def scenario():
        async with running_operator([inference_service("demo", SPEC)], fast_config()) as k:
            await k.wait_for(lambda: k.names(DEPLOYMENTS) >= CHILD_DEPLOYMENTS, what="deployments")
            decode = {"replicas": 3, "engine": {"maxNumSeqs": 64}}
            await k.patch(IS_RESOURCE, "demo", {"spec": {"decode": decode}})
            deployment = await k.wait_for(
                lambda: (
                    (k.get(DEPLOYMENTS, "demo-decode") or {})["spec"]["replicas"] == 3
                    and k.get(DEPLOYMENTS, "demo-decode")
                ),
                what="decode replicas 3",
            )
            command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
            assert command[command.index("--max-num-seqs") + 1] == "64"
            assert k.names(DEPLOYMENTS) == CHILD_DEPLOYMENTS

    run(scenario())


def test_compat_change_rolls_decode_before_prefill():
    async def scenario():
        async with running_operator([inference_service("demo", SPEC)], fast_config()) as k:
            await k.wait_for(lambda: k.names(DEPLOYMENTS) >= CHILD_DEPLOYMENTS, what="deployments")

            def compat(role: str) -> str:
                return k.get(DEPLOYMENTS, f"demo-{role}")["metadata"]["labels"][LABEL_COMPAT]

            old = compat("prefill")
            await k.patch(IS_RESOURCE, "demo", {"spec": {"engine": {"blockSize": 32}}})
            await k.wait_for(lambda: compat("decode") != old, what="decode updated")
            # Decode has not rolled out (no controller runs here): prefill must wait.
            await asyncio.sleep(1.0)
            assert compat("prefill") == old
            rolled = {"observedGeneration": 2, "replicas": 1, "updatedReplicas": 1}
            await k.patch(DEPLOYMENTS, "demo-decode", {"status": {**rolled, "readyReplicas": 1}})
            await k.wait_for(lambda: compat("prefill") == compat("decode"), what="prefill")

    run(scenario())


def test_an_engine_upgrade_rolls_decode_first_surging_with_a_grace_that_covers_the_drain():
    """A decode pod of the old spec leaves by SIGTERM once its replacement is
    ready (surge 1, none unavailable): the engine hands its streams to the
    gateway after --shutdown-timeout, within the pod's grace period; prefill
    rolls only after decode."""
    spec = {**SPEC, "gateway": {"maxMigrations": 2}}

    async def scenario():
        async with running_operator([inference_service("demo", spec)], fast_config()) as k:
            await k.wait_for(lambda: k.names(DEPLOYMENTS) >= CHILD_DEPLOYMENTS, what="deployments")

            def compat(role: str) -> str:
                return k.get(DEPLOYMENTS, f"demo-{role}")["metadata"]["labels"][LABEL_COMPAT]

            def pod(role: str) -> dict[str, Any]:
                return k.get(DEPLOYMENTS, f"demo-{role}")["spec"]["template"]["spec"]

            gateway = pod("gateway")["containers"][0]["command"]
            assert gateway[gateway.index("--max-migrations") + 1] == "2"
            old = compat("prefill")
            engine = {"blockSize": 32, "shutdownTimeout": 20}
            await k.patch(IS_RESOURCE, "demo", {"spec": {"engine": engine}})
            await k.wait_for(lambda: compat("decode") != old, what="decode updated")
            decode = k.get(DEPLOYMENTS, "demo-decode")["spec"]
            assert decode["strategy"] == {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
            }
            command = pod("decode")["containers"][0]["command"]
            assert command[command.index("--shutdown-timeout") + 1] == "20"
            assert pod("decode")["terminationGracePeriodSeconds"] == 20 + GRACE_MARGIN_SECONDS
            await asyncio.sleep(1.0)  # a few reconciles: prefill waits for decode
            assert compat("prefill") == old
            rolled = {"observedGeneration": 2, "replicas": 1, "updatedReplicas": 1}
            await k.patch(DEPLOYMENTS, "demo-decode", {"status": {**rolled, "readyReplicas": 1}})
            await k.wait_for(lambda: compat("prefill") == compat("decode"), what="prefill")
            # A prefill engine also waits out the KV lease for the decode engines' pulls.
            assert pod("prefill")["terminationGracePeriodSeconds"] >= 20 + GRACE_MARGIN_SECONDS

    run(scenario())


def test_invalid_spec_sets_ready_false_with_the_fix_and_creates_nothing():
    overrides = {"engine": {"hfOverrides": {"num_hidden_layers": 1}}}
    spec = {**SPEC, "kvTransfer": {}, "decode": overrides}

    async def scenario():
        async with running_operator([inference_service("demo", spec)], fast_config()) as k:
            svc = await k.wait_for(
                lambda: (
                    condition(k.get(IS_RESOURCE, "demo"), "Ready") and k.get(IS_RESOURCE, "demo")
                ),
                what="Ready condition",
            )
            ready = condition(svc, "Ready")
            assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
            assert "spec.kvTransfer.connector" in ready["message"]
            assert "spec.decode.engine.hfOverrides" in ready["message"]
            assert svc["status"]["phase"] == "Failed"
            events = await k.wait_for(
                lambda: [
                    e
                    for e in (k.get(EVENTS, n) for n in k.names(EVENTS))
                    if e and e.get("reason") == "InvalidSpec"
                ],
                what="InvalidSpec events",
            )
            assert any("set kvTransfer.connector" in e["message"] for e in events)
            await asyncio.sleep(0.8)  # a few timer ticks
            assert not k.names(DEPLOYMENTS)
            assert not k.names("v1/services")

    run(scenario())


def engine_pod(name: str, role: str, port: int) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": {"pdfleet.dev/service": "demo", "pdfleet.dev/role": role},
        },
        "spec": {
            "containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]
        },
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def test_timer_scrapes_engine_pods_and_patches_replicas_from_the_policy_decision():
    spec = {**SPEC, "autoscaling": {"periodSeconds": 0.1, "decode": {"maxReplicas": 5}}}
    seen: list[Any] = []
    failures = {"count": 0}

    def decide(service, policy, samples, replicas, now):
        seen.append((service, list(samples), dict(replicas)))
        if replicas["decode"] == 1:
            return [ScaleDecision("decode", 3, "kv usage 0.9 > target 0.7")]
        return []

    tokens: list[str | None] = []
    clusters: list[Any] = []

    async def metrics(request: web.Request) -> web.Response:
        # Engines answer /metrics only to the fleet token (docs/security.md).
        tokens.append(security.bearer_token(request.headers.get("Authorization")))
        secret = secret_value(clusters[0].get(SECRETS, "demo-fleet"))
        if not security.key_matches(tokens[-1], [security.fleet_token(secret)]):
            return web.json_response({"error": {"code": 401}}, status=401)
        failures["count"] += 1  # a failure counter that keeps rising, no pull succeeds
        text = (
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            'vllm:kv_cache_usage_perc{model_name="tiny"} 0.9\n'
            "# TYPE pdfleet_engine_kv_transfer_failures counter\n"
            f"pdfleet_engine_kv_transfer_failures_total {failures['count']}\n"
            "# TYPE pdfleet_engine_kv_transfers counter\n"
            "pdfleet_engine_kv_transfers_total 0\n"
        )
        return web.Response(text=text)

    async def scenario():
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        pods = [
            engine_pod("demo-decode-a", "decode", port),
            engine_pod("demo-prefill-a", "prefill", port),
            engine_pod("demo-gateway-a", "gateway", port),  # scraped for its KV breakers
        ]
        try:
            objects = [inference_service("demo", spec), *pods]
            async with running_operator(objects, fast_config(decide=decide)) as k:
                clusters.append(k)
                await k.wait_for(
                    lambda: (
                        (k.get(DEPLOYMENTS, "demo-decode") or {}).get("spec", {}).get("replicas")
                        == 3
                    ),
                    what="decode scaled to 3",
                )
                svc = await k.wait_for(
                    lambda: (
                        (k.get(IS_RESOURCE, "demo") or {}).get("status", {}).get("autoscaling")
                        and k.get(IS_RESOURCE, "demo")
                    ),
                    what="decision recorded",
                )
                record = svc["status"]["autoscaling"]["lastDecisions"][-1]
                assert (record["role"], record["from"], record["to"]) == ("decode", 1, 3)
                assert "kv usage" in record["reason"]
                kv = await k.wait_for(
                    lambda: (
                        (condition(k.get(IS_RESOURCE, "demo"), "KVTransferHealthy") or {}).get(
                            "status"
                        )
                        == "False"
                        and condition(k.get(IS_RESOURCE, "demo"), "KVTransferHealthy")
                    ),
                    what="KVTransferHealthy=False",
                )
                assert kv["reason"] == "KVTransferDegraded"
                assert "KV pulls failed" in kv["message"] and "demo-decode-a" in kv["message"]
                await k.wait_for(
                    lambda: (
                        k.get(IS_RESOURCE, "demo")["status"]["roles"]["decode"]["desiredReplicas"]
                        == 3
                    ),
                    what="desired replicas in status",
                )
        finally:
            await runner.cleanup()
        assert tokens and all(t is not None for t in tokens)
        service, samples, replicas = seen[0]
        assert service == f"{NAMESPACE}/demo"
        assert replicas == {"prefill": 1, "decode": 1}
        by_pod = {s.pod: s for s in samples}
        # The policy sees the engines, and the gateways for their activation counters.
        assert set(by_pod) == {"demo-decode-a", "demo-prefill-a", "demo-gateway-a"}
        assert by_pod["demo-decode-a"].role == "decode"
        assert by_pod["demo-decode-a"].values["vllm:kv_cache_usage_perc"] == 0.9

    run(scenario())


def test_advisory_mode_reports_the_policys_decisions_and_patches_no_replicas(monkeypatch):
    # The real policy on a decode engine whose KV is full and queue long: it
    # decides to scale decode up, and in mode Advisory says so in the status,
    # an event and the metrics, and leaves the Deployment's replicas alone.
    spec = {
        **SPEC,
        "autoscaling": {"mode": "Advisory", "periodSeconds": 0.5, "decode": {"maxReplicas": 5}},
    }
    clusters: list[Any] = []
    # kmock keeps one event of a kind per object (kopf's event names repeat),
    # so the events are read where the operator posts them.
    events: list[tuple[str, str]] = []
    post = kopf.info

    def info(body: Any, *, reason: str, message: str) -> None:
        events.append((reason, message))
        post(body, reason=reason, message=message)

    monkeypatch.setattr(kopf, "info", info)

    async def metrics(request: web.Request) -> web.Response:
        secret = secret_value(clusters[0].get(SECRETS, "demo-fleet"))
        token = security.bearer_token(request.headers.get("Authorization"))
        if not security.key_matches(token, [security.fleet_token(secret)]):
            return web.json_response({"error": {"code": 401}}, status=401)
        text = (
            "pdfleet_engine_kv_cache_usage_ratio 0.95\n"
            "pdfleet_engine_num_requests_running 30\n"
            "pdfleet_engine_num_requests_waiting 6\n"
            "pdfleet_engine_waiting_prompt_tokens 0\n"
        )
        return web.Response(text=text)

    async def scenario():
        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        pods = [engine_pod("demo-decode-a", "decode", port)]
        decider = PolicyDecider()
        try:
            objects = [inference_service("demo", spec), *pods]
            async with running_operator(objects, fast_config(decide=decider)) as k:
                clusters.append(k)
                svc = await k.wait_for(
                    lambda: (
                        ((k.get(IS_RESOURCE, "demo") or {}).get("status") or {})
                        .get("autoscaling", {})
                        .get("lastDecisions")
                        and k.get(IS_RESOURCE, "demo")
                    ),
                    what="an advised decision in the status",
                )
                status = svc["status"]["autoscaling"]
                record = status["lastDecisions"][-1]
                assert status["mode"] == "Advisory"
                assert (record["role"], record["from"], record["applied"]) == ("decode", 1, False)
                assert record["to"] > 1 and "KV" in record["reason"]
                advised = await k.wait_for(
                    lambda: [m for r, m in events if r == "ScaleAdvised"],
                    what="a ScaleAdvised event",
                )
                assert advised[0].startswith("decode 1 -> ")
                assert "(advisory, not applied)" in advised[0]
                assert not [r for r, _ in events if r == "Scaled"]
                exported = generate_latest(k.state.metrics).decode()
                assert (
                    'pdfleet_autoscaler_desired_replicas{mode="Advisory",role="decode"}' in exported
                )

                def advisory_decisions() -> float:
                    return sum(
                        sample.value
                        for metric in k.state.metrics.collect()
                        for sample in metric.samples
                        if sample.name == "pdfleet_autoscaler_decisions_total"
                        and sample.labels.get("mode") == "Advisory"
                    )

                # Several more periods decided (each counted): still nothing applied.
                seen = advisory_decisions()
                await k.wait_for(
                    lambda: advisory_decisions() >= seen + 4, what="more advisory decisions"
                )
                assert k.get(DEPLOYMENTS, "demo-decode")["spec"]["replicas"] == 1
                assert k.state.scale_changes.labels("decode")._value.get() == 0
        finally:
            await runner.cleanup()

    run(scenario())


def test_operator_creates_one_random_owned_fleet_secret_and_pods_mount_its_version():
    async def scenario():
        async with running_operator([inference_service("demo", SPEC)], fast_config()) as k:
            await k.wait_for(lambda: k.names(DEPLOYMENTS) >= CHILD_DEPLOYMENTS, what="deployments")
            secret = await k.wait_for(lambda: k.get(SECRETS, "demo-fleet"), what="fleet secret")
            owner = secret["metadata"]["ownerReferences"][0]
            assert (owner["kind"], owner["uid"]) == ("InferenceService", "uid-1")
            value = secret_value(secret)
            assert len(value) >= 32
            version = secret_version(value)
            for name in CHILD_DEPLOYMENTS:
                template = k.get(DEPLOYMENTS, name)["spec"]["template"]
                assert template["metadata"]["annotations"][ANNOTATION_FLEET_SECRET] == version
            assert k.names("networking.k8s.io/v1/networkpolicies") == {
                "demo-prefill",
                "demo-decode",
                "demo-gateway",
            }
            assert k.names("rbac.authorization.k8s.io/v1/rolebindings") == {"demo-gateway"}
            assert not k.names("rbac.authorization.k8s.io/v1/roles")
            # Reconciles and refreshes keep the same secret.
            await k.patch(IS_RESOURCE, "demo", {"spec": {"decode": {"replicas": 2}}})
            await k.wait_for(
                lambda: k.get(DEPLOYMENTS, "demo-decode")["spec"]["replicas"] == 2,
                what="decode replicas 2",
            )
            assert secret_value(k.get(SECRETS, "demo-fleet")) == value

    run(scenario())


def test_deleting_the_fleet_secret_makes_a_new_one_and_rolls_every_pod_onto_it():
    async def scenario():
        async with running_operator([inference_service("demo", SPEC)], fast_config()) as k:
            await k.wait_for(lambda: k.names(DEPLOYMENTS) >= CHILD_DEPLOYMENTS, what="deployments")
            old = secret_value(await k.wait_for(lambda: k.get(SECRETS, "demo-fleet")))
            await k.delete(SECRETS, "demo-fleet")
            new = secret_value(
                await k.wait_for(
                    lambda: (
                        (s := k.get(SECRETS, "demo-fleet")) is not None
                        and secret_value(s) != old
                        and s
                    ),
                    what="a new fleet secret",
                )
            )

            def versions() -> set[str]:
                return {
                    k.get(DEPLOYMENTS, name)["spec"]["template"]["metadata"]["annotations"][
                        ANNOTATION_FLEET_SECRET
                    ]
                    for name in CHILD_DEPLOYMENTS
                }

            await k.wait_for(lambda: versions() == {secret_version(new)}, what="pods rolled")

    run(scenario())


def test_deleting_a_service_forgets_its_state_in_the_operator():
    async def scenario():
        async with running_operator([inference_service("demo", SPEC)], fast_config()) as k:
            await k.wait_for(lambda: "uid-1" in k.state.kv_verdict, what="a refresh")
            await k.delete(IS_RESOURCE, "demo")
            await k.wait_for(
                lambda: "uid-1" not in k.state.kv_verdict and "uid-1" not in k.state.kv_health,
                what="state forgotten",
            )

    run(scenario())
