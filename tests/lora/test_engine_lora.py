"""Greedy output per LoRA adapter equals transformers + peft on the same adapter,
whatever shares the batch: base rows and other adapters in one step, chunked
prefill, the prefix cache, preemption, evictions from both adapter caches."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading

import pytest
import torch
from helpers.engine import assert_no_leaks, hf_greedy, random_prompts
from safetensors.torch import load_file, save_file

from pdfleet.engine import LLM, EngineArgs, LoRARequest, SamplingParams
from pdfleet.engine.contracts.block_hash import prompt_block_hashes, root_hash
from pdfleet.engine.loop.async_engine import AsyncEngine
from pdfleet.engine.lora import LoRAError
from pdfleet.engine.testing_hooks import LORA_UNREADABLE_ENV


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def check(llm, peft_factory, base, prompts, adapters, max_tokens=8):
    """Generate every prompt with its adapter (None: base) in one call and
    compare each with the peft reference."""
    loras = [LoRARequest(name, 1, path) if name else None for name, path in adapters]
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], greedy(max_tokens), lora_request=loras
    )
    for prompt, (name, path), out in zip(prompts, adapters, outs, strict=True):
        want = hf_greedy(peft_factory(base, path), prompt, max_tokens)
        assert out.outputs[0].token_ids == want, f"adapter {name}, prompt len {len(prompt)}"
    return outs


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_mixed_batch_matches_peft_per_family(
    tiny_model_factory, adapter_factory, peft_factory, arch
):
    base = tiny_model_factory(arch)
    a = adapter_factory(base, 1, r=8)
    # Lower rank than the slots (zero-padded), fewer targets, rsLoRA scaling.
    b = adapter_factory(base, 2, r=4, targets=["q_proj", "v_proj", "down_proj"], rslora=True)
    llm = LLM(base, max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8)
    vocab = llm.engine.config.model_config.vocab_size
    prompts = random_prompts(vocab, [5, 17, 9, 40, 3, 23], seed=3)
    adapters = [("a", a), (None, None), ("b", b), ("a", a), ("b", b), (None, None)]
    outs = check(llm, peft_factory, base, prompts, adapters)
    # The adapters change the output (else the comparison proves little).
    by = {n: o.outputs[0].token_ids for (n, _), o in zip(adapters, outs, strict=True)}
    assert len({tuple(v) for v in by.values()}) == 3
    assert_no_leaks(llm)


@pytest.fixture(scope="module")
def llama(tiny_model_factory, adapter_factory):
    base = tiny_model_factory("llama")
    return base, adapter_factory(base, 1, r=8), adapter_factory(base, 2, r=8)


def test_chunked_prefill_and_preemption(llama, peft_factory):
    base, a, b = llama
    # A 16-token budget chunks every prompt; 12 blocks of 16 cannot hold all at once.
    llm = LLM(
        base,
        max_model_len=128,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_num_batched_tokens=16,
        num_gpu_blocks_override=12,
        max_num_seqs=6,
    )
    vocab = llm.engine.config.model_config.vocab_size
    prompts = random_prompts(vocab, [60, 45, 70, 33, 50, 64], seed=4)
    adapters = [("a", a), ("b", b), (None, None), ("b", b), ("a", a), ("a", a)]
    check(llm, peft_factory, base, prompts, adapters, max_tokens=12)
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


def test_prefix_cache_is_keyed_by_adapter(llama, peft_factory):
    base, a, b = llama
    llm = LLM(base, max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8)
    (prompt,) = random_prompts(llm.engine.config.model_config.vocab_size, [64], seed=5)
    check(llm, peft_factory, base, [prompt], [("a", a)])
    hits = llm.engine.stats.prefix_cache_hits
    # The same prompt under another adapter and under the base model: no block shared.
    check(llm, peft_factory, base, [prompt, prompt], [("b", b), (None, None)])
    assert llm.engine.stats.prefix_cache_hits == hits
    # Under the same adapter again: its blocks are hits.
    check(llm, peft_factory, base, [prompt], [("a", a)])
    assert llm.engine.stats.prefix_cache_hits >= hits + 48
    ids = llm.engine.lora_identities
    assert ids["a"] != ids["b"] and ids["a"].startswith("a@")
    chains = {
        name: prompt_block_hashes(prompt, 16, llm.engine.core.scheduler.kv.hash_fn, lora_name=name)
        for name in (None, ids["a"], ids["b"])
    }
    assert len({c[0] for c in chains.values()}) == 3
    assert root_hash(None, None) != root_hash("x", None) != root_hash(None, "x")
    assert_no_leaks(llm)


def test_slot_and_host_evictions_keep_outputs(llama, adapter_factory, peft_factory):
    base, a, b = llama
    c = adapter_factory(base, 3, r=8)
    # One device slot and one host copy for three adapters: every switch evicts.
    llm = LLM(base, max_model_len=256, enable_lora=True, max_loras=1, max_cpu_loras=1)
    vocab = llm.engine.config.model_config.vocab_size
    prompts = random_prompts(vocab, [9, 12, 20, 7, 15], seed=6)
    adapters = [("a", a), ("b", b), ("c", c), (None, None), ("a", a)]
    check(llm, peft_factory, base, prompts, adapters)
    stats = llm.engine.core.runner.lora_stats()
    assert stats.gpu_evictions >= 2 and stats.cpu_evictions >= 2
    assert stats.loads >= 4  # a came back from disk
    # What the engine exports for routing: the one adapter in the one slot
    # (its host copy is the one host copy).
    assert len(stats.loaded) == 1 and stats.resident == {stats.loaded[0]: "device"}
    assert llm.engine.lora_requests == {"a": 2, "b": 1, "c": 1}
    assert_no_leaks(llm)


def test_bad_adapters_are_refused_by_name_and_the_engine_keeps_serving(
    llama, tiny_model_factory, adapter_factory, peft_factory, tmp_path
):
    base, a, _ = llama
    llm = LLM(base, max_model_len=256, enable_lora=True, max_loras=2, max_lora_rank=8)
    big = adapter_factory(base, 4, r=16)
    with pytest.raises(LoRAError, match=r"'big'.*rank 16 .*exceeds --max-lora-rank 8"):
        llm.engine.add_lora("big", big)
    head = adapter_factory(base, 5, r=8, targets=["q_proj", "lm_head"])
    with pytest.raises(LoRAError, match=r"'head'.*lm_head.*not supported"):
        llm.engine.add_lora("head", head)
    with pytest.raises(LoRAError, match=r"'missing'.*is not a directory"):
        llm.engine.add_lora("missing", str(tmp_path / "nowhere"))
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16}')
    with pytest.raises(LoRAError, match=r"'empty'.*no adapter_model.safetensors"):
        llm.engine.add_lora("empty", str(empty))
    other = adapter_factory(
        tiny_model_factory("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1), 6
    )
    with pytest.raises(LoRAError, match=r"'other'.*another model"):
        llm.engine.add_lora("other", other)
    # A config PEFT could not have written, and integer "weights".
    for key, value, match in (
        ("rank_pattern", {"[": 4}, "rank_pattern key '\\[' is not a regular expression"),
        ("alpha_pattern", ["x"], "alpha_pattern must be a JSON object"),
    ):
        bad = shutil.copytree(a, tmp_path / key)
        cfg = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, key: value}))
        with pytest.raises(LoRAError, match=f"'{key}'.*{match}"):
            llm.engine.add_lora(key, str(bad))
    # A file holding tensors the config does not target: PEFT would load only
    # the targeted ones, so the mismatch is refused, naming tensor and field.
    for key, patch, match in (
        (
            "listed",
            {"target_modules": ["q_proj"]},
            r"tensor '\S+\.(k|v|o|gate|up|down)_proj\.\S+'.*target_modules \['q_proj'\]",
        ),
        ("regex", {"target_modules": "q_proj"}, "target_modules 'q_proj' leaves out"),
        ("excluded", {"exclude_modules": ["down_proj"]}, r"down_proj.*exclude_modules"),
        ("layer0", {"layers_to_transform": [0]}, r"layers\.1\..*layers_to_transform \[0\]"),
        ("pattern", {"layers_to_transform": [0], "layers_pattern": "blocks"}, "layers_pattern"),
        ("badregex", {"target_modules": "q_proj("}, "target_modules 'q_proj\\(' is not a regular"),
    ):
        bad = shutil.copytree(a, tmp_path / key)
        cfg = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**cfg, **patch}))
        with pytest.raises(LoRAError, match=f"'{key}'.*{match}"):
            llm.engine.add_lora(key, str(bad))
    # A regular expression that does cover every tensor is served, as PEFT does.
    full = shutil.copytree(a, tmp_path / "full")
    cfg = json.loads((full / "adapter_config.json").read_text())
    regex = r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj"
    (full / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": regex}))
    ints = shutil.copytree(a, tmp_path / "ints")
    weights = load_file(ints / "adapter_model.safetensors")
    save_file({k: v.to(torch.int8) for k, v in weights.items()}, ints / "adapter_model.safetensors")
    with pytest.raises(LoRAError, match="'ints'.*torch.int8.*floating point"):
        llm.engine.add_lora("ints", str(ints))
    llm.engine.add_lora("a", a)
    with pytest.raises(LoRAError, match="already loaded from the same weights") as same:
        llm.engine.add_lora("a", a)
    assert same.value.already_loaded
    with pytest.raises(LoRAError, match="already loaded with other weights") as other:
        llm.engine.add_lora("a", str(ints))
    assert not other.value.already_loaded and other.value.name_taken
    assert sorted(llm.engine.loras) == ["a"]
    (prompt,) = random_prompts(llm.engine.config.model_config.vocab_size, [11], seed=7)
    check(llm, peft_factory, base, [prompt, prompt], [("a", a), (None, None)])
    llm.engine.remove_lora("a")
    llm.engine.add_lora("full", str(full))
    check(llm, peft_factory, base, [prompt], [("full", str(full))])
    llm.engine.remove_lora("full")
    with pytest.raises(LoRAError, match="not loaded"):
        llm.engine.remove_lora("a")
    assert_no_leaks(llm)


def test_lora_flags_are_checked(tiny_model):
    with pytest.raises(ValueError, match="--max-loras needs --enable-lora"):
        LLM(tiny_model, max_loras=2)
    with pytest.raises(ValueError, match="--max-lora-rank must be one of"):
        LLM(tiny_model, enable_lora=True, max_lora_rank=7)
    with pytest.raises(ValueError, match=r"--max-cpu-loras \(1\) must be at least --max-loras"):
        LLM(tiny_model, enable_lora=True, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="not of the form name=path"):
        LLM(tiny_model, enable_lora=True, lora_modules=["nopath"])
    # vLLM's JSON form: base_model_name must be this engine's model.
    entry = {"name": "sql", "path": "/adapters/sql", "base_model_name": "tiny"}
    args = EngineArgs(
        tiny_model, served_model_name=["tiny"], enable_lora=True, lora_modules=[json.dumps(entry)]
    )
    lora_config = args.create_lora_config()
    assert lora_config is not None and lora_config.lora_modules == {"sql": "/adapters/sql"}
    for bad, match in (
        ({**entry, "base_model_name": "other"}, "base_model_name 'other' is not this engine's"),
        ({**entry, "dtype": "x"}, "unknown field 'dtype'"),
        ({"name": "sql"}, "path must be a non-empty string"),
    ):
        args.lora_modules = [json.dumps(bad)]
        with pytest.raises(ValueError, match=match):
            args.create_lora_config()
    # vLLM's LoRA flags pdfleet lacks: refused naming the flag ("auto" is ours).
    EngineArgs(tiny_model, lora_dtype="auto").check_supported()
    for kw, flag in (
        ({"lora_dtype": "bfloat16"}, "--lora-dtype"),
        ({"fully_sharded_loras": True}, "--fully-sharded-loras"),
    ):
        with pytest.raises(ValueError, match=f"{flag}=.*not supported by pdfleet; remove {flag}"):
            EngineArgs(tiny_model, **kw).check_supported()


def test_tensor_parallel_two_ranks_match_peft(
    tiny_model_factory, adapter_factory, peft_factory, tmp_path, monkeypatch
):
    # Rank 1 alone cannot read adapter g again after an eviction (the ranks
    # inherit the variable when they start).
    monkeypatch.setenv(LORA_UNREADABLE_ENV, "1:g")
    # One KV head replicated on both ranks, the other projections sharded.
    base = tiny_model_factory("mistral", num_key_value_heads=1)
    a, b = adapter_factory(base, 1, r=8), adapter_factory(base, 2, r=4)
    llm = LLM(
        base,
        tensor_parallel_size=2,
        max_model_len=128,
        max_num_batched_tokens=16,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    try:
        vocab = llm.engine.config.model_config.vocab_size
        prompts = random_prompts(vocab, [21, 6, 30], seed=8)
        check(llm, peft_factory, base, prompts, [("a", a), (None, None), ("b", b)])
        with pytest.raises(LoRAError, match="'big'.*exceeds --max-lora-rank 8"):
            llm.engine.add_lora("big", adapter_factory(base, 4, r=16))
        # Every rank reads its shard when the adapter is loaded: its directory
        # may go right after, and no step reads it.
        gone = tmp_path / "c"
        shutil.copytree(a, gone)
        llm.engine.add_lora("c", str(gone))
        shutil.rmtree(gone)
        c = LoRARequest("c", 1, str(gone))
        [out] = llm.generate([{"prompt_token_ids": prompts[0]}], greedy(8), lora_request=c)
        assert out.outputs[0].token_ids == hf_greedy(peft_factory(base, a), prompts[0], 8)
        # Rank 0's caches, reported with each step (the metrics and routing read them).
        stats = llm.engine.core.runner.lora_stats()
        assert stats is not None and stats.resident["c"] == "device" and stats.loads >= 3
        # A rank that reads other bytes than the main process checked refuses the
        # load: nothing is loaded (on any rank), and the engine serves on.
        executor = llm.engine.core.runner
        real_read = executor.read_lora

        def other_digest(request):
            read = real_read(request)
            read.digest = "0" * 64
            return read

        executor.read_lora = other_digest
        with pytest.raises(LoRAError, match=r"'d' refused by tensor-parallel rank 0: .*changed"):
            llm.engine.add_lora("d", b)
        executor.read_lora = real_read
        assert "d" not in llm.engine.loras
        check(llm, peft_factory, base, prompts[:2], [("d", b), ("a", a)])
        run_evicted_adapter_steps(llm, peft_factory, base, a, b, tmp_path)
    finally:
        llm.engine.shutdown()


def run_evicted_adapter_steps(llm, peft_factory, base, a, b, tmp_path):
    """Two adapter slots and two host copies per rank (TP = 2, real ranks).

    An adapter unloaded while a request of it waits for a slot keeps its
    shards on every rank (read again at the unload: its copy was evicted),
    so that request finishes with it after its directory is gone. An adapter
    whose shards were evicted and whose directory is then deleted fails only
    its own requests, with an error naming it: base and other-adapter rows of
    the same steps finish normally, and the engine serves on."""
    engine = llm.engine
    (prompt,) = random_prompts(engine.config.model_config.vocab_size, [9], seed=14)
    lora_a, lora_b = engine.loras["a"], engine.loras["d"]  # d holds b's weights
    want = {
        None: hf_greedy(peft_factory(base, None), prompt, 4),
        "a": hf_greedy(peft_factory(base, a), prompt, 4),
        "b": hf_greedy(peft_factory(base, b), prompt, 4),
    }

    def run(requests):
        for rid, lora in requests:
            engine.add_request(
                rid, {"prompt_token_ids": prompt}, greedy(4), output_kind="final", lora_request=lora
            )
        outs = {}
        while engine.has_unfinished_requests():
            outs.update({o.request_id: o.outputs[0] for o in engine.step()})
        return outs

    def cached():
        stats = engine.core.runner.lora_stats()
        assert stats is not None
        return stats.cached

    def evict(name):
        """Push ``name``'s shards out of every rank's host cache (two copies
        per rank): load two others, unload them."""
        for other in ("x1", "x2"):
            engine.add_lora(other, a)
        for other in ("x1", "x2"):
            engine.remove_lora(other)
        run([(f"flush-{name}", None)])  # rank 0 reports its caches with a step
        assert name not in cached()

    e = shutil.copytree(b, tmp_path / "e")
    lora_e = engine.add_lora("e", str(e))
    evict("e")
    for rid, lora in (("pa", lora_a), ("pd", lora_b), ("pe", lora_e)):
        engine.add_request(
            rid, {"prompt_token_ids": prompt}, greedy(4), output_kind="final", lora_request=lora
        )
    engine.step()  # a and d take both slots; pe waits
    assert {r.request_id for r in engine.core.scheduler.running} == {"pa", "pd"}
    engine.remove_lora("e")  # the ranks read e's shards again, and keep them
    shutil.rmtree(e)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    assert outs == {"pa": want["a"], "pd": want["b"], "pe": want["b"]}
    run([("base", None)])  # no admitted request needs e now: the ranks drop it
    assert "e" not in cached()

    f = shutil.copytree(a, tmp_path / "f")
    lora_f = engine.add_lora("f", str(f))
    evict("f")
    shutil.rmtree(f)
    outs = run([("rf", lora_f), ("rbase", None), ("rd", lora_b)])
    assert outs["rf"].finish_reason == "error" and outs["rf"].token_ids == []
    assert "'f'" in str(outs["rf"].stop_reason)
    assert "is not a directory" in str(outs["rf"].stop_reason)
    assert outs["rbase"].token_ids == want[None] and outs["rd"].token_ids == want["b"]
    assert engine.core.num_failed_steps == 0
    assert "f" not in engine.loras  # unloaded: load it again

    # Only rank 1 fails to read g again: every rank leaves g out of the step
    # (rank 0 would otherwise sample from rows rank 1 ran without it), and
    # rank 0 names it.
    lora_g = engine.add_lora("g", a)
    evict("g")
    outs = run([("rg", lora_g), ("rbase", None), ("rd", lora_b)])
    assert outs["rg"].finish_reason == "error" and outs["rg"].token_ids == []
    assert "'g': another tensor-parallel rank could not read" in str(outs["rg"].stop_reason)
    assert outs["rbase"].token_ids == want[None] and outs["rd"].token_ids == want["b"]
    assert "g" not in engine.loras and engine.core.num_failed_steps == 0
    outs = run([("a2", lora_a), ("base2", None)])
    assert outs["a2"].token_ids == want["a"] and outs["base2"].token_ids == want[None]


def test_triton_backend_runs_the_sgmv_kernel_in_the_model(llama, peft_factory):
    # Under Triton's interpreter on CPU: the segmented kernel inside every projection.
    base, a, b = llama
    llm = LLM(
        base,
        max_model_len=64,
        attention_backend="triton",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
    )
    vocab = llm.engine.config.model_config.vocab_size
    prompts = random_prompts(vocab, [6, 4, 5], seed=9)
    check(llm, peft_factory, base, prompts, [("a", a), (None, None), ("b", b)], max_tokens=3)
    assert llm.engine.core.runner.lora.context.batch is None  # cleared after each step


def test_run_time_load_reads_off_the_engine_thread(llama):
    """While a load's read is held up, the engine keeps stepping: a request runs
    to its end; the adapter is served once the read completes."""
    base, a, _ = llama
    llm = LLM(base, max_model_len=128, enable_lora=True, max_loras=2, max_lora_rank=8)
    runner = llm.engine.core.runner
    release, reading = threading.Event(), threading.Event()
    real_read = runner.read_lora

    def slow_read(request):
        reading.set()
        assert threading.current_thread().name.startswith("pdfleet-lora-read")
        assert release.wait(30)
        return real_read(request)

    runner.read_lora = slow_read
    engine = AsyncEngine(llm.engine)

    async def scenario():
        load = asyncio.create_task(engine.load_lora("a", a))
        assert await asyncio.to_thread(reading.wait, 30)
        stream = await engine.add_request("r1", [5, 6, 7], greedy(4))
        outs = [o async for o in stream]
        assert outs[-1].finished and not load.done()
        assert "a" not in llm.engine.loras
        release.set()
        await asyncio.wait_for(load, 30)
        assert "a" in llm.engine.loras
        stream = await engine.add_request("r2", [5, 6, 7], greedy(2), lora_name="a")
        assert [o async for o in stream][-1].finished
        with pytest.raises(LoRAError, match="already loaded"):
            await engine.load_lora("a", a)

    try:
        asyncio.run(scenario())
    finally:
        release.set()
        engine.shutdown()


def test_unload_while_running_keeps_the_adapter_until_its_requests_finish(
    llama, peft_factory, tmp_path
):
    """An unloaded adapter whose directory is gone at once: its running request
    still finishes with it (and matches peft), no step fails, the base request
    beside it is untouched, and the adapter's copies go once it is done."""
    base, a, _ = llama
    copy = shutil.copytree(a, tmp_path / "a")
    llm = LLM(base, max_model_len=128, enable_lora=True, max_loras=1, max_cpu_loras=1)
    engine = llm.engine
    lora = engine.add_lora("a", str(copy))
    (prompt,) = random_prompts(engine.config.model_config.vocab_size, [9], seed=10)
    engine.add_request(
        "x", {"prompt_token_ids": prompt}, greedy(8), output_kind="final", lora_request=lora
    )
    engine.add_request("y", {"prompt_token_ids": prompt}, greedy(8), output_kind="final")
    engine.step()
    engine.remove_lora("a")
    shutil.rmtree(copy)
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    assert outs["x"] == hf_greedy(peft_factory(base, a), prompt, 8)
    assert outs["y"] == hf_greedy(peft_factory(base, None), prompt, 8)
    llm.generate([{"prompt_token_ids": prompt}], greedy(1))  # the next step drops them
    manager = engine.core.runner.lora
    assert manager.host == {} and manager.slots == [None] and manager.retired == set()
    assert_no_leaks(llm)


