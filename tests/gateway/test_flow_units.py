"""Flow control's pure parts: the fair queue's order, the tenants file's
checks, the token bucket, a ticket's release, a request's cost."""

from __future__ import annotations

import asyncio

import pytest

from pdfleet.engine.config.gateway import GatewayConfig
from pdfleet.engine.contracts.security import caller_id
from pdfleet.engine.gateway.admission import Admission, Overloaded
from pdfleet.engine.gateway.fair_queue import FairQueue, Waiter
from pdfleet.engine.gateway.flow.control import FairClock, FlowControl, TokenBucket
from pdfleet.engine.gateway.flow.gate import FlowGate, FlowRefused
from pdfleet.engine.gateway.flow.tenants import ANONYMOUS, Tenants
from pdfleet.engine.gateway.metrics import GatewayMetrics


def order(pushes: list[tuple[str, int, float]], pops: int, started: bool = True) -> list[str]:
    """Tenants in the order the queue serves requests pushed as (tenant, band,
    cost over weight), each tagged by its band's fair clock at push."""

    async def run() -> list[str]:
        q = FairQueue()
        clocks: dict[int, FairClock] = {}
        loop = asyncio.get_running_loop()
        for tenant, band, cost in pushes:
            clock = clocks.setdefault(band, FairClock())
            q.push(Waiter(loop.create_future(), tenant, band, clock.tag(tenant, cost)))
        out = []
        for _ in range(pops):
            w = q.pop()
            assert w is not None
            clocks[w.band].started(w.tenant, w.tag)
            out.append(w.tenant)
        assert len(q) == len(pushes) - pops
        return out

    return asyncio.run(run())


def test_bands_are_strict_and_weights_share_by_cost():
    pushes = [("a", 1, 1.0)] * 6 + [("b", 1, 0.5)] * 6 + [("vip", 0, 100.0)]
    got = order(pushes, 10)
    assert got[0] == "vip"
    # b's requests cost half of a's: two of b's per one of a's.
    assert got[1:10].count("b") == 6 and got[1:10].count("a") == 3


def test_an_idle_tenant_banks_no_credit():
    clock = FairClock()
    for _ in range(8):
        clock.started("busy", clock.tag("busy", 1.0))
    # A newcomer starts at the clock (7), not at 0, where the busy tenant's
    # next request (8) is: they alternate, the newcomer does not take every slot.
    assert clock.tag("new", 1.0) == 7.0
    assert clock.tag("busy", 1.0) == 8.0


def test_a_tenant_whose_requests_wait_at_the_engine_is_not_idle():
    """Requests start out of their tags' order when the engine has room for
    all of them (its own queue orders them by the same tags): a tenant whose
    requests all went to the engine and wait there keeps its place, though a
    later tag of another tenant started. Once they all started (or ended
    without starting) it is idle again: its next request starts at the clock."""
    clock = FairClock()
    narrow = [clock.tag("narrow", 1.0) for _ in range(4)]
    wide = [clock.tag("wide", 100.0) for _ in range(3)]
    assert narrow == [0.0, 1.0, 2.0, 3.0] and wide == [0.0, 100.0, 200.0]
    clock.started("wide", wide[2])  # the engine served the last wide one first
    assert clock.clock == 200.0
    later = clock.tag("narrow", 1.0)
    assert later == 4.0  # its own finish, not the clock: its requests wait
    for tag in [*narrow, later]:
        clock.started("narrow", tag)
    clock.started("wide", wide[1])
    clock.dropped("wide")  # (a request that never started: it waits no more)
    assert clock.tag("narrow", 1.0) == 200.0


