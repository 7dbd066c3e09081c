"""The Helm chart, checked with a real helm binary (lint + template)."""

from __future__ import annotations

import re
import shutil

import pytest
import yaml
from helpers.helm_tool import ROOT, helm
from helpers.kube_schema import validate

from pdfleet.engine.cli import build_parser

CHART = ROOT / "charts" / "pdfleet"


def render(*flags: str) -> list[dict]:
    out = helm("template", "demo", str(CHART), "--namespace", "ops", *flags)
    return [d for d in yaml.safe_load_all(out) if d]


CLUSTER_WIDE = ("--set", "namespaced=false", "--set", "clusterWide=true")


def test_helm_lint_passes_in_both_modes():
    helm("lint", "--strict", str(CHART))
    helm("lint", "--strict", str(CHART), *CLUSTER_WIDE)


def test_cluster_wide_mode_needs_an_explicit_confirmation():
    with pytest.raises(AssertionError, match="clusterWide=true"):
        render("--set", "namespaced=false")


@pytest.mark.parametrize("flags", [(), CLUSTER_WIDE, ("--set", "watchNamespaces={a,b}")], ids=str)
def test_rendered_objects_are_valid_kubernetes(flags):
    objects = render("--include-crds", *flags)
    assert objects
    for obj in objects:
        validate(obj)


