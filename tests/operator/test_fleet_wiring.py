"""KV-event routing and the serving flags (tool calling, chat template) reach
every engine: rendered pods, NetworkPolicies and `pdfleet up` command lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.kube_schema import validate

from pdfleet.engine.config.gateway import KV_EVENTS_PORT_ANNOTATION, KV_REPLAY_PORT_ANNOTATION
from pdfleet.engine.contracts import identity
from pdfleet.engine.contracts.chat_template import load_chat_template
from pdfleet.engine.gateway.discovery import EnginesFileDiscovery
from pdfleet.operator.local.fleet import LocalFleet
from pdfleet.operator.manifests import build_children
from pdfleet.operator.resource import load_inference_service, parse_spec

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
SPEC = {
    "model": {"name": "m"},
    "kvTransfer": {"connector": "NixlConnector"},
    "serving": {
        "chatTemplate": TEMPLATE,
        "toolCallParser": "hermes",
        "enableAutoToolChoice": True,
    },
}


def render(spec):
    objects = build_children("demo", parse_spec(spec), namespace="ns1")
    for obj in objects:
        validate(obj)
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def pod(objects, role):
    return objects["Deployment", f"demo-{role}"]["spec"]["template"]


def flag(command, name):
    assert command.count(name) == 1, command
    return command[command.index(name) + 1]


def test_engine_pods_publish_kv_events_on_fixed_ports_and_announce_them():
    objects = render(SPEC)
    for role in ("prefill", "decode"):
        template = pod(objects, role)
        engine = template["spec"]["containers"][0]
        annotations = template["metadata"]["annotations"]
        assert annotations[KV_EVENTS_PORT_ANNOTATION] == "5557"
        assert annotations[KV_REPLAY_PORT_ANNOTATION] == "5558"
        ports = {p["name"]: p["containerPort"] for p in engine["ports"]}
        assert (ports["kv-events"], ports["kv-replay"]) == (5557, 5558)
        config = json.loads(flag(engine["command"], "--kv-events-config"))
        assert config["enable_kv_cache_events"] is True
        assert (config["endpoint"], config["replay_endpoint"]) == (
            "tcp://*:5557",
            "tcp://*:5558",
        )
        # The ConfigMap's command is the pod's.
        doc = json.loads(objects["ConfigMap", "demo-config"]["data"][f"{role}.json"])
        assert doc["command"] == engine["command"]
    gateway = pod(objects, "gateway")["spec"]["containers"][0]
    assert "kv-events" not in json.dumps(gateway["ports"])


def test_network_policy_admits_kv_event_ports_from_the_gateway_only():
    objects = render(SPEC)
    for role in ("prefill", "decode"):
        ingress = objects["NetworkPolicy", f"demo-{role}"]["spec"]["ingress"]
        rules = [r for r in ingress if any(p["port"] == 5557 for p in r.get("ports", []))]
        assert len(rules) == 1
        (rule,) = rules
        assert [p["port"] for p in rule["ports"]] == [5557, 5558]
        assert rule["from"] == [
            {
                "podSelector": {
                    "matchLabels": {
                        "pdfleet.dev/service": "demo",
                        "pdfleet.dev/role": "gateway",
                    }
                }
            }
        ]
        # No other rule opens the event ports (the HTTP rule stays HTTP only).
        others = [r for r in ingress if r is not rule]
        assert all(p["port"] not in (5557, 5558) for r in others for p in r.get("ports", []))


@pytest.mark.parametrize(
    "change",
    [
        {"gateway": {"kvEvents": False}},
        {"engine": {"enablePrefixCaching": False}},
    ],
    ids=["gateway.kvEvents false", "prefix cache off"],
)
def test_kv_events_stay_off_when_switched_off_or_without_a_prefix_cache(change):
    objects = render({**SPEC, **change})
    for role in ("prefill", "decode"):
        template = pod(objects, role)
        assert KV_EVENTS_PORT_ANNOTATION not in template["metadata"].get("annotations", {})
        engine = template["spec"]["containers"][0]
        assert "--kv-events-config" not in engine["command"]
        assert "kv-events" not in json.dumps(engine["ports"])
        ingress = objects["NetworkPolicy", f"demo-{role}"]["spec"]["ingress"]
        assert "5557" not in json.dumps(ingress)


def test_a_role_with_its_own_kv_events_config_keeps_it_unannounced():
    own = {"enable_kv_cache_events": True, "endpoint": "tcp://*:6000"}
    objects = render({**SPEC, "decode": {"engine": {"kvEventsConfig": own}}})
    engine = pod(objects, "decode")["spec"]["containers"][0]
    assert json.loads(flag(engine["command"], "--kv-events-config"))["endpoint"] == "tcp://*:6000"
    assert KV_EVENTS_PORT_ANNOTATION not in pod(objects, "decode")["metadata"].get(
        "annotations", {}
    )
    # The prefill role is still wired by the fleet.
    assert pod(objects, "prefill")["metadata"]["annotations"][KV_EVENTS_PORT_ANNOTATION] == "5557"


def test_serving_flags_reach_every_engine_pod_with_the_inline_template_intact():
    objects = render(SPEC)
    for role in ("prefill", "decode"):
        command = pod(objects, role)["spec"]["containers"][0]["command"]
        assert flag(command, "--tool-call-parser") == "hermes"
        assert "--enable-auto-tool-choice" in command
        # The engine reads the flag's value as the template itself.
        assert load_chat_template(flag(command, "--chat-template")) == TEMPLATE
    gateway = pod(objects, "gateway")["spec"]["containers"][0]["command"]
    assert "--tool-call-parser" not in gateway


def test_the_gateway_pod_renders_chat_prompts_with_the_engines_template():
    """The gateway counts and hashes chat prompts as the engines render them:
    the operator gives it the engines' --chat-template (the inline text, or the
    path, which the gateway pod has too: the same image, the model's volumes at
    the same paths), parsed by the real CLI."""
    from pdfleet.engine.cli import build_parser

    model = {"name": "m", "uri": "pvc://weights/llama"}
    for template in (TEMPLATE, "/models/weights/chat.jinja", "templates/chat.jinja"):
        objects = render({**SPEC, "model": model, "serving": {"chatTemplate": template}})
        engine = pod(objects, "decode")["spec"]["containers"][0]
        gateway = pod(objects, "gateway")["spec"]["containers"][0]
        assert flag(gateway["command"], "--chat-template") == template
        assert flag(engine["command"], "--chat-template") == template
        args = build_parser().parse_args(gateway["command"][1:])
        assert (args.chat_template, args.tokenizer) == (
            template,
            flag(gateway["command"], "--tokenizer"),
        )
        # The engines' model mounts are the gateway's, at the same paths.
        mounts = {m["mountPath"] for m in engine["volumeMounts"] if m["name"] == "models"}
        assert mounts == {"/models/weights"}
        assert mounts <= {m["mountPath"] for m in gateway["volumeMounts"]}
        assert gateway["image"] == engine["image"]


def _kubelet_expand(text: str, env: dict[str, str]) -> str:
    """A container command's ``$(NAME)`` references expanded as the kubelet
    does: ``$$`` is one ``$``, a defined name its value, anything else as is."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "$" and i + 1 < len(text):
            nxt = text[i + 1]
            if nxt == "$":
                out.append("$")
                i += 2
                continue
            end = text.find(")", i + 2) if nxt == "(" else -1
            if end >= 0 and text[i + 2 : end] in env:
                out.append(env[text[i + 2 : end]])
                i = end + 1
                continue
        out.append(text[i])
        i += 1
    return "".join(out)