def test_a_tag_that_waits_long_holds_back_no_other_tenant():
    """One request that waits long to start (a slow first event) keeps its own
    tenant's place, and nobody else's: a newcomer starts at the clock, not at
    the old tag, so it banks no credit while the request waits; the clock's
    bookkeeping stays one count per tenant with requests waiting."""
    clock = FairClock()
    stuck = clock.tag("slow", 1.0)
    for _ in range(500):
        clock.started("busy", clock.tag("busy", 1.0))
    assert clock.clock == 499.0
    assert clock.tag("new", 1.0) == 499.0  # the clock, not the stuck tag (0)
    assert clock.tag("slow", 1.0) == stuck + 1.0  # its own place: it waits
    assert set(clock.waiting) == {"new", "slow"}
    clock.dropped("slow")
    clock.dropped("slow")
    assert clock.tag("slow", 1.0) == 499.0  # idle again: at the clock


def test_a_removed_waiter_leaves_the_counts_right():
    async def run() -> None:
        q = FairQueue()
        w = Waiter(asyncio.get_running_loop().create_future(), "t", 0, 1.0)
        q.push(w)
        assert q.by_tenant == {"t": 1} and q.ahead_of(0) == 1 and q.ahead_of(-1) == 0
        assert q.remove(w) and not q.remove(w)
        assert len(q) == 0 and q.pop() is None and not q.by_tenant

    asyncio.run(run())


@pytest.mark.parametrize(
    ("data", "match"),
    [
        ({"tenants": [{"name": "x", "keys": ["k"], "wieght": 2}]}, "wieght"),
        ({"tenants": [{"name": "x", "keys": []}]}, "keys"),
        ({"tenants": [{"name": "x", "keys": ["k"], "weight": 0}]}, "weight"),
        ({"tenants": [{"name": "x", "keys": ["k"], "priority": 1.5}]}, "priority"),
        (
            {"tenants": [{"name": "x", "keys": ["k"], "client_priority": "maybe"}]},
            "client_priority",
        ),
        ({"tenants": [{"name": "x", "keys": ["k"]}, {"name": "y", "keys": ["k"]}]}, "twice"),
        ({"tenants": [{"name": "anonymous", "keys": ["k"]}]}, "reserved"),
        ({"default": {"tokens_per_second": -1}}, "tokens_per_second"),
        ({"tenant": []}, "tenant"),
        ({"prompt_token_weight": 2}, "prompt_token_weight"),
        ({"prompt_token_weight": "half"}, "prompt_token_weight"),
    ],
)
def test_a_bad_tenants_file_names_what_is_wrong(data, match):
    with pytest.raises(ValueError, match=match):
        Tenants.parse(data)


def test_keys_map_to_their_tenant_and_unlisted_keys_are_their_own():
    t = Tenants.parse(
        {"default": {"weight": 2}, "tenants": [{"name": "g", "keys": ["k1", "k2"], "priority": -1}]}
    )
    assert t.tenant(caller_id("k1")).name == t.tenant(caller_id("k2")).name == "g"
    other = t.tenant(caller_id("k3"))
    assert other.name == caller_id("k3") and other.policy.weight == 2
    assert t.tenant("addr:10.0.0.1").name == ANONYMOUS
    assert t.keys == ["k1", "k2"]


def test_a_token_bucket_refuses_past_its_rate_and_lets_a_large_cost_through_when_full():
    b = TokenBucket(rate=10.0, burst=10.0)
    now = b.at
    assert b.wait_for(50.0, now) == 0.0  # larger than the burst: passes when full
    b.take(50.0)
    assert b.wait_for(1.0, now) == pytest.approx(4.1)  # 41 tokens of debt at 10/s


def test_inflight_limits_refuse_with_retry_after_and_release_gives_room():
    config = GatewayConfig(decode=["http://e"])
    metrics = GatewayMetrics()
    tenants = Tenants.parse({"tenants": [{"name": "t", "keys": ["k"], "max_inflight_tokens": 300}]})
    gate = FlowGate(config, tenants, Admission(config, metrics), metrics)
    tenant = gate.tenant(caller_id("k"))
    body = {"prompt": "x", "max_tokens": 100, "n": 2}
    assert gate.cost(body, 10) == 210.0
    first = gate.admit(tenant, dict(body), 10, 0)
    with pytest.raises(FlowRefused) as refused:
        gate.admit(tenant, dict(body), 10, 0)
    overloaded = refused.value.overloaded
    assert isinstance(overloaded, Overloaded) and overloaded.status == 429
    assert "max_inflight_tokens" in overloaded.message and overloaded.retry_after >= 1
    first.ticket.release()
    first.ticket.release()  # once only
    assert gate.control.states["t"].inflight == 0
    gate.admit(tenant, dict(body), 10, 0)


