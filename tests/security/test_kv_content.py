"""KV is only ever used for the prompt it was computed from.

The attack: a decode leg for prompt B carrying the signed params of prompt A's
prefill leg. Before content binding the decode engine pulled A's blocks, used
them as B's prefix (wrong output) and cached them under B's hashes, so every
later request for B got A's KV. Now the params carry A's block hash chain,
the decode engine hashes B's own tokens, finds they differ, pulls nothing and
recomputes. The same check catches honest skew: two roles rendering a chat
with different templates.
"""

from __future__ import annotations

import dataclasses

from helpers.security_pair import CLIENT_KEY, INTERNAL_KEY, post, prefill_leg, prompt, text_of

from pdfleet.engine.contracts import kv_params, security
from pdfleet.engine.contracts.block_hash import get_hash_fn, prompt_block_hashes

MISMATCHES = "pdfleet_engine_kv_transfer_content_mismatches_total"
TRANSFERS = "pdfleet_engine_kv_transfers_total"
PULLED = "pdfleet_engine_kv_transfer_blocks_pulled_total"


def body(seed: int, **extra) -> dict:
    return {"prompt": prompt(seed), "max_tokens": 12, "temperature": 0, "ignore_eos": True, **extra}


def reference(pair, request: dict) -> str:
    """The prompt computed on the prefill engine alone (no params: plain serving)."""
    return text_of(post(pair.prefill.url + "/v1/completions", request))


def test_another_prompts_signed_params_are_not_used_nor_cached_and_its_lease_survives(pair):
    a, b = body(9101), body(9102)
    params_a = prefill_leg(pair, a)
    assert len(params_a["remote_block_ids"]) == 6
    want_b = reference(pair, b)
    before = {m: pair.metric("decode", m) for m in (MISMATCHES, TRANSFERS, PULLED)}
    # B's decode leg with A's genuine params, with the fleet token (an insider, or a
    # gateway bug): B's own answer, nothing pulled, the mismatch counted.
    got = text_of(post(pair.decode.url + "/v1/completions", {**b, "kv_transfer_params": params_a}))
    assert got == want_b
    assert pair.metric("decode", MISMATCHES) == before[MISMATCHES] + 1
    assert pair.metric("decode", TRANSFERS) == before[TRANSFERS]
    assert pair.metric("decode", PULLED) == before[PULLED]
    # Nothing was cached under B's hashes but B's own KV: later plain requests for B
    # (anyone's, and with the decode engine's cache hit) are right.
    for _ in range(2):
        r = post(pair.decode.url + "/v1/completions", b)
        assert text_of(r) == want_b
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    # A's lease was left alone: A's lawful decode leg still pulls it.
    got_a = text_of(
        post(pair.decode.url + "/v1/completions", {**a, "kv_transfer_params": params_a})
    )
    assert got_a == reference(pair, a)
    assert pair.metric("decode", TRANSFERS) == before[TRANSFERS] + 1
    assert "is not this prompt's" in pair.decode.log_path.read_text(errors="replace")


def test_params_re_signed_with_another_prompts_chain_pull_nothing_and_cache_nothing(pair):
    """An insider with the fleet secret (the gateway pod, say) re-signs A's params
    with B's block hash chain: the decode engine's own check passes, but the
    producer vouches only for the chain it computed itself and refuses the claim
    (NIXL) or read (ZMQ) naming B's."""
    a, b = body(9131), body(9132)
    params_a = prefill_leg(pair, a)
    secret = security.fleet_secret_from_env()
    assert secret is not None
    p = kv_params.verify(secret, params_a)
    n = p.num_blocks
    assert n == 6
    chain_b = prompt_block_hashes(b["prompt"], 16, get_hash_fn(str(p.block_hash_algo)), n)
    forged = kv_params.sign(
        secret, dataclasses.replace(p, block_chain=chain_b[n - 1].hex()), ttl=60
    ).to_wire()
    want_b = reference(pair, b)
    before = {m: pair.metric("decode", m) for m in (MISMATCHES, TRANSFERS, PULLED)}
    got = text_of(post(pair.decode.url + "/v1/completions", {**b, "kv_transfer_params": forged}))
    assert got == want_b
    assert pair.metric("decode", MISMATCHES) == before[MISMATCHES] + 1
    assert pair.metric("decode", TRANSFERS) == before[TRANSFERS]
    assert pair.metric("decode", PULLED) == before[PULLED]
    assert "the producer refused this prompt's block hash chain" in (
        pair.decode.log_path.read_text(errors="replace")
    )
    # Only B's own KV is cached under B's hashes.
    for _ in range(2):
        r = post(pair.decode.url + "/v1/completions", b)
        assert text_of(r) == want_b
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    # The refused consumer neither bound nor released A's lease: A's decode leg pulls it.
    got_a = text_of(
        post(pair.decode.url + "/v1/completions", {**a, "kv_transfer_params": params_a})
    )
    assert got_a == reference(pair, a)
    assert pair.metric("decode", TRANSFERS) == before[TRANSFERS] + 1
    assert pair.metric("decode", PULLED) == before[PULLED] + n