def test_every_dollar_in_the_template_survives_the_kubelets_expansion():
    template = (
        "{{ '$(HOME) $(POD_NAME) $$x $x $( $' }}{% for m in messages %}{{ m.content }}{% endfor %}$"
    )
    objects = render({**SPEC, "serving": {"chatTemplate": template}})
    for role in ("decode", "gateway"):
        container = pod(objects, role)["spec"]["containers"][0]
        env = {e["name"]: e.get("value", "x") for e in container.get("env", [])}
        env.setdefault("HOME", "/home")
        env.setdefault("POD_NAME", "pod-0")
        value = flag(container["command"], "--chat-template")
        assert _kubelet_expand(value, env) == template, role
    assert _kubelet_expand("$(HOME) $$x", {"HOME": "/h"}) == "/h $x"  # the emulation expands


def test_serving_defaults_add_no_flags():
    objects = render({"model": {"name": "m"}, "kvTransfer": {"connector": "ZmqConnector"}})
    command = pod(objects, "decode")["spec"]["containers"][0]["command"]
    for name in ("--chat-template", "--tool-call-parser", "--enable-auto-tool-choice"):
        assert name not in command
    assert "--chat-template" not in pod(objects, "gateway")["spec"]["containers"][0]["command"]


def test_auto_tool_choice_false_turns_a_models_default_off():
    objects = render({**SPEC, "serving": {"enableAutoToolChoice": False}})
    command = pod(objects, "decode")["spec"]["containers"][0]["command"]
    assert "--no-enable-auto-tool-choice" in command
    assert "--enable-auto-tool-choice" not in command