def test_identity_covers_the_config_and_weights_are_copies_of_the_files(
    llama, peft_factory, tmp_path
):
    """The identity hashes the config with the weights: the same name loaded
    again from the same weights with only lora_alpha changed is a new identity
    and reuses no prefix block. And the served weights are copies of the files
    as read: rewriting the loaded files in place (other weights, then a
    truncated file) changes nothing served, and nothing crashes."""
    base, a, b = llama
    copy = shutil.copytree(a, tmp_path / "a")
    weights = copy / "adapter_model.safetensors"
    # One slot, two host copies: every switch between a and b refills the slot
    # from a's host copy.
    llm = LLM(base, max_model_len=256, enable_lora=True, max_loras=1, max_cpu_loras=2)
    engine = llm.engine
    engine.add_lora("a", str(copy))
    engine.add_lora("b", b)
    (prompt,) = random_prompts(engine.config.model_config.vocab_size, [40], seed=11)

    def served(names: list[str]) -> list[list[int]]:
        outs = llm.generate(
            [{"prompt_token_ids": prompt}] * len(names),
            greedy(8),
            lora_request=[engine.loras[n] for n in names],
        )
        return [o.outputs[0].token_ids for o in outs]

    want_a = hf_greedy(peft_factory(base, a), prompt, 8)
    want_b = hf_greedy(peft_factory(base, b), prompt, 8)
    assert served(["a"]) == [want_a]
    for rewrite in (
        lambda: shutil.copyfile(f"{b}/adapter_model.safetensors", weights),
        lambda: weights.write_bytes(weights.read_bytes()[:1000]),
    ):
        rewrite()
        assert served(["b", "a"]) == [want_b, want_a]
    first = engine.lora_identities["a"]
    engine.remove_lora("a")
    shutil.copyfile(f"{a}/adapter_model.safetensors", weights)
    cfg = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(
        json.dumps({**cfg, "lora_alpha": 4 * cfg["lora_alpha"]})
    )
    ref = shutil.copytree(copy, tmp_path / "ref")  # the peft reference's own path
    engine.add_lora("a", str(copy))
    assert engine.lora_identities["a"] not in (first, None)
    hits = engine.stats.prefix_cache_hits
    (out,) = served(["a"])
    assert engine.stats.prefix_cache_hits == hits
    assert out == hf_greedy(peft_factory(base, str(ref)), prompt, 8) != want_a
    assert_no_leaks(llm)


