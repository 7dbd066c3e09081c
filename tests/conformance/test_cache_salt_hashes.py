"""cache_salt namespaces the block hashes: the engine's prefix cache, the ids its
KV events carry and the gateway's exact index all hash a salted prompt from the
salt's root, so they agree with each other and with no other namespace."""

from __future__ import annotations

from pdfleet.engine.contracts.block_hash import (
    ROOT_HASH,
    extend_block_hashes,
    external_block_hash,
    get_hash_fn,
    prompt_block_hashes,
    root_hash,
)
from pdfleet.engine.gateway.prompt import PromptAnalyzer

IDS = list(range(10, 74))  # four blocks of 16


def test_salted_hashes_differ_from_unsalted_and_from_other_salts():
    fn = get_hash_fn("sha256")
    plain = prompt_block_hashes(IDS, 16, fn)
    a = prompt_block_hashes(IDS, 16, fn, cache_salt="tenant-a")
    b = prompt_block_hashes(IDS, 16, fn, cache_salt="tenant-b")
    assert len(plain) == len(a) == len(b) == 4
    assert not set(plain) & set(a) and not set(a) & set(b)
    assert root_hash(None) == root_hash("") == ROOT_HASH
    # The scheduler's incremental hashing with the salt's root gives the same chain.
    grown: list[bytes] = []
    for end in (20, 40, 64):
        extend_block_hashes(grown, IDS[:end], 16, fn, root_hash("tenant-a"))
    assert grown == a
    for algo in ("sha256", "sha256_cbor"):
        f = get_hash_fn(algo)
        assert prompt_block_hashes(IDS, 16, f, cache_salt="s") != prompt_block_hashes(IDS, 16, f)


def test_the_gateway_index_hashes_a_salted_prompt_as_the_engine_does():
    analyzer = PromptAnalyzer(None, max_blocks=8, exact=True)
    fn = get_hash_fn("sha256")
    salted = analyzer.analyze({"prompt": IDS, "cache_salt": "tenant-a"}, False, 16)
    plain = analyzer.analyze({"prompt": IDS}, False, 16)
    want = [external_block_hash(d) for d in prompt_block_hashes(IDS, 16, fn, cache_salt="tenant-a")]
    assert salted.exact_hashes == want
    assert plain.exact_hashes != want
    # Prefix affinity keys are namespaced too.
    assert not set(salted.block_hashes) & set(plain.block_hashes)