@pytest.mark.parametrize(
    ("serving", "field"),
    [
        ({"enableAutoToolChoice": True}, "spec.serving: enableAutoToolChoice needs toolCallParser"),
        ({"toolCallParser": "json"}, "spec.serving.toolCallParser"),
        ({"reasoningParser": "qwen"}, "spec.serving.reasoningParser: .*qwen3.*deepseek_r1"),
        ({"chatTemplate": ""}, "spec.serving.chatTemplate"),
        ({"template": "x"}, "spec.serving.template: unknown field"),
    ],
)
def test_bad_serving_settings_are_refused_naming_the_field(serving, field):
    with pytest.raises(ValueError, match=field):
        parse_spec({"model": {"name": "m"}, "serving": serving})


def test_reasoning_parser_reaches_every_engine_pod_and_names_the_engines_parsers():
    """spec.serving.reasoningParser is --reasoning-parser on each engine (prefill,
    decode; the aggregated engine below), never on the gateway; the resource
    takes exactly the parsers the engine has."""
    import typing

    from pdfleet.engine.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
    from pdfleet.operator.resource import ServingSpec

    allowed = typing.get_args(
        typing.get_args(ServingSpec.model_fields["reasoning_parser"].annotation)[0]
    )
    assert sorted(allowed) == sorted(REASONING_PARSERS)
    objects = render({**SPEC, "serving": {"reasoningParser": "deepseek_r1"}})
    for role in ("prefill", "decode"):
        command = pod(objects, role)["spec"]["containers"][0]["command"]
        assert flag(command, "--reasoning-parser") == "deepseek_r1"
    assert "--reasoning-parser" not in pod(objects, "gateway")["spec"]["containers"][0]["command"]
    # Aggregated (no KV transfer): one engine role, the decode Deployment.
    objects = render({"model": {"name": "m"}, "serving": {"reasoningParser": "qwen3"}})
    command = pod(objects, "decode")["spec"]["containers"][0]["command"]
    assert flag(command, "--reasoning-parser") == "qwen3"
    # Unset: no flag.
    assert (
        "--reasoning-parser" not in pod(render(SPEC), "decode")["spec"]["containers"][0]["command"]
    )


# -- pdfleet up --------------------------------------------------------------------


def local_fleet(tmp_path: Path, spec) -> LocalFleet:
    service = load_inference_service(
        {
            "apiVersion": "pdfleet.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "svc"},
            "spec": spec,
        }
    )
    return LocalFleet(service, "/models/m", tmp_path, say=lambda _: None, fleet_secret="s" * 32)