def test_operator_runs_one_replica_recreated_with_kopf_liveness():
    deployment = next(o for o in render() if o["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert pod["securityContext"]["runAsNonRoot"] is True
    # The command is a valid pdfleet command line.
    args = build_parser().parse_args(container["command"][1:])
    assert args.command == "operator" and args.namespace == ["ops"]
    assert args.default_image == "pdfleet:0.1.0"
    # Engine NetworkPolicies admit scrapes from the operator's namespace.
    assert args.operator_namespace == "ops"
    assert (args.gateway_role_kind, args.gateway_role) == ("Role", "demo-pdfleet-gateway")


def rules_by_resource(role):
    out = {}
    for rule in role["rules"]:
        assert "*" not in rule["verbs"] and "*" not in rule["resources"]
        assert "delete" not in rule["verbs"]  # children go by garbage collection
        for resource in rule["resources"]:
            out[resource] = (sorted(rule["verbs"]), rule.get("resourceNames"))
    return out


# What the operator may do, and nothing more (docs/security.md says why).
OPERATOR_RULES = {
    "inferenceservices": (["get", "list", "patch", "watch"], None),
    "inferenceservices/status": (["get", "patch"], None),
    "deployments": (["create", "get", "patch"], None),
    "services": (["create", "get", "patch"], None),
    "configmaps": (["create", "get", "patch"], None),
    "serviceaccounts": (["create", "get", "patch"], None),
    "poddisruptionbudgets": (["create", "get", "patch"], None),
    "networkpolicies": (["create", "get", "patch"], None),
    "secrets": (["create", "get"], None),
    "rolebindings": (["create", "get", "patch"], None),
    "pods": (["get", "list", "patch"], None),
    "events": (["create"], None),
}


def tokenreview_only(objects: list[dict]) -> None:
    """The one cluster-wide right of a namespaced install: TokenReviews (the identity
    endpoint), bound to the operator's account."""
    roles = [o for o in objects if o["kind"] == "ClusterRole" and "tokenreview" in str(o)]
    assert [r["rules"] for r in roles] == [
        [
            {
                "apiGroups": ["authentication.k8s.io"],
                "resources": ["tokenreviews"],
                "verbs": ["create"],
            }
        ]
    ]
    binding = next(o for o in objects if o["kind"] == "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == roles[0]["metadata"]["name"] == "demo-pdfleet-tokenreview"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "demo-pdfleet", "namespace": "ops"}
    ]


def test_namespaced_mode_is_the_default_and_creates_nothing_cluster_wide_but_the_policy():
    objects = render("--set", "watchNamespaces={a,b}")
    kinds = {(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")) for o in objects}
    cluster_wide = {(k, n) for k, n, _ in kinds if k in ("ClusterRole", "ClusterRoleBinding")}
    assert cluster_wide == {
        ("ClusterRole", "demo-pdfleet-tokenreview"),
        ("ClusterRoleBinding", "demo-pdfleet-tokenreview"),
    }
    tokenreview_only(objects)
    for ns in ("a", "b"):
        assert {("Role", "demo-pdfleet", ns), ("RoleBinding", "demo-pdfleet", ns)} <= kinds
        assert ("Role", "demo-pdfleet-gateway", ns) in kinds
    roles = {
        (o["metadata"]["name"], o["metadata"]["namespace"]): o
        for o in objects
        if o["kind"] == "Role"
    }
    rules = rules_by_resource(roles["demo-pdfleet", "a"])
    # The operator binds the gateway role and no other; it creates no Roles.
    assert rules.pop("roles") == (["bind"], ["demo-pdfleet-gateway"])
    assert rules == OPERATOR_RULES
    assert roles["demo-pdfleet-gateway", "b"]["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]


def test_cluster_wide_mode_grants_the_same_rules_and_a_gateway_cluster_role():
    objects = render(*CLUSTER_WIDE)
    roles = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ClusterRole"}
    assert set(roles) == {"demo-pdfleet", "demo-pdfleet-gateway", "demo-pdfleet-tokenreview"}
    rules = rules_by_resource(roles["demo-pdfleet"])
    assert rules.pop("clusterroles") == (["bind"], ["demo-pdfleet-gateway"])
    assert rules == OPERATOR_RULES
    assert not [o for o in objects if o["kind"] in ("Role", "RoleBinding")]
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    args = build_parser().parse_args(
        deployment["spec"]["template"]["spec"]["containers"][0]["command"][1:]
    )
    assert args.namespace == [] and args.gateway_role_kind == "ClusterRole"


def test_an_admission_policy_confines_the_operators_pod_patches():
    objects = render()
    (policy,) = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"] == {
        "policyName": policy["metadata"]["name"],
        "validationActions": ["Deny"],
    }
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"][0]["resources"] == ["pods"]
    (match,) = spec["matchConditions"]
    assert "system:serviceaccount:ops:demo-pdfleet" in match["expression"]
    rules = " ".join(v["expression"] for v in spec["validations"])
    assert "pdfleet-operator" in rules and "controller.kubernetes.io/pod-deletion-cost" in rules
    assert "object.spec == oldObject.spec" in rules
    assert not [o for o in render("--set", "podPatchPolicy=false") if "Admission" in o["kind"]]


def test_every_values_key_has_a_comment():
    lines = (CHART / "values.yaml").read_text().splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[A-Za-z]\w*:", line):
            assert i > 0 and lines[i - 1].startswith("#"), f"values.yaml: no comment above {line!r}"


def test_chart_templates_use_the_namespaced_helpers():
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    for name in ("name", "fullname", "chart", "labels", "selectorLabels"):
        assert f'define "pdfleet.{name}"' in helpers


def notes(tmp_path, *flags: str) -> str:
    """NOTES.txt as `helm install` prints it (helm renders it only on install,
    which needs a cluster: a copy is rendered into a ConfigMap)."""
    chart = tmp_path / "pdfleet"
    if not chart.exists():
        shutil.copytree(CHART, chart)
        shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
        (chart / "templates" / "notes.yaml").write_text(
            "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n"
            'data: {notes: {{ tpl (.Files.Get "notes.txt") . | quote }}}\n'
        )
    out = helm("template", "demo", str(chart), "--show-only", "templates/notes.yaml", *flags)
    return yaml.safe_load(out)["data"]["notes"]


def test_notes_render(tmp_path):
    out = notes(tmp_path)
    assert "watches InferenceServices in: default" in out
    assert "kubectl apply -n default -f" in out and "kubectl wait pdsvc/tiny -n default" in out
    out = notes(tmp_path, *CLUSTER_WIDE)
    assert "watches InferenceServices in every namespace" in out


def test_notes_name_the_namespace_on_every_kubectl_line_and_hold_no_placeholder(tmp_path):
    from pdfleet.operator.resource import load_inference_service

    out = notes(tmp_path, "--namespace", "ops", "--set", "watchNamespaces={team-a,team-b}")
    commands = [line.strip() for line in out.splitlines() if line.strip().startswith("kubectl ")]
    assert len(commands) >= 5
    for command in commands:
        assert re.search(r" -n \S+", command), command
    assert "kubectl get deployment demo-pdfleet -n ops" in commands
    # InferenceServices go where the operator watches: the first watched namespace.
    assert all(" -n team-a" in c for c in commands if "pdsvc" in c or "svc/" in c)
    assert "OWNER" not in out and "https://" not in out  # nothing to fill in, no dead link
    # The example it applies is a valid InferenceService.
    # A here-document a shell ends: its EOF line stands alone, unindented.
    manifest = out.split("<<'EOF'\n", 1)[1].split("\nEOF\n", 1)[0]
    service = load_inference_service(yaml.safe_load(manifest))
    assert service.name == "tiny" and service.spec.model.uri == "builtin://tiny"
    assert (
        "pdfleet render FILE.yaml --operator-namespace ops --gateway-role demo-pdfleet-gateway"
        in out
    )


def test_pdfleet_render_defaults_are_a_default_install_of_the_chart():
    # `helm install pdfleet charts/pdfleet -n pdfleet`: what the operator is told ...
    out = helm("template", "pdfleet", str(CHART), "--namespace", "pdfleet")
    objects = [d for d in yaml.safe_load_all(out) if d]
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    operator = build_parser().parse_args(command[1:])
    # ... is what `pdfleet render` assumes without flags.
    rendered = build_parser().parse_args(["render", "svc.yaml"])
    assert (rendered.gateway_role_kind, rendered.gateway_role) == (
        operator.gateway_role_kind,
        operator.gateway_role,
    )
    assert rendered.operator_namespace == "pdfleet" == deployment["metadata"]["namespace"]
    # And the role it binds exists in that install.
    assert (operator.gateway_role_kind, operator.gateway_role) == ("Role", "pdfleet-gateway")
    assert any(o["kind"] == "Role" and o["metadata"]["name"] == "pdfleet-gateway" for o in objects)


def pod(labels=None, annotations=None, image="pdfleet:0.1.0"):
    meta = {"name": "demo-decode-x", "namespace": "ns1"}
    if labels is not None:
        meta["labels"] = labels
    if annotations is not None:
        meta["annotations"] = annotations
    return {"metadata": meta, "spec": {"containers": [{"name": "engine", "image": image}]}}


OURS = {"app.kubernetes.io/managed-by": "pdfleet-operator", "pdfleet.dev/role": "decode"}
COST = "controller.kubernetes.io/pod-deletion-cost"


@pytest.mark.parametrize(
    ("old", "new", "allowed"),
    [
        (pod(OURS), pod(OURS, {COST: "-1000"}), True),
        (pod(OURS, {"a": "1", COST: "5"}), pod(OURS, {"a": "1", COST: "-1000"}), True),
        (pod(OURS), pod({**OURS, "pdfleet.dev/role": "prefill"}), False),  # relabel
        (pod(OURS, {"a": "1"}), pod(OURS, {"a": "2"}), False),  # another annotation
        (pod(OURS, {"a": "1"}), pod(OURS, {COST: "1"}), False),  # an annotation removed
        (pod(OURS), pod(OURS, image="evil:latest"), False),  # the spec
        (pod({"app": "other"}), pod({"app": "other"}, {COST: "1"}), False),  # not pdfleet's
        (pod(), pod(None, {COST: "1"}), False),  # no labels at all
    ],
)
def test_the_pod_patch_policy_admits_only_deletion_cost_changes_on_pdfleet_pods(old, new, allowed):
    import celpy

    (policy,) = [o for o in render() if o["kind"] == "ValidatingAdmissionPolicy"]
    env = celpy.Environment()

    def evaluate(expression, activation):
        return env.program(env.compile(expression)).evaluate(activation)

    activation = {
        "object": celpy.json_to_cel(new),
        "oldObject": celpy.json_to_cel(old),
        "request": celpy.json_to_cel(
            {"userInfo": {"username": "system:serviceaccount:ops:demo-pdfleet"}}
        ),
    }
    (match,) = policy["spec"]["matchConditions"]
    assert evaluate(match["expression"], activation)
    variables = {
        v["name"]: evaluate(v["expression"], activation) for v in policy["spec"]["variables"]
    }
    activation["variables"] = celpy.celtypes.MapType(
        {celpy.celtypes.StringType(k): v for k, v in variables.items()}
    )
    results = [bool(evaluate(v["expression"], activation)) for v in policy["spec"]["validations"]]
    assert all(results) is allowed, results


@pytest.mark.parametrize("mode", [(), CLUSTER_WIDE], ids=["namespaced", "cluster-wide"])
def test_leader_worker_set_rights_and_flag_come_only_with_the_chart_value(mode):
    lws = "leaderworkersets"
    objects = render(*mode, "--set", "leaderWorkerSet.enabled=true")
    (role,) = [
        o
        for o in objects
        if o["kind"] in ("Role", "ClusterRole") and o["metadata"]["name"] == "demo-pdfleet"
    ]
    rules = rules_by_resource(role)
    assert rules[lws] == (["create", "get", "patch"], None)
    rule = next(r for r in role["rules"] if lws in r["resources"])
    assert rule["apiGroups"] == ["leaderworkerset.x-k8s.io"]
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert build_parser().parse_args(command[1:]).leader_worker_set is True
    for obj in objects:
        validate(obj)
    # Off by default: no rule, and the operator refuses multi-node specs.
    objects = render(*mode)
    assert all(
        lws not in r["resources"]
        for o in objects
        if o["kind"] in ("Role", "ClusterRole")
        for r in o["rules"]
    )
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert build_parser().parse_args(command[1:]).leader_worker_set is False


def _leaf_keys(values: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in values.items():
        path = f"{prefix}{key}"
        # A section of named settings is explained key by key; free-form maps (labels,
        # selectors: empty by default) and resources are one value each.
        if isinstance(value, dict) and value and key != "resources":
            keys |= _leaf_keys(value, path + ".")
        else:
            keys.add(path)
    return keys


def test_the_chart_readme_explains_every_value_and_no_other():
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    readme = (CHART / "README.md").read_text()
    table = readme.split("## Values", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([A-Za-z][\w.]*)` \|", table, re.M))
    assert documented == _leaf_keys(values)


@pytest.mark.parametrize("mode", [(), CLUSTER_WIDE], ids=["namespaced", "cluster-wide"])
def test_the_identity_endpoint_is_a_service_admitting_engine_pods_only(mode):
    from pdfleet.operator.manifests import build_children
    from pdfleet.operator.resource import parse_spec

    objects = render("--set", "watchNamespaces={a,b}", *mode)
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = build_parser().parse_args(container["command"][1:])
    port = next(p for p in container["ports"] if p["name"] == "identity")["containerPort"]
    assert port == args.identity_port == 8443
    service = next(o for o in objects if o["kind"] == "Service")
    # The URL engines are told (https://SERVICE.NAMESPACE.svc:PORT) reaches that port.
    assert service["metadata"]["name"] == args.identity_service == "demo-pdfleet-identity"
    assert service["metadata"]["namespace"] == args.operator_namespace == "ops"
    assert service["spec"]["ports"] == [
        {"name": "identity", "port": port, "targetPort": "identity", "protocol": "TCP"}
    ]
    assert service["spec"]["selector"].items() <= (
        deployment["spec"]["template"]["metadata"]["labels"].items()
    )
    policy = next(o for o in objects if o["kind"] == "NetworkPolicy")
    rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == port)
    (peer,) = rule["from"]
    # Engine pods as the operator builds them match; the gateway's do not.
    children = build_children(
        "svc",
        parse_spec({"model": {"name": "m"}, "kvTransfer": {"connector": "ZmqConnector"}}),
        namespace="a",
    )
    templates = {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
        for o in children
        if o["kind"] == "Deployment"
    }

    def admitted(labels: dict) -> bool:
        return all(
            labels.get(e["key"]) in e["values"] for e in peer["podSelector"]["matchExpressions"]
        )

    assert admitted(templates["svc-decode"]) and admitted(templates["svc-prefill"])
    assert not admitted(templates["svc-gateway"])
    if mode:
        assert peer["namespaceSelector"] == {}
    else:
        assert peer["namespaceSelector"]["matchExpressions"] == [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["a", "b"]}
        ]