def test_flow_control_counts_outcomes_per_tenant():
    metrics = GatewayMetrics()
    control = FlowControl(metrics)
    tenants = Tenants.parse({"tenants": [{"name": "t", "keys": ["k"], "max_queued": 0}]})
    with pytest.raises(Overloaded):
        control.admit(tenants.tenant(caller_id("k")), 1.0, 0, queued=0)
    text = metrics.registry.get_sample_value(
        "pdfleet_gateway_tenant_requests_total", {"tenant": "t", "outcome": "queue_full"}
    )
    assert text == 1.0


def test_an_unanalyzed_prompt_is_estimated_from_its_text_not_the_bodys_size():
    """A request routed without analyzing its prompt (one engine, no queue) is
    charged its prompt's characters over four, whatever else its body holds;
    token ids count as they are, every prompt of a batch and every message."""
    config = GatewayConfig(decode=["http://e"])
    metrics = GatewayMetrics()
    gate = FlowGate(config, Tenants(), Admission(config, metrics), metrics)
    tenant = gate.tenant(caller_id("k"))
    body = {
        "model": "tiny",
        "prompt": "x" * 40,
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    assert gate.admit(tenant, body, None, 4000).ticket.cost == 10 + 8
    assert (
        gate.admit(tenant, {"prompt": [1, 2, 3], "max_tokens": 8}, None, 4000).ticket.cost == 3 + 8
    )
    batch = {"prompt": ["x" * 8, [1, 2]], "max_tokens": 8}
    assert gate.admit(tenant, batch, None, 4000).ticket.cost == 2 + 2 + 2 * 8
    chat = {"messages": [{"role": "user", "content": "x" * 32}], "max_tokens": 8}
    assert gate.admit(tenant, chat, None, 4000).ticket.cost == 4 + 9 + 8  # markers, "user" + text
    assert gate.admit(tenant, {"prompt": 7, "max_tokens": 8}, None, 400).ticket.cost == 100 + 8
    # A token-id list that is not all ids: by the body's size.
    mixed = {"prompt": [1, "x" * 4000], "max_tokens": 8}
    assert gate.admit(tenant, mixed, None, 4000).ticket.cost == 1000 + 2 * 8


def test_a_truncated_prompt_is_charged_what_the_engine_keeps():
    config = GatewayConfig(decode=["http://e"])
    metrics = GatewayMetrics()
    gate = FlowGate(config, Tenants(), Admission(config, metrics), metrics)
    tenant = gate.tenant(caller_id("k"))
    body = {"prompt": "x" * 4000, "max_tokens": 8, "truncate_prompt_tokens": 10}
    assert gate.admit(tenant, body, None, 4000).ticket.cost == 10 + 8
    assert gate.admit(tenant, {**body, "truncate_prompt_tokens": 5000}, None, 4000).ticket.cost == (
        1000 + 8
    )
    # Each prompt of a batch as the engine keeps it; the value in every form
    # the engine's request model reads.
    batch = {"prompt": [[1] * 1000] * 16, "max_tokens": 0, "truncate_prompt_tokens": 10}
    assert gate.admit(tenant, batch, None, 4000).ticket.cost == 16 * 10
    for keep in ("10", 10.0, "10.0", " 10 "):
        assert (
            gate.admit(tenant, {**body, "truncate_prompt_tokens": keep}, None, 4000).ticket.cost
            == 18
        )
    assert gate.admit(tenant, {**body, "truncate_prompt_tokens": True}, None, 4000).ticket.cost == 9
    # A batch analyzed by its first prompt costs what all its prompts do, the
    # others at the first one's measured tokens per estimated token (digits:
    # a token each, where the estimate counts four).
    texts = {"prompt": ["x" * 400] * 8, "max_tokens": 0}
    assert gate.admit(tenant, texts, 100, 4000).ticket.cost == 8 * 100
    digits = {"prompt": ["7" * 2000] * 16, "max_tokens": 0}
    assert gate.admit(tenant, digits, 2000, 4000).ticket.cost == 16 * 2000
    # An English first prompt does not make the others cheap: each is
    # estimated by its own text (a digit a token).
    mixed = {"prompt": ["x" * 400] + ["7" * 2000] * 3, "max_tokens": 0}
    assert gate.admit(tenant, mixed, 100, 4000).ticket.cost >= 100 + 3 * 2000
    # Token ids the engine reads as such (a whole float among them).
    ids = {"prompt": [1.0] + [5] * 2000, "max_tokens": 0}
    assert gate.admit(tenant, ids, 0, 4003).ticket.cost == 2001
    # A chat request's truncation caps its estimate too.
    chat = {"messages": [{"role": "user", "content": "x" * 4000}], "max_tokens": 0}
    assert gate.admit(tenant, {**chat, "truncate_prompt_tokens": 10}, None, 4000).ticket.cost == 10


def test_what_a_chat_template_renders_is_charged_beyond_the_messages_text():
    """Tools, a message's tool calls and name, the template's markers per
    message, and text beyond ASCII (a token a character) are charged: a body
    shaped to be charged little costs what it will cost the engine."""
    config = GatewayConfig(decode=["http://e"])
    metrics = GatewayMetrics()
    gate = FlowGate(config, Tenants(), Admission(config, metrics), metrics)
    tenant = gate.tenant(caller_id("k"))

    def cost(messages: list, **extra) -> float:
        body = {"messages": messages, "max_tokens": 0, **extra}
        return gate.admit(tenant, body, None, 10).ticket.cost

    user = {"role": "user", "content": "hi"}
    plain = cost([user])
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 4000}}
    assert cost([user], tools=[tool]) >= plain + 1000
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "a" * 4000}}
    assert cost([user, {"role": "assistant", "tool_calls": [call]}]) >= plain + 1000
    assert cost([{**user, "name": "n" * 4000}]) >= plain + 1000
    assert cost([{"role": "user", "content": ""}] * 1000) >= 4000
    assert cost([{"role": "user", "content": "字" * 1000}]) >= 1000