def test_pdfleet_up_engines_get_the_serving_flags_and_their_own_event_ports(tmp_path):
    fleet = local_fleet(tmp_path, {**SPEC, "decode": {"replicas": 2}})
    children = [fleet._engine_child(r) for r in ("prefill", "decode", "decode")]
    endpoints = set()
    for child in children:
        argv = child.argv
        assert flag(argv, "--tool-call-parser") == "hermes"
        assert "--enable-auto-tool-choice" in argv
        assert load_chat_template(flag(argv, "--chat-template")) == TEMPLATE
        config = json.loads(flag(argv, "--kv-events-config"))
        assert config["enable_kv_cache_events"] is True
        pub, replay = fleet.kv_events[child.name]
        assert (config["endpoint"], config["replay_endpoint"]) == (pub, replay)
        assert pub.startswith("tcp://127.0.0.1:") and replay.startswith("tcp://127.0.0.1:")
        endpoints |= {pub, replay}
    assert len(endpoints) == 6  # every engine binds its own two ports
    # The engines file names each ready engine's streams.
    for child in children:
        child.mark_ready()
        child.alive = lambda: True
    fleet.engines = children
    fleet.write_engines_file()
    listed = json.loads(fleet.engines_file.read_text())["engines"]
    assert [(e["kv_events"], e["kv_events_replay"]) for e in listed] == [
        fleet.kv_events[c.name] for c in children
    ]
    # ... and the gateway reads it back through the same carrier.
    read = EnginesFileDiscovery(str(fleet.engines_file), []).load()
    assert [(e.name, e.kv_events, e.kv_events_replay) for e in read] == [
        (c.name, *fleet.kv_events[c.name]) for c in children
    ]


def test_pdfleet_up_gateway_renders_chat_prompts_with_the_engines_template(tmp_path):
    config = local_fleet(tmp_path, SPEC).gateway_config()
    assert config.chat_template == TEMPLATE
    assert config.tokenizer == "/models/m"
    assert load_chat_template(flag(config.to_cli_args(), "--chat-template")) == TEMPLATE
    plain = {**SPEC, "serving": {"toolCallParser": "hermes"}}
    assert local_fleet(tmp_path, plain).gateway_config().chat_template is None


def test_pdfleet_up_engines_get_the_reasoning_parser(tmp_path):
    fleet = local_fleet(tmp_path, {**SPEC, "serving": {"reasoningParser": "qwen3"}})
    for role in ("prefill", "decode"):
        assert flag(fleet._engine_child(role).argv, "--reasoning-parser") == "qwen3"


def test_pdfleet_up_without_kv_events_lists_no_streams(tmp_path):
    fleet = local_fleet(tmp_path, {**SPEC, "gateway": {"kvEvents": False}})
    child = fleet._engine_child("decode")
    assert "--kv-events-config" not in child.argv
    assert fleet.kv_events == {}


# -- spec.gateway: the stall watchdog and the overload queue -------------------------

GATEWAY_OVERLOAD = {
    "stallTimeoutSeconds": 7.5,
    "stallStepMultiple": 6,
    "queueTimeoutSeconds": 20,
    "maxQueuedRequests": 32,
    "stallMaxStepSeconds": 90,
}


def test_spec_gateway_stall_and_queue_settings_reach_both_gateways(tmp_path):
    from pdfleet.engine.cli import build_parser

    spec = {**SPEC, "gateway": GATEWAY_OVERLOAD}
    wanted = (7.5, 6.0, 20.0, 32)
    # The cluster's gateway: its rendered command line, parsed by the real CLI.
    pod = next(
        o
        for o in build_children("svc", parse_spec(spec), namespace="ns")
        if o["kind"] == "Deployment" and o["metadata"]["name"] == "svc-gateway"
    )
    args = build_parser().parse_args(
        pod["spec"]["template"]["spec"]["containers"][0]["command"][1:]
    )
    assert (
        args.stall_timeout,
        args.stall_step_multiple,
        args.queue_timeout,
        args.max_queued_requests,
    ) == wanted
    assert args.stall_max_step == 90
    # pdfleet up's gateway.
    config = local_fleet(tmp_path, spec).gateway_config()
    assert (
        config.stall_timeout,
        config.stall_step_multiple,
        config.queue_timeout,
        config.max_queued_requests,
    ) == wanted
    assert config.stall_max_step == 90
    # The defaults follow the engines (a floor of 5 s, 4 of its longest steps).
    default = local_fleet(tmp_path, SPEC).gateway_config()
    assert (default.stall_timeout, default.stall_step_multiple) == (5.0, 4.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stallTimeoutSeconds", 0),
        ("stallStepMultiple", -1),
        ("maxQueuedRequests", -2),
        ("stallTimeoutSeconds", float("inf")),
        ("stallTimeoutSeconds", float("nan")),
        ("stallTimeoutSeconds", 1e-9),
        ("stallTimeoutSeconds", True),
        ("stallTimeoutSeconds", "5"),
        ("stallStepMultiple", float("inf")),
        ("stallStepMultiple", 1e9),
        ("stallMaxStepSeconds", 0),
        ("stallMaxStepSeconds", float("nan")),
        ("queueTimeoutSeconds", float("inf")),
        ("queueTimeoutSeconds", 1e9),
        ("queueTimeoutSeconds", False),
        ("maxQueuedRequests", True),
        ("maxQueuedRequests", 10**12),
    ],
)
def test_bad_gateway_overload_settings_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        parse_spec({**SPEC, "gateway": {field: value}})


