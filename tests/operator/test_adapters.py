"""spec.adapters: validation, rendering (init steps, volumes, --lora-modules), and
the operator loading and unloading them on running engines (kmock) without
changing the pod templates."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import pytest
from aiohttp import web
from helpers.kube_fake import (
    DEPLOYMENTS,
    IS_RESOURCE,
    NAMESPACE,
    SECRETS,
    inference_service,
    run,
    running_operator,
)

from pdfleet.engine.contracts import security
from pdfleet.engine.contracts.errors import ErrorBody
from pdfleet.engine.contracts.lora import already_loaded
from pdfleet.operator.adapter_sync import sync_adapters
from pdfleet.operator.fleet_secret import secret_value
from pdfleet.operator.handlers import OperatorConfig
from pdfleet.operator.local.rollout import lora_call
from pdfleet.operator.manifests import (
    ANNOTATION_ADAPTERS,
    ANNOTATION_ADAPTERS_KEY,
    build_children,
    template_adapters,
)
from pdfleet.operator.resource import parse_spec
from pdfleet.operator.roles import adapter_path

BASE: dict[str, Any] = {
    "model": {"name": "tiny"},
    "engine": {"device": "cpu", "blockSize": 16},
    "kvTransfer": {"connector": "ZmqConnector"},
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1},
}
FILE_A = {"name": "sql", "source": "file:///adapters/sql"}
FILE_B = {"name": "chat/v2", "source": "file:///adapters/chat"}
PVC = {"name": "pvc-one", "source": "pvc://loras/team/one"}
PVC_SAME_CLAIM = {"name": "pvc-two", "source": "pvc://loras/team/two"}
HUB = {"name": "hub", "source": "hf://org/hub-lora", "revision": "v1"}


def spec_with(*adapters: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {**copy.deepcopy(BASE), "adapters": [dict(a) for a in adapters], **extra}


def children(spec: dict[str, Any], live: dict[str, Any] | None = None) -> dict[Any, Any]:
    objects = build_children(
        "demo", parse_spec(spec), namespace=NAMESPACE, live_templates=live or {}
    )
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


def template(objects: dict[Any, Any], role: str) -> dict[str, Any]:
    return objects["Deployment", f"demo-{role}"]["spec"]["template"]


def command(objects: dict[Any, Any], role: str) -> list[str]:
    return template(objects, role)["spec"]["containers"][0]["command"]


def lora_modules(cmd: list[str]) -> list[str]:
    i = cmd.index("--lora-modules") + 1
    out = []
    while i < len(cmd) and not cmd[i].startswith("--"):
        out.append(cmd[i])
        i += 1
    return out


@pytest.mark.parametrize(
    ("adapters", "extra", "problem"),
    [
        ([FILE_A, {**FILE_B, "name": "sql"}], {}, r"adapters\[1\].name: 'sql' is given twice"),
        ([{**FILE_A, "name": "tiny"}], {}, "is the model's name"),
        ([{**FILE_A, "name": "-x"}], {}, r"adapters.0.name"),
        ([{**FILE_A, "source": "builtin://tiny-lora"}], {}, "ships no built-in LoRA adapters"),
        ([{**FILE_A, "source": "s3://bucket/x"}], {}, "not a supported adapter location"),
        ([{**FILE_A, "source": "file://relative"}], {}, "needs an absolute path"),
        ([{**FILE_A, "source": "file:///a/../b"}], {}, "holds '..'"),
        ([{**FILE_A, "source": "pvc://Bad_Claim/x"}], {}, "name the claim"),
        ([{**FILE_A, "source": "hf://org/r/model.gguf"}], {}, "an adapter is a repository"),
        ([{**FILE_A, "revision": "v1"}], {}, "revision applies to hf:// adapters only"),
        ([FILE_A], {"engine": {"enableLora": False}}, "engine.enableLora is false"),
        (
            [FILE_A],
            {"decode": {"engine": {"loraModules": ["x=/y"]}}},
            r"decode.engine.loraModules: with spec.adapters",
        ),
        ([{**FILE_A, "extra": 1}], {}, r"adapters.0.extra"),
    ],
)
def test_bad_adapters_are_refused_naming_the_field(adapters, extra, problem):
    spec = spec_with(*adapters)
    for key, value in extra.items():
        spec[key] = {**spec.get(key, {}), **value}
    with pytest.raises(ValueError, match=problem):
        parse_spec(spec)


CEL_CASES = [
    (spec_with(FILE_A, FILE_B), True),
    (spec_with(FILE_A, {**FILE_B, "name": "sql"}), False),
    (spec_with({**FILE_A, "name": "tiny"}), False),
    (spec_with({**FILE_A, "source": "builtin://x"}), False),
    (spec_with({**FILE_A, "revision": "v1"}), False),
    (spec_with(HUB), True),
    (spec_with(FILE_A, engine={"enableLora": False}), False),
    (spec_with(FILE_A, engine={"enableLora": True}), True),
    (spec_with(FILE_A, decode={"engine": {"enableLora": False}}), False),
    (spec_with(FILE_A, prefill={"engine": {"loraModules": ["x=/y"]}}), False),
    (spec_with(engine={"enableLora": False}), True),
]


@pytest.mark.parametrize(("spec", "ok"), CEL_CASES)
def test_the_crd_admits_and_refuses_the_same_adapters_as_the_model(spec, ok):
    from helpers.crd_checks import admit

    obj = {"apiVersion": "pdfleet.dev/v1alpha1", "kind": "InferenceService"}
    _, errors = admit({**obj, "metadata": {"name": "demo"}, "spec": spec})
    try:
        parse_spec(spec)
        parsed = True
    except ValueError:
        parsed = False
    assert (not errors, parsed) == (ok, ok), errors


def test_hub_fields_are_accepted_for_hf_adapters_of_a_builtin_model():
    spec = spec_with(HUB)
    spec["model"] = {"name": "tiny", "tokenSecret": {"name": "hf"}, "cache": {"claim": "hub"}}
    parse_spec(spec)  # an hf:// adapter uses them
    spec["adapters"] = [FILE_A]
    with pytest.raises(ValueError, match="tokenSecret applies to hf:// models only"):
        parse_spec(spec)


def test_adapters_turn_lora_on_in_both_roles_and_are_passed_as_lora_modules():
    spec = spec_with(FILE_A, PVC, HUB)
    spec["model"] = {"name": "tiny", "tokenSecret": {"name": "hf", "key": "t"}}
    spec["model"]["cache"] = {"claim": "hub-cache"}
    objects = children(spec)
    for role in ("prefill", "decode"):
        cmd = command(objects, role)
        assert "--enable-lora" in cmd
        assert cmd[cmd.index("--max-loras") + 1] == "4"
        assert lora_modules(cmd) == [
            "sql=/adapters/sql",
            "pvc-one=/adapters/pvc/loras/team/one",
            f"hub={adapter_path(parse_spec(spec).adapters[2])}",
        ]
        pod = template(objects, role)["spec"]
        volumes = {v["name"]: v for v in pod["volumes"]}
        claims = [v for v in volumes.values() if "persistentVolumeClaim" in v]
        assert {v["persistentVolumeClaim"]["claimName"] for v in claims} == {"loras", "hub-cache"}
        assert volumes["hf-token"]["secret"]["secretName"] == "hf"
        (fetch,) = [c for c in pod["initContainers"] if c["name"].startswith("fetch-adapter-")]
        assert fetch["command"][:4] == ["pdfleet", "fetch-model", "hf://org/hub-lora", "--adapter"]
        assert fetch["command"][fetch["command"].index("--revision") + 1] == "v1"
        assert fetch["command"][fetch["command"].index("--cache-dir") + 1] == "/hf-cache"
        init_mounts = {m["name"]: m for m in fetch["volumeMounts"]}
        assert {"hf-cache", "hf-token", "adapters-hf"} <= set(init_mounts)
        env = {e["name"]: e.get("value") for e in fetch["env"]}
        assert env["HF_TOKEN_PATH"] == "/etc/pdfleet/hf-token/token"
        main = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
        assert main["adapters-hf"]["readOnly"]
        # The engine may fetch hf:// adapters loaded at run time: the same cache
        # (writable), token file and endpoint as the init step.
        assert not main["hf-cache"].get("readOnly") and main["hf-token"]["readOnly"]
        engine_env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert engine_env["HF_HUB_CACHE"] == "/hf-cache"
        assert engine_env["HF_TOKEN_PATH"] == "/etc/pdfleet/hf-token/token"
    # The gateway needs none of it.
    gateway = template(objects, "gateway")["spec"]
    assert not [c for c in gateway["initContainers"] if c["name"].startswith("fetch-adapter-")]
    assert "--lora-modules" not in gateway["containers"][0]["command"]
    # maxLoras from the engine section wins; no adapters, no LoRA.
    spec["engine"]["maxLoras"] = 8
    cmd = command(children(spec), "decode")
    assert cmd[cmd.index("--max-loras") + 1] == "8"
    del spec["engine"]["maxLoras"]
    spec["engine"]["maxCpuLoras"] = 2
    cmd = command(children(spec), "decode")
    assert cmd[cmd.index("--max-loras") + 1] == "2"
    assert "--enable-lora" not in command(children(BASE), "decode")


def test_an_adapter_change_keeps_the_template_a_new_claim_changes_it():
    first = children(spec_with(FILE_A, PVC, HUB))
    live = {role: template(first, role) for role in ("prefill", "decode")}
    # Remove a file:// adapter, add one, add a pvc:// one on the mounted claim.
    second = children(spec_with(FILE_B, PVC, PVC_SAME_CLAIM, HUB), live)
    for role in ("prefill", "decode"):
        assert template(second, role) == live[role]
    # Without the running template (a first rollout), the spec's list is rendered.
    fresh = children(spec_with(FILE_B, PVC, PVC_SAME_CLAIM, HUB))
    assert lora_modules(command(fresh, "decode"))[0] == "chat/v2=/adapters/chat"
    # Removing an hf:// adapter, adding one or changing its revision: the
    # engines fetch it themselves, so the template stays too.
    other = {"name": "hub2", "source": "hf://org/other"}
    for adapters in [
        (FILE_B, PVC),
        (FILE_B, PVC, HUB, other),
        (FILE_A, PVC, {**HUB, "revision": "v2"}),
    ]:
        for role in ("prefill", "decode"):
            assert template(children(spec_with(*adapters), live), role) == live[role]
    # A new claim is a new volume: the template changes, with every adapter.
    third = children(
        spec_with(FILE_B, PVC, {**PVC, "name": "pvc-two", "source": "pvc://more/x"}), live
    )
    decode = template(third, "decode")
    assert decode != live["decode"]
    assert [m.split("=")[0] for m in lora_modules(command(third, "decode"))] == [
        "chat/v2",
        "pvc-one",
        "pvc-two",
    ]
    assert (
        template_adapters(decode)[0] == decode["metadata"]["annotations"][ANNOTATION_ADAPTERS_KEY]
    )
    # Another change to the pods (here the engine flags) renders the spec's list too.
    changed = spec_with(FILE_B, PVC, HUB)
    changed["engine"]["maxNumSeqs"] = 7
    rolled = template(children(changed, live), "decode")
    assert [a.name for a in template_adapters(rolled)[1]] == ["chat/v2", "pvc-one", "hub"]


# --------------------------------------------------------------------------
# the operator, against kmock and two fake engines


class FakeEngine:
    """An engine's adapter API: /v1/models, load and unload, fleet token only."""

    def __init__(self, served: dict[str, str], secret_of: Any) -> None:
        self.served = dict(served)
        self.unlisted: set[str] = set()
        """Served but not yet in the list: loaded by someone else (the
        gateway) between a caller's listing and its load."""
        self.calls: list[tuple[str, str]] = []
        self.polls = 0
        self.secret_of = secret_of
        self.port = 0

    def _authorized(self, request: web.Request) -> bool:
        token = security.bearer_token(request.headers.get("Authorization"))
        return security.key_matches(token, [security.fleet_token(self.secret_of())])

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"code": 401}}, status=401)
        self.polls += 1
        cards = [{"id": "tiny", "parent": None, "root": "/models/tiny"}]
        cards += [self.card(n) for n in self.served if n not in self.unlisted]
        return web.json_response({"object": "list", "data": cards})

    def card(self, name: str) -> dict[str, Any]:
        root = self.served[name]
        card = {"id": name, "parent": "tiny", "root": root}
        if root.startswith("hf://"):  # fetched: the engine reports source and revision
            source, _, revision = root.partition("@")
            card.update(root=f"/hf-cache/{source}", source=source, revision=revision or None)
        return card

    async def model(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"code": 401}}, status=401)
        name = request.match_info["name"]
        if name not in self.served:
            return web.Response(body=ErrorBody("no such model", 404, "model").encode(), status=404)
        return web.json_response(self.card(name))

    async def load(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"code": 403}}, status=403)
        body = await request.json()
        self.calls.append(("load", body["lora_name"]))
        path = body["lora_path"]
        if body.get("revision"):
            path += "@" + body["revision"]
        if body["lora_name"] in self.served:  # the engine's answer (vLLM's 400)
            same = self.served[body["lora_name"]] == path
            taken = already_loaded(body["lora_name"], same)
            return web.Response(body=taken.encode(), status=taken.status)
        self.served[body["lora_name"]] = path
        return web.Response(text="Success")

    async def unload(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"code": 403}}, status=403)
        body = await request.json()
        self.calls.append(("unload", body["lora_name"]))
        self.unlisted.discard(body["lora_name"])
        if self.served.pop(body["lora_name"], None) is None:
            missing = ErrorBody("not loaded", 404, "lora_name")
            return web.Response(body=missing.encode(), status=404)
        return web.Response(text="Success")

    async def start(self) -> web.AppRunner:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{name:.+}", self.model)
        app.router.add_post("/v1/load_lora_adapter", self.load)
        app.router.add_post("/v1/unload_lora_adapter", self.unload)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return runner


