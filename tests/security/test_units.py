"""The pieces behind the process tests, without processes: who is an internal
caller, and when leased blocks count as a prompt's own."""

from __future__ import annotations

from types import SimpleNamespace

from pdfleet.engine.contracts import security
from pdfleet.engine.contracts.block_hash import get_hash_fn, prompt_block_hashes
from pdfleet.engine.contracts.kv_params import KVTransferParams
from pdfleet.engine.entrypoints.auth import EngineAuth
from pdfleet.engine.kv_transfer.connector import PDConnectorScheduler

SECRET = b"unit-test-fleet-secret-0123456789"


def bearer(key: str) -> str:
    return f"Bearer {key}"


def test_only_the_fleet_token_and_internal_keys_are_internal_callers():
    auth = EngineAuth(["client"], SECRET, ["router"])
    token = security.fleet_token(SECRET)
    for key in ("client", "router", token):
        assert auth.allows(bearer(key))
    assert auth.is_internal(bearer(token)) and auth.is_internal(bearer("router"))
    assert not auth.is_internal(bearer("client"))
    assert not auth.is_internal(None) and not auth.allows(bearer("other"))
    # An engine without any credential (single-engine development) trusts everyone.
    assert EngineAuth().is_internal(None)


def test_leased_blocks_are_a_prompts_own_only_when_its_chain_matches():
    sched = PDConnectorScheduler(SimpleNamespace(block_size=16, hash_algo="sha256"))  # type: ignore[arg-type]
    tokens = list(range(100, 200))  # 100 tokens: 6 full blocks before the last one

    def request(ids: list[int]) -> SimpleNamespace:
        hashes = prompt_block_hashes(ids, 16, get_hash_fn("sha256"))
        return SimpleNamespace(
            num_tokens=len(ids),
            block_hashes=hashes,
            all_token_ids=ids,
            sampling_params=SimpleNamespace(cache_salt=None),
            lora_identity=None,
        )

    def params(ids: list[int], n: int, algo: str = "sha256") -> KVTransferParams:
        chain = prompt_block_hashes(ids, 16, get_hash_fn(algo))[n - 1].hex()
        return KVTransferParams(
            remote_block_ids=tuple(range(n)), block_chain=chain, block_hash_algo=algo
        )

    assert sched.content_mismatch(request(tokens), params(tokens, 6)) is None
    # The producer hashed with another algorithm: the consumer hashes again with it.
    assert sched.content_mismatch(request(tokens), params(tokens, 6, "sha256_cbor")) is None
    # A longer prompt that starts with the leased blocks may use them.
    assert sched.content_mismatch(request(tokens + [7] * 40), params(tokens, 6)) is None
    # One token changed in the first block, or too few blocks: not this prompt's KV.
    other = [999, *tokens[1:]]
    assert "differs" in sched.content_mismatch(request(other), params(tokens, 6))
    assert "full blocks" in sched.content_mismatch(request(tokens[:80]), params(tokens, 6))
    assert sched.content_mismatch(request(tokens), KVTransferParams(remote_block_ids=())) is None