def test_pdfleet_up_flags_override_spec_gateway(tmp_path):
    import argparse

    from pdfleet.operator.local.cli import add_parser, apply_gateway_overrides

    parser = add_parser(argparse.ArgumentParser().add_subparsers())
    service = load_inference_service(
        {
            "apiVersion": "pdfleet.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "svc"},
            "spec": {**SPEC, "gateway": GATEWAY_OVERLOAD},
        }
    )
    apply_gateway_overrides(service, parser.parse_args(["--stall-timeout", "12"]))
    assert service.spec.gateway.stall_timeout_seconds == 12
    assert service.spec.gateway.stall_step_multiple == 6  # the file's, not overridden
    apply_gateway_overrides(service, parser.parse_args([]))  # no flag: unchanged
    assert service.spec.gateway.stall_timeout_seconds == 12
    apply_gateway_overrides(service, parser.parse_args(["--stall-max-step", "30"]))
    assert service.spec.gateway.stall_max_step_seconds == 30
    with pytest.raises(ValueError, match="--stall-timeout"):  # (a caller past argparse)
        apply_gateway_overrides(service, argparse.Namespace(stall_timeout=float("inf")))


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [
        ("up", "--stall-timeout", "0"),
        ("up", "--stall-timeout", "inf"),
        ("up", "--stall-timeout", "1e-9"),
        ("up", "--stall-step-multiple", "nan"),
        ("up", "--stall-max-step", "-inf"),
        ("gateway", "--stall-timeout", "inf"),
        ("gateway", "--stall-step-multiple", "nan"),
        ("gateway", "--stall-max-step", "0"),
        ("gateway", "--queue-timeout", "inf"),
        ("gateway", "--hold-timeout", "nan"),
        ("gateway", "--hold-timeout", "1e9"),
        ("gateway", "--idle-timeout", "inf"),
        ("gateway", "--request-timeout", "0"),
        ("gateway", "--scrape-interval", "1e-9"),
        ("gateway", "--first-token-timeout", "inf"),
        ("gateway", "--kv-host-weight", "nan"),
    ],
)
def test_out_of_range_gateway_flags_are_refused_naming_the_flag(command, flag, value, capsys):
    from pdfleet.engine.cli import build_parser

    argv = [command, flag, value]
    if command == "gateway":
        argv += ["--decode", "http://e"]
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err


@pytest.mark.parametrize("value", [True, "5", float("inf"), float("nan"), 1e-9, -1.0])
def test_a_gateway_config_built_in_code_refuses_what_its_flag_refuses(value):
    from pdfleet.engine.config.gateway import GatewayConfig

    with pytest.raises(ValueError, match="--stall-timeout"):
        GatewayConfig(decode=["http://e"], stall_timeout=value)


