"""Tensor parallelism and multi-node replicas in the rendered manifests and the checks."""

from __future__ import annotations

import contextlib
import io
import json
from types import SimpleNamespace

import pytest
import yaml
from helpers.crd_checks import admit
from helpers.kube_schema import validate
from helpers.lws_schema import validate_lws

from pdfleet.engine.cli import build_parser, main
from pdfleet.engine.gateway.discovery import GROUP_ROLE_LABEL, pod_endpoint
from pdfleet.operator.compat import check_service
from pdfleet.operator.manifests import LABEL_ROLE, build_children, ucx_port_range
from pdfleet.operator.manifests.pods import engine_threads_env
from pdfleet.operator.parallelism import (
    BUILTIN_HEADS,
    LABEL_GROUP_ROLE,
    RENDEZVOUS_PORT,
    ModelHeads,
    heads_problem,
)
from pdfleet.operator.reconcile import InvalidSpec, checked_spec
from pdfleet.operator.resource import parse_spec
from pdfleet.operator.scrape import scrape_pods

BASE = {"model": {"name": "m"}, "kvTransfer": {"connector": "NixlConnector"}}
# The layout of examples/inferenceservice-tp.yaml: prefill TP1 feeding decode TP4.
TP_SPEC = {
    **BASE,
    "prefill": {"engine": {"tensorParallelSize": 1}},
    "decode": {
        "engine": {"tensorParallelSize": 4},
        "resources": {"limits": {"cpu": "16"}, "requests": {"cpu": "8"}},
        "env": [{"name": "NCCL_DEBUG", "value": "INFO"}],
    },
}
# Decode TP4 over two pods per engine, three engines.
MULTI_NODE = {
    **BASE,
    "decode": {"replicas": 3, "nodesPerReplica": 2, "engine": {"tensorParallelSize": 4}},
}


def objects_of(spec, name="demo"):
    return {
        (o["kind"], o["metadata"]["name"]): o
        for o in build_children(name, parse_spec(spec), namespace="ns1")
    }


def fields(spec, **kwargs):
    return {v.field: v for v in check_service(parse_spec(spec), **kwargs)}


def engine_container(pod_spec):
    return pod_spec["containers"][0]


def env_of(container):
    return {e["name"]: e.get("value") for e in container["env"]}


