"""The pure builders: every child object is valid Kubernetes and wired as designed."""

from __future__ import annotations

import base64
import contextlib
import io
import json
import pathlib

import pytest
import yaml
from helpers.kube_schema import validate
from helpers.lws_schema import validate_lws

from pdfleet.engine.cli import main
from pdfleet.operator.manifests import (
    ANNOTATION_IDENTITY_ROLE,
    DEFAULT_IMAGE,
    LABEL_COMPAT,
    LABEL_ROLE,
    LABEL_SERVICE,
    OperatorInstall,
    Owner,
    build_children,
    build_fleet_secret,
    build_identity_configmap,
    build_identity_secret,
    desired_replicas,
)
from pdfleet.operator.resource import load_inference_service, parse_spec

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("inferenceservice-*.yaml"))
SPEC = {
    "model": {"name": "m"},
    "engine": {"shutdownTimeout": 90},
    "kvTransfer": {"connector": "NixlConnector", "leaseSeconds": 30},
    "prefill": {"replicas": 2, "shmSize": "2Gi", "resources": {"limits": {"nvidia.com/gpu": 1}}},
    "decode": {"replicas": 3, "env": [{"name": "UCX_TLS", "value": "tcp"}]},
    "gateway": {"apiKeySecret": {"name": "keys"}},
}


def children(spec=SPEC, **kwargs):
    return build_children("demo", parse_spec(spec), namespace="ns1", **kwargs)