def engine_pod(name: str, role: str, port: int, rendered: dict[str, Any]) -> dict[str, Any]:
    """A running pod made from the role's rendered template (its annotations and
    volumes), answering on ``port``."""
    meta = rendered["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NAMESPACE,
            "labels": dict(meta["labels"]),
            "annotations": dict(meta.get("annotations") or {}),
        },
        "spec": {
            "volumes": rendered["spec"]["volumes"],
            "containers": [
                {
                    "name": "engine",
                    "env": rendered["spec"]["containers"][0].get("env", []),
                    "ports": [{"name": "http", "containerPort": port}],
                }
            ],
        },
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
    }


def reconciles(k: Any) -> float:
    """Successful reconciles so far (each patch of the spec makes one)."""
    return k.state.reconciles.labels("ok")._value.get()


def test_operator_loads_and_unloads_adapters_on_running_engines_without_rolling_them():
    v1 = spec_with(FILE_A, HUB)
    rendered = children(v1)
    parsed = parse_spec(v1)
    started = {a.name: adapter_path(a) for a in parsed.adapters}
    clusters: list[Any] = []

    def secret() -> bytes:
        return secret_value(clusters[0].get(SECRETS, "demo-fleet"))

    # Both engines started with the template's adapters; one also serves a stray one.
    engines = {
        "decode": FakeEngine({**started, "stray": "/tmp/stray"}, secret),
        "prefill": FakeEngine(started, secret),
    }
    # A pod from a template without spec.adapters (LoRA set in its engine section).
    legacy = FakeEngine({"manual": "/opt/manual"}, secret)

    async def scenario():
        runners = [await e.start() for e in [*engines.values(), legacy]]
        pods = [
            engine_pod(f"demo-{role}-a", role, e.port, template(rendered, role))
            for role, e in engines.items()
        ]
        pods.append(
            engine_pod("demo-decode-old", "decode", legacy.port, template(children(BASE), "decode"))
        )
        try:
            config = OperatorConfig(timer_interval_seconds=1.0, rollout_poll_seconds=0.3)
            async with running_operator([inference_service("demo", v1), *pods], config) as k:
                clusters.append(k)
                await k.wait_for(
                    lambda: set(engines["decode"].served) == {"sql", "hub"}, what="stray unloaded"
                )
                await k.wait_for(
                    lambda: k.names(DEPLOYMENTS) >= {"demo-prefill", "demo-decode"},
                    what="engine deployments",
                )
                lives = {
                    role: copy.deepcopy(k.get(DEPLOYMENTS, f"demo-{role}")["spec"]["template"])
                    for role in ("prefill", "decode")
                }
                live = lives["decode"]
                assert (
                    live["metadata"]["annotations"][ANNOTATION_ADAPTERS]
                    == (
                        template(rendered, "decode")["metadata"]["annotations"][ANNOTATION_ADAPTERS]
                    )
                )
                # Remove sql, add chat/v2 (file://): loaded and unloaded in place.
                done = reconciles(k)
                await k.patch(IS_RESOURCE, "demo", {"spec": {"adapters": [HUB, FILE_B]}})
                for engine in engines.values():
                    await k.wait_for(
                        lambda e=engine: (
                            e.served == {"hub": started["hub"], "chat/v2": "/adapters/chat"}
                        ),
                        what="chat/v2 loaded, sql unloaded",
                    )
                await k.wait_for(lambda: reconciles(k) > done, what="the patch reconciled")
                # The pods were not rolled: the templates are what they were.
                for role in ("prefill", "decode"):
                    assert k.get(DEPLOYMENTS, f"demo-{role}")["spec"]["template"] == lives[role]
                # A new hf:// adapter: the engines fetch it, given its source
                # (no pod rolls); then a new revision of one they serve (unloaded
                # and loaded again at that revision) and hub2 removed (unloaded).
                extra = {"name": "hub2", "source": "hf://org/other"}
                moved = {**HUB, "revision": "v2"}
                for adapters, want in [
                    ([HUB, FILE_B, extra], {"hub2": "hf://org/other"}),
                    ([moved, FILE_B], {"hub": "hf://org/hub-lora@v2"}),
                ]:
                    await k.patch(IS_RESOURCE, "demo", {"spec": {"adapters": adapters}})
                    names = {a["name"] for a in adapters}
                    for engine in engines.values():
                        await k.wait_for(
                            lambda e=engine, n=names, w=want: (
                                set(e.served) == n and all(e.served[a] == p for a, p in w.items())
                            ),
                            what=f"engines serve {sorted(names)}",
                        )
                # Two more refreshes of every engine: nothing more changes, and
                # the pods were never rolled.
                polls = {role: e.polls for role, e in engines.items()}
                calls = {role: len(e.calls) for role, e in engines.items()}
                await k.wait_for(
                    lambda: all(e.polls >= polls[role] + 2 for role, e in engines.items()),
                    what="two more refreshes",
                )
                assert {role: len(e.calls) for role, e in engines.items()} == calls
                for role in ("prefill", "decode"):
                    assert k.get(DEPLOYMENTS, f"demo-{role}")["spec"]["template"] == lives[role]
        finally:
            for runner in runners:
                await runner.cleanup()
        for engine in engines.values():
            assert ("load", "hub2") in engine.calls and ("unload", "hub2") in engine.calls
            assert engine.served == {"hub": "hf://org/hub-lora@v2", "chat/v2": "/adapters/chat"}
        assert ("unload", "stray") in engines["decode"].calls
        assert legacy.calls == [] and legacy.served == {"manual": "/opt/manual"}

    run(scenario())