def test_each_role_requests_its_own_tp_size_in_gpus_and_shm_with_nccl_defaults():
    objects = objects_of(TP_SPEC)
    decode_pod = objects["Deployment", "demo-decode"]["spec"]["template"]["spec"]
    decode = engine_container(decode_pod)
    command = decode["command"]
    assert command[command.index("--tensor-parallel-size") + 1] == "4"
    # Extended resources: the same count in requests and limits.
    assert decode["resources"] == {
        "limits": {"cpu": "16", "nvidia.com/gpu": 4},
        "requests": {"cpu": "8", "nvidia.com/gpu": 4},
    }
    shm = next(v for v in decode_pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    # The role's env replaces a default of the same name (exactly once).
    assert [e["name"] for e in decode["env"]].count("NCCL_DEBUG") == 1
    assert env_of(decode)["NCCL_DEBUG"] == "INFO"
    # Prefill at TP1 asks for nothing it did not ask for before.
    prefill_pod = objects["Deployment", "demo-prefill"]["spec"]["template"]["spec"]
    prefill = engine_container(prefill_pod)
    assert "--tensor-parallel-size" not in prefill["command"]
    assert "resources" not in prefill and "NCCL_DEBUG" not in env_of(prefill)
    assert (
        next(v for v in prefill_pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]
        == "1Gi"
    )
    for obj in objects.values():
        validate(obj)


def test_cpu_engines_get_no_gpus_and_an_explicit_shm_size_wins():
    spec = {
        **BASE,
        "engine": {"device": "cpu", "tensorParallelSize": 2},
        "decode": {"shmSize": "3Gi"},
    }
    pod = objects_of(spec)["Deployment", "demo-decode"]["spec"]["template"]["spec"]
    assert "resources" not in engine_container(pod)
    assert next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "3Gi"
    assert env_of(engine_container(pod))["NCCL_DEBUG"] == "WARN"


def test_an_engine_with_a_cpu_limit_gets_omp_threads_within_it_and_a_core_to_spare():
    spec = {
        **BASE,
        "engine": {"device": "cpu"},
        "prefill": {"resources": {"limits": {"cpu": "4"}}},
        "decode": {
            "resources": {"limits": {"cpu": "2500m"}},
            "env": [{"name": "OMP_NUM_THREADS", "value": "7"}],
        },
    }
    objects = objects_of(spec)

    def env(role):
        pod = objects["Deployment", f"demo-{role}"]["spec"]["template"]["spec"]
        return engine_container(pod)["env"]

    assert [e for e in env("prefill") if e["name"] == "OMP_NUM_THREADS"] == [
        {"name": "OMP_NUM_THREADS", "value": "3"}
    ]
    # The role's own setting wins, once.
    assert [e for e in env("decode") if e["name"] == "OMP_NUM_THREADS"] == [
        {"name": "OMP_NUM_THREADS", "value": "7"}
    ]
    # Without a limit torch's default stands.
    pod = objects_of(BASE)["Deployment", "demo-decode"]["spec"]["template"]["spec"]
    assert "OMP_NUM_THREADS" not in env_of(engine_container(pod))
    # A pod of several ranks shares its cores: 16 CPUs less one over TP 4.
    objects = objects_of(TP_SPEC)
    assert (
        dict(
            env_of(
                engine_container(objects["Deployment", "demo-decode"]["spec"]["template"]["spec"])
            )
        )["OMP_NUM_THREADS"]
        == "3"
    )
    assert engine_threads_env({"cpu": "500m"}, 1, []) == [{"name": "OMP_NUM_THREADS", "value": "1"}]
    assert engine_threads_env({"cpu": "lots"}, 1, []) == []


def test_another_accelerator_resource_is_requested_by_its_name():
    spec = {
        **BASE,
        "decode": {"engine": {"tensorParallelSize": 2}, "acceleratorResource": "amd.com/gpu"},
    }
    c = engine_container(objects_of(spec)["Deployment", "demo-decode"]["spec"]["template"]["spec"])
    assert c["resources"] == {"limits": {"amd.com/gpu": 2}}


def test_a_gpu_count_that_contradicts_the_tp_size_is_refused_naming_the_field():
    spec = {
        **BASE,
        "decode": {
            "engine": {"tensorParallelSize": 4},
            "resources": {"limits": {"nvidia.com/gpu": 2}},
        },
    }
    found = fields(spec)
    violation = found["spec.decode.resources.limits.nvidia.com/gpu"]
    assert "4" in violation.fix and "tensorParallelSize" in violation.fix
    ok = {
        **BASE,
        "decode": {
            "engine": {"tensorParallelSize": 4},
            "resources": {"limits": {"nvidia.com/gpu": 4}},
        },
    }
    assert fields(ok) == {}


def test_zmq_connector_with_tp_over_one_is_refused_naming_the_connector():
    # A rule of the resource model (and the CRD's): refused before any check runs.
    spec = {**TP_SPEC, "kvTransfer": {"connector": "ZmqConnector"}}
    with pytest.raises(ValueError, match=r"spec\.kvTransfer\.connector: .*4 KV shards.*NixlConn"):
        parse_spec(spec)
    # Unequal TP sizes over NIXL, in either direction, are fine.
    assert fields(TP_SPEC) == {}
    flipped = {**BASE, "prefill": {"engine": {"tensorParallelSize": 2}}}
    assert fields(flipped) == {}


@pytest.mark.parametrize(
    ("heads", "tp", "ok"),
    [
        ((32, 8), 4, True),  # KV heads split 2 per rank
        ((32, 8), 16, True),  # KV heads replicated (2 ranks share one)
        ((32, 8), 3, False),  # attention heads do not split
        ((12, 4), 8, False),  # 12 attention heads do not split over 8 ranks
        ((24, 8), 12, False),  # 12 ranks neither divide 8 KV heads nor are a multiple of them
        ((32, 8, 14336), 8, True),  # Llama-3.1-8B at TP8
        ((32, 8, 1000), 16, False),  # the MLP does not split
    ],
)
def test_tp_must_split_heads_kv_heads_and_the_mlp(heads, tp, ok):
    num_heads, num_kv_heads, *intermediate = heads
    problem = heads_problem(tp, ModelHeads(num_heads, num_kv_heads, "m", *intermediate))
    assert (problem is None) == ok, problem


def test_tp_that_does_not_divide_a_builtin_models_heads_is_refused_naming_the_field():
    found = fields({**BASE, "decode": {"engine": {"tensorParallelSize": 3}}})
    violation = found["spec.decode.engine.tensorParallelSize"]
    assert "4 attention heads of the built-in model tiny" in violation.problem
    assert violation.fix == "use one of 1, 2, 4"
    # Set in spec.engine: reported once, where it is set.
    found = fields({**BASE, "engine": {"tensorParallelSize": 8}})
    assert list(found) == ["spec.engine.tensorParallelSize"]


def test_builtin_model_shapes_are_the_engines():
    from pdfleet.engine.tiny.builder import TinyModelSpec

    tiny = TinyModelSpec()
    assert BUILTIN_HEADS["tiny"] == (
        tiny.num_attention_heads,
        tiny.num_key_value_heads,
        tiny.intermediate_size,
    )


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_pdfleet_render_checks_tp_against_a_local_model_config(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 768,
                "intermediate_size": 3072,
                "num_attention_heads": 12,
                "num_key_value_heads": 4,
            }
        )
    )
    doc = {
        "apiVersion": "pdfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "demo"},
        "spec": {**BASE, "model": {"name": "m", "uri": f"file://{model}"}},
    }
    path = tmp_path / "svc.yaml"
    doc["spec"]["decode"] = {"engine": {"tensorParallelSize": 8}}
    path.write_text(yaml.safe_dump(doc))
    code, out, err = run_cli("render", str(path))
    assert code == 2 and out == ""
    assert "spec.decode.engine.tensorParallelSize" in err and "config.json" in err
    assert "use one of 1, 2, 4, 12" in err
    doc["spec"]["decode"] = {"engine": {"tensorParallelSize": 4}}
    path.write_text(yaml.safe_dump(doc))
    assert run_cli("render", str(path))[0] == 0