def by_kind_name(objects):
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def container(objects, name):
    return by_kind_name(objects)["Deployment", name]["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_child_of_the_examples_is_a_valid_kubernetes_object(path):
    svc = load_inference_service(path)
    owner = Owner(svc.name, "u1")
    objects = build_children(svc.name, svc.spec, namespace="default", owner=owner)
    assert len(objects) == 16
    # What the operator creates besides (random values): the identity Secret and ConfigMap.
    objects += [
        build_identity_secret(svc.name, namespace="default", owner=owner, value="k" * 43),
        build_identity_configmap(
            svc.name,
            namespace="default",
            owner=owner,
            authority="a" * 43,
            ca_pem="-----BEGIN CERTIFICATE-----\n",
            endpoint="https://pdfleet-identity.pdfleet.svc:8443",
        ),
    ]
    for obj in objects:
        validate_lws(obj) if obj["kind"] == "LeaderWorkerSet" else validate(obj)
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "u1"
        assert obj["metadata"]["labels"]["pdfleet.dev/service"] == svc.name


def test_children_come_in_apply_order_with_deployments_last():
    kinds = [(o["kind"], o["metadata"]["name"]) for o in children()]
    assert kinds[-3:] == [
        ("Deployment", "demo-gateway"),
        ("Deployment", "demo-decode"),
        ("Deployment", "demo-prefill"),
    ]
    assert ("Service", "demo") in kinds and ("ConfigMap", "demo-config") in kinds


def test_building_twice_gives_identical_manifests():
    assert yaml.safe_dump_all(children()) == yaml.safe_dump_all(children())


def test_engine_pods_carry_role_kv_config_from_the_pod_ip_and_name():
    objects = children()
    for role, kv_role in (("prefill", "kv_producer"), ("decode", "kv_consumer")):
        c = container(objects, f"demo-{role}")
        command = c["command"]
        kv = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert kv["kv_role"] == kv_role
        assert (kv["kv_ip"], kv["engine_id"]) == ("$(PDFLEET_KV_IP)", "$(POD_NAME)")
        env = {e["name"]: e for e in c["env"]}
        assert env["PDFLEET_KV_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert {p["name"] for p in c["ports"]} == {"http", "kv", "kv-events", "kv-replay"}
    assert {e["name"] for e in container(objects, "demo-decode")["env"]} >= {"UCX_TLS"}


def test_engine_pods_are_hardened_probed_and_drain_before_being_killed():
    objects = children()
    for role in ("prefill", "decode"):
        deployment = by_kind_name(objects)["Deployment", f"demo-{role}"]
        pod = deployment["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert {"startupProbe", "readinessProbe", "livenessProbe"} <= set(c)
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        assert shm["emptyDir"]["medium"] == "Memory"
        assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]
        # At least the engine's shutdown timeout (90 s) before SIGKILL.
        assert pod["terminationGracePeriodSeconds"] >= 90
        assert deployment["spec"]["template"]["metadata"]["labels"][LABEL_COMPAT]
    prefill = container(objects, "demo-prefill")
    assert prefill["resources"] == {"limits": {"nvidia.com/gpu": 1}}


def test_builtin_model_is_written_by_an_init_container_and_pvc_models_are_mounted():
    pod = by_kind_name(children())["Deployment", "demo-decode"]["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["command"] == ["pdfleet", "tiny-model", "/models/tiny"]
    spec = {**SPEC, "model": {"name": "m", "uri": "pvc://weights/llama"}}
    pod = by_kind_name(children(spec))["Deployment", "demo-decode"]["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    volume = next(v for v in pod["volumes"] if v["name"] == "models")
    assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    assert pod["containers"][0]["command"][2] == "/models/weights/llama"


@pytest.mark.parametrize(
    ("resources", "workers"),
    [
        ({}, 1),
        ({"limits": {"cpu": "4"}}, 4),
        ({"limits": {"cpu": "2500m"}, "requests": {"cpu": "1"}}, 2),
        ({"requests": {"cpu": "3"}}, 3),
        ({"limits": {"cpu": "500m"}}, 1),
    ],
)
def test_gateway_runs_one_worker_per_whole_cpu_of_its_limit(resources, workers):
    from pdfleet.engine.cli import build_parser

    spec = {**SPEC, "gateway": {**SPEC.get("gateway", {}), "resources": resources}}
    command = container(children(spec), "demo-gateway")["command"]
    assert build_parser().parse_args(command[1:]).workers == workers


def test_gateway_discovers_engines_by_label_and_reads_the_api_key_from_the_secret():
    objects = children()
    c = container(objects, "demo-gateway")
    command = c["command"]
    assert command[:2] == ["pdfleet", "gateway"]
    # The real gateway parses the rendered command line.
    from pdfleet.engine.cli import build_parser

    flags = build_parser().parse_args(command[1:])
    assert flags.discovery == "kubernetes"
    assert flags.namespace == "ns1"
    assert flags.selector == "pdfleet.dev/service=demo"
    assert flags.disaggregation_mode == "Conditional"
    assert flags.min_prompt_tokens == 256
    assert flags.port == 8000
    # It answers to the model's name, as the engines do (/v1/models at zero replicas too).
    assert flags.served_model_name == ["m"]
    # The key is a mounted file (checkov CKV_K8S_35), never an environment value.
    env = {e["name"]: e for e in c["env"]}
    assert "PDFLEET_API_KEY" not in env
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    key_file = env["PDFLEET_API_KEY_FILE"]["value"]
    assert key_file.startswith(mounts["api-key"]["mountPath"] + "/")
    assert mounts["api-key"]["readOnly"] is True
    pod = next(
        o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "demo-gateway"
    )["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "api-key"]
    assert volume["secret"]["secretName"] == "keys"
    assert volume["secret"]["items"] == [{"key": "api-key", "path": key_file.rsplit("/", 1)[1]}]
    # The gateway's pod discovery goes through the chart's gateway Role (its default,
    # namespaced install): the operator writes no role of its own.
    assert not [o for o in objects if o["kind"] in ("Role", "ClusterRole")]
    binding = by_kind_name(objects)["RoleBinding", "demo-gateway"]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": "pdfleet-gateway",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "demo-gateway", "namespace": "ns1"}
    ]
    service = by_kind_name(objects)["Service", "demo"]
    assert service["spec"]["type"] == "ClusterIP"
    assert by_kind_name(objects)["Service", "demo-prefill"]["spec"]["clusterIP"] == "None"


def test_replicas_follow_spec_autoscaler_and_disaggregation_mode():
    spec = parse_spec(SPEC)
    assert desired_replicas(spec, "decode") == 3
    scaled = parse_spec({**SPEC, "autoscaling": {"decode": {"minReplicas": 2, "maxReplicas": 5}}})
    assert desired_replicas(scaled, "decode", {"decode": 9}) == 5
    assert desired_replicas(scaled, "decode", {"decode": 0}) == 2
    assert desired_replicas(scaled, "decode") == 3
    disabled = parse_spec({**SPEC, "disaggregation": {"mode": "Disabled"}})
    assert desired_replicas(disabled, "prefill") == 0
    decode = container(build_children("demo", disabled, namespace="ns1"), "demo-decode")
    assert "--kv-transfer-config" not in decode["command"]


def test_default_image_applies_only_without_spec_image():
    assert container(children(), "demo-decode")["image"] == DEFAULT_IMAGE
    assert container(children(image="reg/x:1"), "demo-decode")["image"] == "reg/x:1"
    spec = {**SPEC, "image": "reg/own:2"}
    assert container(children(spec, image="reg/x:1"), "demo-gateway")["image"] == "reg/own:2"


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def test_pdfleet_render_prints_exactly_the_built_children():
    path = EXAMPLES[0]
    code, out, _ = run_cli("render", str(path), "--namespace", "team-a")
    assert code == 0
    svc = load_inference_service(path)
    assert list(yaml.safe_load_all(out)) == build_children(svc.name, svc.spec, namespace="team-a")


def test_pdfleet_render_exits_2_listing_every_violation(tmp_path):
    path = tmp_path / "bad.yaml"
    doc = yaml.safe_load(EXAMPLES[0].read_text())
    doc["spec"]["kvTransfer"] = {}
    doc["spec"]["decode"]["engine"] = {"hfOverrides": {"num_hidden_layers": 1}}
    path.write_text(yaml.safe_dump(doc))
    code, out, err = run_cli("render", str(path))
    assert code == 2 and out == ""
    assert "spec.kvTransfer.connector" in err and "spec.decode.engine.hfOverrides" in err


def test_pdfleet_crd_prints_the_crd():
    code, out, _ = run_cli("crd")
    assert code == 0
    assert yaml.safe_load(out)["metadata"]["name"] == "inferenceservices.pdfleet.dev"


def test_hf_model_is_fetched_by_an_init_container_into_the_cache_claim():
    spec = {
        **SPEC,
        "model": {
            "name": "m",
            "uri": "hf://acme/llama",
            "revision": "v1",
            "tokenSecret": {"name": "hf"},
            "cache": {"claim": "hub-cache"},
            "hfEndpoint": "https://mirror.example",
        },
    }
    objects = by_kind_name(children(spec))
    for name in ("demo-decode", "demo-prefill", "demo-gateway"):
        pod = objects["Deployment", name]["spec"]["template"]["spec"]
        (init,) = pod["initContainers"]
        assert init["command"] == [
            "pdfleet",
            "fetch-model",
            "hf://acme/llama",
            "--cache-dir",
            "/hf-cache",
            "--output",
            "/models/hf",
            "--revision",
            "v1",
        ]
        env = {e["name"]: e.get("value") for e in init["env"]}
        assert env["HF_ENDPOINT"] == "https://mirror.example"
        assert env["HF_TOKEN_PATH"] == "/etc/pdfleet/hf-token/token"
        assert "HF_TOKEN" not in env  # a mounted file, never an environment value
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert volumes["hf-cache"]["persistentVolumeClaim"] == {"claimName": "hub-cache"}
        assert volumes["hf-token"]["secret"]["secretName"] == "hf"
        main_mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert main_mounts["hf-cache"]["readOnly"] and main_mounts["models"]["readOnly"]
        assert "hf-token" not in main_mounts
    engine = objects["Deployment", "demo-decode"]["spec"]["template"]["spec"]["containers"][0]
    assert engine["command"][2] == "/models/hf"


def test_hub_fields_on_a_non_hf_model_are_rejected():
    with pytest.raises(ValueError, match="tokenSecret applies to hf:// models only"):
        parse_spec({"model": {"name": "m", "uri": "builtin://tiny", "tokenSecret": {"name": "x"}}})


def test_builtin_smollm2_is_prepared_by_fetch_model_in_the_init_container():
    spec = {**SPEC, "model": {"name": "m", "uri": "builtin://smollm2-135m-instruct"}}
    pod = by_kind_name(children(spec))["Deployment", "demo-decode"]["spec"]["template"]["spec"]
    assert pod["initContainers"][0]["command"] == [
        "pdfleet",
        "fetch-model",
        "builtin://smollm2-135m-instruct",
        "--output",
        "/models/smollm2-135m-instruct",
    ]


def pod_of(objects, name):
    return by_kind_name(objects)["Deployment", name]["spec"]["template"]


def test_every_engine_and_gateway_pod_mounts_the_fleet_secret_as_a_file():
    objects = children(secret_version="abc123")
    for name in ("demo-prefill", "demo-decode", "demo-gateway"):
        template = pod_of(objects, name)
        c = template["spec"]["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert "PDFLEET_FLEET_SECRET" not in env  # a file, never an environment value
        path = env["PDFLEET_FLEET_SECRET_FILE"]["value"]
        mount = next(m for m in c["volumeMounts"] if m["name"] == "fleet-secret")
        assert path == mount["mountPath"] + "/secret" and mount["readOnly"] is True
        volume = next(v for v in template["spec"]["volumes"] if v["name"] == "fleet-secret")
        assert volume["secret"]["secretName"] == "demo-fleet"
        assert volume["secret"]["items"] == [{"key": "fleet-secret", "path": "secret"}]
        # A new secret (rotation) changes the template, so every pod rolls onto it.
        assert template["metadata"]["annotations"]["pdfleet.dev/fleet-secret-version"] == "abc123"
    unversioned = pod_of(children(), "demo-decode")["metadata"].get("annotations", {})
    assert "pdfleet.dev/fleet-secret-version" not in unversioned


def test_engine_pods_pin_ucx_to_a_port_range_above_the_kv_port():
    objects = children()
    for name in ("demo-prefill", "demo-decode"):
        env = {e["name"]: e.get("value") for e in container(objects, name)["env"]}
        assert env["UCX_TCP_PORT_RANGE"] == "14580-14611"
    zmq = children({**SPEC, "kvTransfer": {"connector": "ZmqConnector"}})
    assert "UCX_TCP_PORT_RANGE" not in {e["name"] for e in container(zmq, "demo-decode")["env"]}
    high = children({**SPEC, "kvTransfer": {"connector": "NixlConnector", "port": 65530}})
    env = {e["name"]: e.get("value") for e in container(high, "demo-decode")["env"]}
    assert env["UCX_TCP_PORT_RANGE"] == "65498-65529"


def test_gpu_engine_pods_request_the_ucx_transports_for_gpu_memory():
    objects = children()
    env = {e["name"]: e.get("value") for e in container(objects, "demo-prefill")["env"]}
    transports = env["UCX_TLS"].split(",")
    assert {"cuda_copy", "cuda_ipc", "rc"} <= set(transports)
    # Without GPUs UCX keeps its own choice; a role's own UCX_TLS wins, once.
    gpu_decode = {**SPEC["decode"], "resources": {"limits": {"nvidia.com/gpu": 2}}}
    own = children({**SPEC, "decode": gpu_decode})
    decode_env = [e for e in container(own, "demo-decode")["env"] if e["name"] == "UCX_TLS"]
    assert decode_env == [{"name": "UCX_TLS", "value": "tcp"}]
    cpu_only = {**SPEC, "prefill": {"replicas": 1}}
    names = {e["name"] for e in container(children(cpu_only), "demo-prefill")["env"]}
    assert "UCX_TLS" not in names
    zmq = children({**SPEC, "kvTransfer": {"connector": "ZmqConnector"}})
    assert "UCX_TLS" not in {e["name"] for e in container(zmq, "demo-prefill")["env"]}


def test_gpus_implied_by_tensor_parallelism_also_get_the_gpu_transports():
    # No GPU written in resources: the operator derives 2 per pod from the TP size.
    tp = {"replicas": 1, "engine": {"tensorParallelSize": 2}}
    c = container(children({**SPEC, "prefill": tp}), "demo-prefill")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert "cuda_ipc" in {e["name"]: e.get("value") for e in c["env"]}["UCX_TLS"]


def test_an_rdma_device_gives_engine_pods_the_resource_and_ipc_lock():
    plain = container(children(), "demo-prefill")
    assert "add" not in plain["securityContext"]["capabilities"]
    kv = {**SPEC["kvTransfer"], "rdmaResource": "rdma/rdma_shared_device_a"}
    objects = children({**SPEC, "kvTransfer": kv})
    for name in ("demo-prefill", "demo-decode"):
        c = container(objects, name)
        assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
        assert c["resources"]["requests"]["rdma/rdma_shared_device_a"] == "1"
    assert container(objects, "demo-prefill")["resources"]["limits"]["nvidia.com/gpu"] == 1
    for obj in objects:
        validate(obj)
    gateway = container(objects, "demo-gateway")
    assert "add" not in gateway["securityContext"]["capabilities"]


def network_policy(objects, role):
    return by_kind_name(objects)["NetworkPolicy", f"demo-{role}"]["spec"]


def test_engines_take_http_only_from_gateway_and_operator_and_kv_only_from_the_other_role():
    install = OperatorInstall(namespace="pdfleet-system")
    objects = children(install=install)
    gateway = {"podSelector": {"matchLabels": {LABEL_SERVICE: "demo", LABEL_ROLE: "gateway"}}}
    operator = {
        "podSelector": {
            "matchLabels": {
                "app.kubernetes.io/name": "pdfleet",
                "app.kubernetes.io/component": "operator",
            }
        },
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "pdfleet-system"}},
    }
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        policy = network_policy(objects, role)
        assert policy["podSelector"]["matchLabels"] == {LABEL_SERVICE: "demo", LABEL_ROLE: role}
        assert policy["policyTypes"] == ["Ingress"]
        http, events, kv = policy["ingress"]
        assert http["from"] == [gateway, operator]
        assert http["ports"] == [{"port": 8000, "protocol": "TCP"}]
        # The KV event streams (docs/kv_events.md): from the gateway only.
        assert events["from"] == [gateway]
        assert events["ports"] == [
            {"port": 5557, "protocol": "TCP"},
            {"port": 5558, "protocol": "TCP"},
        ]
        assert kv["from"] == [
            {"podSelector": {"matchLabels": {LABEL_SERVICE: "demo", LABEL_ROLE: other}}}
        ]
        assert kv["ports"] == [
            {"port": 14579, "protocol": "TCP"},
            {"port": 14580, "endPort": 14611, "protocol": "TCP"},
        ]
    # Clients reach the gateway's port only.
    assert network_policy(objects, "gateway")["ingress"] == [
        {"ports": [{"port": 8000, "protocol": "TCP"}]}
    ]
    # Without disaggregation no KV port is open anywhere.
    disabled = children({**SPEC, "disaggregation": {"mode": "Disabled"}})
    ports = [p["port"] for r in network_policy(disabled, "decode")["ingress"] for p in r["ports"]]
    assert ports == [8000, 5557, 5558]
    # An operator in the service's own namespace: selected by pod labels alone.
    local = children(install=OperatorInstall(namespace=None))
    assert "namespaceSelector" not in network_policy(local, "decode")["ingress"][0]["from"][1]


def test_peer_pull_engines_take_kv_from_their_own_role_and_the_gateway_pulls():
    spec = {**SPEC, "disaggregation": {"mode": "Disabled"}, "decode": {"peerPull": True}}
    objects = children(spec)
    ingress = network_policy(objects, "decode")["ingress"]
    own = {"podSelector": {"matchLabels": {LABEL_SERVICE: "demo", LABEL_ROLE: "decode"}}}
    kv = [rule for rule in ingress if rule.get("from") == [own]]
    assert kv == [
        {
            "from": [own],
            "ports": [
                {"port": 14579, "protocol": "TCP"},
                {"port": 14580, "endPort": 14611, "protocol": "TCP"},
            ],
        }
    ]
    c = container(objects, "demo-decode")
    command = c["command"]
    assert json.loads(command[command.index("--kv-transfer-config") + 1])["kv_role"] == "kv_both"
    assert "kv" in {p["name"] for p in c["ports"]}
    gateway = container(objects, "demo-gateway")["command"]
    assert "--peer-pull" in gateway
    assert gateway[gateway.index("--prefix-blocks") + 1] == "256"
    # Off, the gateway does not pull and no engine takes KV from its own role.
    plain = children({**SPEC, "disaggregation": {"mode": "Disabled"}})
    assert "--peer-pull" not in container(plain, "demo-gateway")["command"]


def test_prefill_peer_pull_engines_pull_from_each_other_and_from_the_decode_engines():
    objects = children({**SPEC, "prefill": {"peerPull": True}})
    selector = {LABEL_SERVICE: "demo"}
    kv_ports = [
        {"port": 14579, "protocol": "TCP"},
        {"port": 14580, "endPort": 14611, "protocol": "TCP"},
    ]
    froms = {
        role: [r["from"] for r in network_policy(objects, role)["ingress"] if "ports" in r]
        for role in ("prefill", "decode")
    }
    prefill = [{"podSelector": {"matchLabels": {**selector, LABEL_ROLE: "prefill"}}}]
    decode = [{"podSelector": {"matchLabels": {**selector, LABEL_ROLE: "decode"}}}]
    assert prefill in froms["prefill"]  # prefill pulls from prefill
    assert decode in froms["prefill"]  # decode pulls prefill legs, as without peer pulls
    assert decode not in froms["decode"]  # decode engines do not pull from each other
    # Prefill engines pull the decode engines' cached blocks: the decode pods take
    # the KV side channel and the UCX range from the prefill pods.
    into_decode = [
        r for r in network_policy(objects, "decode")["ingress"] if r.get("from") == prefill
    ]
    assert into_decode == [{"from": prefill, "ports": kv_ports}]
    # Both roles lend (kv_both): the decode engines still consume the prefill legs' KV.
    for role in ("prefill", "decode"):
        c = container(objects, f"demo-{role}")
        command = c["command"]
        kv = json.loads(command[command.index("--kv-transfer-config") + 1])
        assert (kv["kv_role"], kv["kv_port"]) == ("kv_both", 14579), role
        assert "kv" in {p["name"] for p in c["ports"]}
        assert "--kv-events-config" in command  # the gateway's index sees what it holds
    assert "--peer-pull" in container(objects, "demo-gateway")["command"]
    # With identities each may ask the operator for an identity of both roles.
    with_ids = children({**SPEC, "prefill": {"peerPull": True}}, identity_version="v1")
    for role in ("prefill", "decode"):
        template = by_kind_name(with_ids)["Deployment", f"demo-{role}"]["spec"]["template"]
        assert template["metadata"]["annotations"][ANNOTATION_IDENTITY_ROLE] == "both"
    template = by_kind_name(children(identity_version="v1"))["Deployment", "demo-decode"]
    assert ANNOTATION_IDENTITY_ROLE not in template["spec"]["template"]["metadata"]["annotations"]
    # Without peer pulls the decode engines only consume.
    command = container(children(), "demo-decode")["command"]
    kv_role = json.loads(command[command.index("--kv-transfer-config") + 1])["kv_role"]
    assert kv_role == "kv_consumer"


def test_fleet_secret_is_immutable_owned_and_holds_the_value():
    secret = build_fleet_secret("demo", namespace="ns1", owner=Owner("demo", "u1"), value="s" * 43)
    validate(secret)
    assert secret["metadata"]["name"] == "demo-fleet"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert secret["immutable"] is True
    assert base64.b64decode(secret["data"]["fleet-secret"]) == b"s" * 43


def test_engine_pods_get_their_identity_through_their_own_account_and_nothing_else():
    objects = children(identity_version="v1")
    found = by_kind_name(objects)
    account = found["ServiceAccount", "demo-engine"]
    assert account["automountServiceAccountToken"] is False
    # No binding grants the engine account anything: its token opens no API.
    bound = [s["name"] for o in objects if o["kind"] == "RoleBinding" for s in o["subjects"]]
    assert "demo-engine" not in bound
    for role in ("prefill", "decode"):
        template = found["Deployment", f"demo-{role}"]["spec"]["template"]
        pod = template["spec"]
        assert pod["serviceAccountName"] == "demo-engine"
        assert pod["automountServiceAccountToken"] is False
        volume = next(v for v in pod["volumes"] if v["name"] == "identity")
        token, ca = volume["projected"]["sources"]
        assert token["serviceAccountToken"] == {
            "audience": "pdfleet.dev/identity",
            "expirationSeconds": 600,
            "path": "token",
        }
        assert ca["configMap"] == {
            "name": "demo-identity",
            "items": [{"key": "ca.crt", "path": "ca.crt"}],
        }
        engine = pod["containers"][0]
        mount = next(m for m in engine["volumeMounts"] if m["name"] == "identity")
        assert mount["readOnly"] is True
        env = {e["name"]: e for e in engine["env"]}
        assert env["PDFLEET_IDENTITY_AUTHORITY"]["valueFrom"]["configMapKeyRef"] == {
            "name": "demo-identity",
            "key": "authority",
        }
        assert env["PDFLEET_IDENTITY_ENDPOINT"]["valueFrom"]["configMapKeyRef"]["key"] == (
            "endpoint"
        )
        assert env["PDFLEET_IDENTITY_SERVICE"]["value"] == "demo"
        # The authority's private key reaches no pod.
        assert not any("demo-identity" in str(v.get("secret")) for v in pod["volumes"])
        assert template["metadata"]["annotations"]["pdfleet.dev/identity-authority-version"] == "v1"
    gateway = found["Deployment", "demo-gateway"]["spec"]["template"]
    assert "identity" not in str(gateway["spec"]["volumes"])
    assert "pdfleet.dev/identity-authority-version" not in str(gateway["metadata"])


@pytest.mark.parametrize(
    "change",
    [
        {"kvTransfer": {**SPEC["kvTransfer"], "identity": "Disabled"}},
        {"disaggregation": {"mode": "Disabled"}},
    ],
    ids=["identity Disabled", "no KV transfer"],
)
def test_engines_without_identities_get_no_identity_wiring(change):
    found = by_kind_name(children({**SPEC, **change}, identity_version="v1"))
    for role in ("prefill", "decode"):
        template = found["Deployment", f"demo-{role}"]["spec"]["template"]
        assert template["spec"]["serviceAccountName"] == "demo-engine"
        assert "identity" not in str(template["spec"]["volumes"])
        assert "PDFLEET_IDENTITY" not in str(template["spec"]["containers"][0]["env"])
        assert "pdfleet.dev/identity-authority-version" not in (
            template["metadata"].get("annotations") or {}
        )


def test_only_the_leader_of_a_multi_node_engine_gets_an_identity():
    svc = load_inference_service(ROOT / "examples" / "inferenceservice-multinode.yaml")
    found = by_kind_name(build_children(svc.name, svc.spec, namespace="ns1"))
    lws = found["LeaderWorkerSet", f"{svc.name}-decode"]["spec"]["leaderWorkerTemplate"]
    assert "PDFLEET_IDENTITY_ENDPOINT" in str(lws["leaderTemplate"]["spec"]["containers"][0])
    assert "PDFLEET_IDENTITY" not in str(lws["workerTemplate"]["spec"]["containers"][0])


def test_no_spec_field_may_reach_an_identity_authority():
    for bad in (
        {
            "decode": {
                "env": [
                    {
                        "name": "X",
                        "valueFrom": {
                            "secretKeyRef": {"name": "demo-identity", "key": "authority"}
                        },
                    }
                ]
            }
        },
        {"gateway": {"apiKeySecret": {"name": "demo-identity"}}},
    ):
        with pytest.raises(ValueError, match="identity"):
            parse_spec({**SPEC, **bad})


@pytest.mark.parametrize(
    ("source", "kind"), [({"secret": "tenants"}, "secret"), ({"configMap": "tenants"}, "configMap")]
)
def test_gateway_mounts_its_tenants_file_from_a_secret_or_a_configmap(source, kind):
    spec = {
        **SPEC,
        "engine": {"schedulingPolicy": "priority"},
        "gateway": {"tenants": {**source, "key": "t.yaml"}, "enginePriority": True},
    }
    objects = children(spec)
    c = container(objects, "demo-gateway")
    from pdfleet.engine.cli import build_parser

    flags = build_parser().parse_args(c["command"][1:])
    assert flags.engine_priority is True
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert flags.tenants_file == mounts["tenants"]["mountPath"] + "/tenants.yaml"
    pod = by_kind_name(objects)["Deployment", "demo-gateway"]["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "tenants"]
    assert volume[kind]["items"] == [{"key": "t.yaml", "path": "tenants.yaml"}]


@pytest.mark.parametrize(
    ("gateway", "match"),
    [
        ({"tenants": {"secret": "a", "configMap": "b"}}, "exactly one"),
        ({"tenants": {"key": "t.yaml"}}, "exactly one"),
        ({"enginePriority": True}, "schedulingPolicy"),
    ],
)
def test_bad_tenants_sources_and_engine_priority_without_the_policy_are_refused(gateway, match):
    with pytest.raises(ValueError, match=match):
        parse_spec({**SPEC, "gateway": gateway})


@pytest.mark.parametrize(
    ("batch", "volume", "strategy"),
    [
        ({"claimName": "batches"}, {"persistentVolumeClaim": {"claimName": "batches"}}, "Recreate"),
        ({"emptyDir": True}, {"emptyDir": {}}, "RollingUpdate"),
    ],
)
def test_gateway_batch_storage_is_its_data_directory(batch, volume, strategy):
    """spec.gateway.batch turns the Batch API on: the gateway's --data-dir is the
    claim it names (its pod then rolls by recreation: one SQLite writer) or an
    emptyDir (the pod's own state)."""
    objects = children({**SPEC, "gateway": {"batch": batch}})
    c = container(objects, "demo-gateway")
    from pdfleet.engine.cli import build_parser

    flags = build_parser().parse_args(c["command"][1:])
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert flags.data_dir == mounts["gateway-data"]["mountPath"]
    deployment = by_kind_name(objects)["Deployment", "demo-gateway"]
    pod = deployment["spec"]["template"]["spec"]
    (found,) = [v for v in pod["volumes"] if v["name"] == "gateway-data"]
    assert found == {"name": "gateway-data", **volume}
    assert deployment["spec"]["strategy"]["type"] == strategy
    plain = children(SPEC)
    assert (
        build_parser().parse_args(container(plain, "demo-gateway")["command"][1:]).data_dir is None
    )


def test_gateway_batch_on_postgresql_takes_the_url_from_the_secret_on_any_replicas():
    """batch.databaseSecret: no data directory, the URL from the Secret into
    $PDFLEET_BATCH_DATABASE_URL (not the command line), several replicas, a
    rolling update."""
    ref = {"name": "batch-db", "key": "dsn"}
    objects = children({**SPEC, "gateway": {"batch": {"databaseSecret": ref}, "replicas": 3}})
    c = container(objects, "demo-gateway")
    from pdfleet.engine.cli import build_parser

    assert build_parser().parse_args(c["command"][1:]).data_dir is None
    assert not any("batch-db" in part or "postgres" in part for part in c["command"])
    (env,) = [e for e in c["env"] if e["name"] == "PDFLEET_BATCH_DATABASE_URL"]
    assert env["valueFrom"] == {"secretKeyRef": ref}
    deployment = by_kind_name(objects)["Deployment", "demo-gateway"]
    assert deployment["spec"]["replicas"] == 3
    assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    assert "gateway-data" not in {
        v["name"] for v in deployment["spec"]["template"]["spec"]["volumes"]
    }
    default = children({**SPEC, "gateway": {"batch": {"databaseSecret": {"name": "db"}}}})
    (env,) = [e for e in container(default, "demo-gateway")["env"] if "BATCH" in e["name"]]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "db", "key": "url"}


@pytest.mark.parametrize(
    ("gateway", "match"),
    [
        ({"batch": {}}, "exactly one of claimName"),
        ({"batch": {"claimName": "a", "emptyDir": True}}, "exactly one of claimName"),
        ({"batch": {"emptyDir": True}, "replicas": 2}, "one SQLite database"),
        ({"batch": {"claimName": "a", "databaseSecret": {"name": "db"}}}, "exactly one of"),
    ],
)
def test_gateway_batch_needs_one_storage_and_one_replica(gateway, match):
    with pytest.raises(ValueError, match=match):
        parse_spec({**SPEC, "gateway": gateway})