def test_unload_keeps_the_adapter_of_waiting_requests(llama, peft_factory, tmp_path):
    """An unloaded adapter stays while any admitted request uses it, not only
    running ones: unloaded (and its directory deleted) while a request of it
    waits for a slot, that request still finishes with it (equal to peft), and
    the base and other-adapter rows beside it are untouched. Its host copy,
    evicted before the request came, is read again at the unload."""
    base, a, b = llama
    copy = shutil.copytree(a, tmp_path / "a")
    llm = LLM(base, max_model_len=128, enable_lora=True, max_loras=1, max_cpu_loras=1)
    engine = llm.engine
    manager = engine.core.runner.lora
    lora_a = engine.add_lora("a", str(copy))
    lora_b = engine.add_lora("b", b)  # evicts a's host copy: nothing needs it yet
    assert list(manager.host) == [lora_b.lora_int_id]
    (prompt,) = random_prompts(engine.config.model_config.vocab_size, [9], seed=12)
    for rid, lora in (("rb", lora_b), ("ra", lora_a), ("rbase", None)):
        engine.add_request(
            rid, {"prompt_token_ids": prompt}, greedy(6), output_kind="final", lora_request=lora
        )
    engine.step()
    # One slot: rb and rbase run, ra waits for b to finish.
    assert {r.request_id for r in engine.core.scheduler.running} == {"rb", "rbase"}
    engine.remove_lora("a")
    shutil.rmtree(copy)
    assert lora_a.lora_int_id in manager.host
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0].token_ids for o in engine.step()})
    assert outs == {
        "rb": hf_greedy(peft_factory(base, b), prompt, 6),
        "ra": hf_greedy(peft_factory(base, a), prompt, 6),
        "rbase": hf_greedy(peft_factory(base, None), prompt, 6),
    }
    llm.generate([{"prompt_token_ids": prompt}], greedy(1))  # the next step drops a
    assert list(manager.host) == [lora_b.lora_int_id] and manager.retired == set()
    assert_no_leaks(llm)