def test_pdfleet_up_says_which_kv_caches_were_set_and_which_were_sized(tmp_path, monkeypatch):
    """The memory line names the budget a role's kvCacheMemoryBytes set, and
    says "sized from the model and the free memory" only of the others."""
    from pdfleet.operator.local import cli

    spec = {
        **SPEC,
        "prefill": {"engine": {"kvCacheMemoryBytes": 256 * 2**20}},
    }
    fleet = local_fleet(tmp_path, spec)
    children = [fleet._engine_child(r) for r in ("prefill", "decode")]
    info = 'pdfleet_engine_cache_config_info{block_size="16",num_gpu_blocks="%d"} 1.0\n'
    for child, blocks in zip(children, (100, 200), strict=True):
        child.metrics_text = lambda blocks=blocks: info % blocks  # type: ignore[method-assign]
    monkeypatch.setattr(cli, "resident_bytes", lambda pid, tree=True: 0)
    monkeypatch.setattr(fleet, "all_children", lambda: children)
    text = cli.memory_report(fleet)
    assert "prefill-0 1,600 (0.25 GiB set)" in text, text
    assert "decode-0 3,200;" in text, text
    assert "set by kvCacheMemoryBytes where marked" in text, text
    assert "the others sized from the model" in text, text
    # Every engine set: nothing is said to be sized from the free memory.
    spec["decode"] = {"engine": {"kvCacheMemoryBytes": 2**30}}
    fleet = local_fleet(tmp_path, spec)
    children = [fleet._engine_child(r) for r in ("prefill", "decode")]
    for child in children:
        child.metrics_text = lambda: info % 10  # type: ignore[method-assign]
    monkeypatch.setattr(fleet, "all_children", lambda: children)
    text = cli.memory_report(fleet)
    assert "decode-0 160 (1.00 GiB set)" in text and "free memory" not in text, text


def test_pdfleet_up_keeps_batches_with_the_run_or_in_the_database_its_environment_names(
    tmp_path, monkeypatch
):
    """The Batch API's store locally: the run's folder, or the PostgreSQL database
    of $PDFLEET_BATCH_DATABASE_URL (then no folder, which the gateway would refuse
    beside it); a resource asking for a database Secret needs that variable."""
    monkeypatch.delenv("PDFLEET_BATCH_DATABASE_URL", raising=False)
    assert local_fleet(tmp_path, SPEC).gateway_config().data_dir == str(
        (tmp_path / "gateway-data").resolve()
    )
    with_secret = {**SPEC, "gateway": {"batch": {"databaseSecret": {"name": "db"}}}}
    with pytest.raises(ValueError, match=r"cannot read: set \$PDFLEET_BATCH_DATABASE_URL"):
        local_fleet(tmp_path, with_secret).gateway_config()
    monkeypatch.setenv("PDFLEET_BATCH_DATABASE_URL", "postgresql://u:p@db/x")
    for spec in (SPEC, with_secret):
        config = local_fleet(tmp_path, spec).gateway_config()
        assert config.data_dir is None
        assert "postgresql" not in " ".join(config.to_cli_args())


def test_pdfleet_up_runs_prefill_peer_pulls_as_the_resource_asks(tmp_path):
    """``spec.prefill.peerPull`` locally: the prefill engines lend to and pull from
    each other, the decode engines lend to them and still consume the prefill
    legs' KV (kv_both, identities that may do both), all publish KV events; the
    gateway decides where each prefill leg runs (--peer-pull)."""
    fleet = local_fleet(tmp_path, {**SPEC, "prefill": {"peerPull": True}})
    roles = {}
    for role in ("prefill", "decode"):
        child = fleet._engine_child(role)
        roles[role] = json.loads(flag(child.argv, "--kv-transfer-config"))["kv_role"]
        assert "--kv-events-config" in child.argv
        vouched = identity.EngineIdentity.read(
            child.env[identity.IDENTITY_FILE_ENV], child.env[identity.IDENTITY_AUTHORITY_ENV]
        )
        assert vouched.claims.role == "both" and vouched.claims.consumes, role
    assert roles == {"prefill": "kv_both", "decode": "kv_both"}
    plain = local_fleet(tmp_path / "plain", SPEC)._engine_child("prefill")
    assert json.loads(flag(plain.argv, "--kv-transfer-config"))["kv_role"] == "kv_producer"
    assert (
        identity.EngineIdentity.read(
            plain.env[identity.IDENTITY_FILE_ENV], plain.env[identity.IDENTITY_AUTHORITY_ENV]
        ).claims.role
        == "prefill"
    )
    config = fleet.gateway_config()
    assert config.peer_pull and config.prefix_blocks == 256
    assert not local_fleet(tmp_path, SPEC).gateway_config().peer_pull