def test_the_prompt_token_weight_changes_the_share_and_never_the_limits():
    """An n=1 request of a 10-token prompt and 8 output tokens against an n=64
    one: with prompt tokens in full, fair share gives the n=1 key 8 output
    tokens per 18 of its share; weighted 0.1, 8 per 9. The in-flight limit
    counts the whole cost either way."""
    config = GatewayConfig(decode=["http://e"])
    shares = {}
    for weight in (1.0, 0.1):
        metrics = GatewayMetrics()
        tenants = Tenants.parse(
            {
                "prompt_token_weight": weight,
                "tenants": [{"name": "t", "keys": ["k"], "max_inflight_tokens": 40}],
            }
        )
        gate = FlowGate(config, tenants, Admission(config, metrics), metrics)
        tenant = gate.tenant(caller_id("k"))
        body = {"prompt": "x", "max_tokens": 8}
        first = gate.admit(tenant, dict(body), 10, 0)
        second = gate.admit(tenant, dict(body), 10, 0)
        shares[weight] = second.ticket.tag - first.ticket.tag
        assert first.ticket.cost == 18.0
        with pytest.raises(FlowRefused, match="max_inflight_tokens"):
            gate.admit(tenant, dict(body), 10, 0)  # 54 > 40 in both
    assert shares == {1.0: 18.0, 0.1: pytest.approx(9.0)}