def test_multi_node_role_renders_a_valid_leader_worker_set_instead_of_a_deployment():
    objects = objects_of(MULTI_NODE)
    assert ("Deployment", "demo-decode") not in objects
    assert ("Deployment", "demo-prefill") in objects
    lws = objects["LeaderWorkerSet", "demo-decode"]
    validate_lws(lws)
    spec = lws["spec"]
    assert spec["replicas"] == 3  # groups, one engine each
    group = spec["leaderWorkerTemplate"]
    assert group["size"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    assert leader["metadata"]["labels"][LABEL_GROUP_ROLE] == "leader"
    assert worker["metadata"]["labels"][LABEL_GROUP_ROLE] == "worker"
    for template in (leader, worker):
        c = engine_container(template["spec"])
        assert c["resources"] == {"limits": {"nvidia.com/gpu": 2}}  # 4 ranks over 2 pods
        assert env_of(c)["NCCL_SOCKET_IFNAME"] == "eth0"
        # Both pods join the rendezvous at the address the LWS controller injects
        # (the kubelet expands $(VAR)); the engine's own parser takes the flags.
        command = c["command"]
        assert command[command.index("--master-addr") + 1] == "$(LWS_LEADER_ADDRESS)"
        expanded = [
            {"$(LWS_LEADER_ADDRESS)": "leader.demo", "$(LWS_WORKER_INDEX)": "1"}.get(x, x)
            for x in command[1:]
        ]
        args = build_parser().parse_args(expanded)
        assert (args.nnodes, args.master_addr, args.master_port) == (
            2,
            "leader.demo",
            RENDEZVOUS_PORT,
        )
    leader_c, worker_c = engine_container(leader["spec"]), engine_container(worker["spec"])
    assert leader_c["command"][leader_c["command"].index("--node-rank") + 1] == "0"
    assert "--headless" not in leader_c["command"]
    assert (
        worker_c["command"][worker_c["command"].index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
    )
    assert "--headless" in worker_c["command"]
    # Only the leader serves HTTP; a worker has no API port and no probes.
    assert "readinessProbe" in leader_c and "http" in {p["name"] for p in leader_c["ports"]}
    assert "readinessProbe" not in worker_c and "http" not in {p["name"] for p in worker_c["ports"]}
    assert {p["name"] for p in worker_c["ports"]} == {"kv"}  # workers hold KV shards too


def test_multi_node_service_publishes_unready_pods_and_same_role_pods_may_talk():
    objects = objects_of(MULTI_NODE)
    # The LWS controller adopts NAME-ROLE as the group's subdomain: workers must
    # resolve the leader before it is ready (it is ready once they joined).
    assert objects["Service", "demo-decode"]["spec"]["publishNotReadyAddresses"] is True
    assert "publishNotReadyAddresses" not in objects["Service", "demo-prefill"]["spec"]
    decode_policy = objects["NetworkPolicy", "demo-decode"]["spec"]["ingress"]
    same_role = {
        "podSelector": {"matchLabels": {"pdfleet.dev/service": "demo", LABEL_ROLE: "decode"}}
    }
    assert {"from": [same_role]} in decode_policy
    prefill_policy = objects["NetworkPolicy", "demo-prefill"]["spec"]["ingress"]
    assert all(rule.get("ports") for rule in prefill_policy)  # single-node: ports only
    config = objects["ConfigMap", "demo-config"]["data"]
    decode = json.loads(config["decode.json"])
    assert "--headless" in decode["workerCommand"] and "--headless" not in decode["command"]
    for obj in objects.values():
        if obj["kind"] != "LeaderWorkerSet":
            validate(obj)


def test_nodes_per_replica_must_divide_the_tp_size_in_python_and_at_admission():
    spec = {**BASE, "decode": {"nodesPerReplica": 3, "engine": {"tensorParallelSize": 4}}}
    assert "spec.decode.nodesPerReplica" in fields(spec)
    obj = {
        "apiVersion": "pdfleet.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "d"},
        "spec": spec,
    }
    _, errors = admit(obj)
    assert any("decode.nodesPerReplica must divide" in e for e in errors), errors
    obj["spec"] = {**BASE, "engine": {"tensorParallelSize": 4}, "decode": {"nodesPerReplica": 2}}
    assert admit(obj)[1] == []
    assert fields(obj["spec"]) == {}


def test_multi_node_names_leave_room_for_the_worker_sets_and_need_lws_enabled():
    long_name = "a" * 44
    with pytest.raises(InvalidSpec, match=r"metadata\.name: .* too long for multi-node"):
        checked_spec(long_name, MULTI_NODE)
    assert checked_spec(long_name, BASE)  # single-node roles: the usual 45 characters
    with pytest.raises(
        InvalidSpec, match=r"spec\.decode\.nodesPerReplica: .*leaderWorkerSet\.enabled"
    ):
        checked_spec("demo", MULTI_NODE, leader_worker_set=False)
    assert checked_spec("demo", MULTI_NODE).decode.nodes_per_replica == 2


def pod(labels):
    return SimpleNamespace(
        metadata=SimpleNamespace(name="p", labels=labels, annotations={}, deletion_timestamp=None),
        status=SimpleNamespace(phase="Running", pod_ip="10.0.0.9"),
    )


def test_gateway_routes_to_group_leaders_only():
    assert GROUP_ROLE_LABEL == LABEL_GROUP_ROLE
    leader = pod({LABEL_ROLE: "decode", LABEL_GROUP_ROLE: "leader"})
    worker = pod({LABEL_ROLE: "decode", LABEL_GROUP_ROLE: "worker"})
    assert pod_endpoint(leader, 8000).url == "http://10.0.0.9:8000"
    assert pod_endpoint(worker, 8000) is None


def test_the_operator_scrapes_leaders_but_not_workers():
    import asyncio

    def k8s_pod(name, group_role):
        labels = {LABEL_ROLE: "decode", LABEL_GROUP_ROLE: group_role}
        return {"metadata": {"name": name, "labels": labels}, "spec": {}, "status": {}}

    pods = [k8s_pod("demo-decode-0", "leader"), k8s_pod("demo-decode-0-1", "worker")]
    samples = asyncio.run(scrape_pods(pods, timeout_seconds=1))
    assert [s.pod for s in samples] == ["demo-decode-0"]


def test_a_fleet_secret_rotation_finds_stale_leader_worker_set_templates():
    from pdfleet.operator.handlers import _stale_templates

    def lws(version):
        build = build_children(
            "demo", parse_spec(MULTI_NODE), namespace="ns1", secret_version=version
        )
        return next(o for o in build if o["kind"] == "LeaderWorkerSet")

    assert _stale_templates({"decode": lws("v1"), "prefill": None}, "v1") == []
    assert _stale_templates({"decode": lws("v1")}, "v2") == ["decode"]


# P/D with both roles spanning pods: prefill TP2 over two pods, decode TP4 over two.
MULTI_NODE_PD = {
    **MULTI_NODE,
    "prefill": {"replicas": 1, "nodesPerReplica": 2, "engine": {"tensorParallelSize": 2}},
}


def test_every_pod_of_a_multi_node_pd_group_gets_its_own_kv_address_ucx_ports_and_connector():
    objects = objects_of(MULTI_NODE_PD)
    kv_port = parse_spec(MULTI_NODE_PD).kv_transfer.port
    first, last = ucx_port_range(parse_spec(MULTI_NODE_PD))
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        group = objects["LeaderWorkerSet", f"demo-{role}"]["spec"]["leaderWorkerTemplate"]
        for template in (group["leaderTemplate"], group["workerTemplate"]):
            c = engine_container(template["spec"])
            env = {e["name"]: e for e in c["env"]}
            # Each pod's ranks bind their NIXL agents on that pod's own IP.
            assert env["PDFLEET_KV_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
            assert env["UCX_TCP_PORT_RANGE"]["value"] == f"{first}-{last}"
            assert {p["name"]: p["containerPort"] for p in c["ports"]}["kv"] == kv_port
            expanded = [
                {"$(LWS_LEADER_ADDRESS)": "leader.demo", "$(LWS_WORKER_INDEX)": "1"}.get(x, x)
                for x in c["command"][1:]
            ]
            kv = json.loads(expanded[expanded.index("--kv-transfer-config") + 1])
            assert (kv["kv_connector"], kv["kv_role"]) == ("NixlConnector", kv_role)
            assert kv["kv_ip"] == "$(PDFLEET_KV_IP)"
        validate_lws(objects["LeaderWorkerSet", f"demo-{role}"])
    # Every pod of one role (leaders and workers: the selector has no group role)
    # may reach the other role's side channel and UCX ports.
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        ingress = objects["NetworkPolicy", f"demo-{role}"]["spec"]["ingress"]
        peers = {"pdfleet.dev/service": "demo", LABEL_ROLE: other}
        kv_rule = next(r for r in ingress if r["from"] == [{"podSelector": {"matchLabels": peers}}])
        assert {"port": kv_port, "protocol": "TCP"} in kv_rule["ports"]
        assert {"port": first, "endPort": last, "protocol": "TCP"} in kv_rule["ports"]
        validate(objects["NetworkPolicy", f"demo-{role}"])
    assert fields(MULTI_NODE_PD) == {}


def test_zmq_connector_with_nodes_per_replica_over_one_is_refused_naming_the_connector():
    spec = {**MULTI_NODE_PD, "kvTransfer": {"connector": "ZmqConnector"}}
    with pytest.raises(ValueError, match=r"spec\.kvTransfer\.connector: ") as e:
        parse_spec(spec)
    assert "nodesPerReplica)" in str(e.value) and "NixlConnector" in str(e.value)
    assert "nodesPerReplica 1" in str(e.value)