def test_a_load_answered_name_taken_is_done_only_when_the_card_shows_the_wanted_adapter():
    """The race of the operator's and ``pdfleet up``'s adapter sync with the
    gateway's lazy load: the adapter is loaded between their listing and
    their load, which the engine answers with vLLM's 400 naming lora_name.
    Loaded from the wanted files, that is no error; from others, it is."""
    secret = b"fleet-secret"
    token = security.fleet_token(secret)
    spec = spec_with(FILE_A)
    wanted = {a.name: adapter_path(a) for a in parse_spec(spec).adapters}
    same = FakeEngine(wanted, lambda: secret)
    other = FakeEngine({name: "/elsewhere" for name in wanted}, lambda: secret)
    for engine in (same, other):
        engine.unlisted = set(wanted)
    rendered = template(children(spec), "decode")

    async def scenario() -> None:
        runners = [await e.start() for e in (same, other)]
        try:
            pods = [
                engine_pod(f"demo-decode-{i}", "decode", e.port, rendered)
                for i, e in enumerate((same, other))
            ]
            changes = await sync_adapters(pods, parse_spec(spec), token=token)
            by_pod = {c.pod: c for c in changes}
            assert set(by_pod) == {"demo-decode-0", "demo-decode-1"}
            assert by_pod["demo-decode-0"].error is None
            assert "lora_name" in (by_pod["demo-decode-1"].error or "")
            # pdfleet up's calls, against the same two engines.
            headers = {"Authorization": f"Bearer {token}"}
            for engine in (same, other):
                engine.unlisted = set(wanted)
            with httpx.Client(headers=headers) as http:
                for adapter, path in wanted.items():
                    url = f"http://127.0.0.1:{same.port}"
                    await asyncio.to_thread(lora_call, http, url, "a", "load", adapter, path)
                    url = f"http://127.0.0.1:{other.port}"
                    with pytest.raises(
                        RuntimeError, match="b: load of adapter .* failed.*lora_name"
                    ):
                        await asyncio.to_thread(lora_call, http, url, "b", "load", adapter, path)
        finally:
            for runner in runners:
                await runner.cleanup()

    run(scenario())


def test_lora_limits_without_adapters_say_to_drop_them():
    from pdfleet.operator.compat import check_service

    spec = parse_spec(spec_with(engine={**BASE.get("engine", {}), "maxLoraRank": 8}))
    problems = [str(p) for p in check_service(spec)]
    assert any(
        "spec.engine.maxLoraRank" in p and "drop maxLoraRank, or list spec.adapters" in p
        for p in problems
    ), problems