def test_a_client_api_key_cannot_send_kv_transfer_params(pair):
    a, b = body(9201), body(9202)
    params_a = prefill_leg(pair, a)
    before = pair.metric("decode", MISMATCHES), pair.metric("decode", TRANSFERS)
    for url, params in (
        (pair.decode.url, params_a),  # the cross-prompt injection
        (pair.prefill.url, {"do_remote_decode": True}),  # leasing blocks at will
    ):
        for stream in (False, True):
            r = post(
                url + "/v1/completions",
                {**b, "stream": stream, "kv_transfer_params": params},
                key=CLIENT_KEY,
            )
            assert r.status_code == 403, r.text
            error = r.json()["error"]
            assert error["param"] == "kv_transfer_params"
            assert "kv_transfer_params" in error["message"]
    assert (pair.metric("decode", MISMATCHES), pair.metric("decode", TRANSFERS)) == before
    # Nor a migration state (a stream resumed as if its tokens were the engine's).
    resumed = {**b, "migration": {"output_token_ids": [1, 2, 3]}}
    r = post(pair.decode.url + "/v1/completions", resumed, key=CLIENT_KEY)
    assert r.status_code == 403 and r.json()["error"]["param"] == "migration", r.text
    # The same key may still call the engine directly without internal fields.
    assert text_of(post(pair.decode.url + "/v1/completions", b, key=CLIENT_KEY)) == reference(
        pair, b
    )


def test_roles_with_different_chat_templates_answer_right_never_with_the_other_roles_kv(pair):
    messages = [{"role": "user", "content": "the harbor was quiet before dawn " * 8}]
    chat = {"messages": messages, "max_tokens": 10, "temperature": 0}
    params = prefill_leg(pair, chat, "/v1/chat/completions")
    assert params["remote_block_ids"]
    # What the decode engine's own template gives, computed by the other engine from
    # the token ids (an engine whose cache the P/D leg cannot touch).
    tokens = post(pair.decode.url + "/tokenize", {"messages": messages}).json()["tokens"]
    want = text_of(
        post(
            pair.prefill.url + "/v1/completions",
            {"prompt": tokens, "max_tokens": 10, "temperature": 0},
        )
    )
    before = pair.metric("decode", MISMATCHES), pair.metric("decode", PULLED)
    got = text_of(
        post(pair.decode.url + "/v1/chat/completions", {**chat, "kv_transfer_params": params})
    )
    assert got == want
    assert pair.metric("decode", MISMATCHES) == before[0] + 1
    assert pair.metric("decode", PULLED) == before[1]


def test_only_internal_callers_may_set_a_priority(pair):
    """A client API key's non-zero priority is a 403 naming it (a client cannot
    jump the engine's queue); the same field from an internal caller passes the
    gate (this fcfs engine then refuses it for its policy); 0 is anyone's."""
    b = body(9301)
    r = post(pair.decode.url + "/v1/completions", {**b, "priority": -10}, key=CLIENT_KEY)
    assert r.status_code == 403, r.text
    assert r.json()["error"]["param"] == "priority"
    r = post(pair.decode.url + "/v1/completions", {**b, "priority": -10}, key=INTERNAL_KEY)
    assert r.status_code == 400 and "scheduling-policy priority" in r.json()["error"]["message"]
    ok = post(pair.decode.url + "/v1/completions", {**b, "priority": 0}, key=CLIENT_KEY)
    assert ok.status_code == 200, ok.text