def test_an_adapter_that_cannot_be_read_fails_only_its_own_requests(llama, peft_factory, tmp_path):
    """A loaded adapter's host copy is evicted, then its files change: read
    again for a step, it is not what was loaded, so its request ends with an
    error naming it, while the base row of the same step finishes normally and
    the engine keeps serving."""
    base, a, b = llama
    copy = shutil.copytree(a, tmp_path / "a")
    llm = LLM(base, max_model_len=128, enable_lora=True, max_loras=1, max_cpu_loras=1)
    engine = llm.engine
    lora_a = engine.add_lora("a", str(copy))
    engine.add_lora("b", b)  # evicts a's host copy
    shutil.copyfile(f"{b}/adapter_model.safetensors", copy / "adapter_model.safetensors")
    (prompt,) = random_prompts(engine.config.model_config.vocab_size, [20], seed=13)
    for rid, lora in (("ra", lora_a), ("rbase", None)):
        engine.add_request(
            rid, {"prompt_token_ids": prompt}, greedy(6), output_kind="final", lora_request=lora
        )
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o.outputs[0] for o in engine.step()})
    assert outs["ra"].finish_reason == "error" and outs["ra"].token_ids == []
    assert "'a'" in str(outs["ra"].stop_reason)
    assert "changed since it was loaded" in str(outs["ra"].stop_reason)
    assert outs["rbase"].token_ids == hf_greedy(peft_factory(base, None), prompt, 6)
    assert engine.core.num_failed_steps == 0
    # Unloaded: new requests naming it are refused until it is loaded again.
    assert "a" not in engine.loras and engine.resolve_lora("a") is None
    check(llm, peft_factory, base, [prompt, prompt], [("b", b), (None, None)])
    assert_no_leaks(llm)
