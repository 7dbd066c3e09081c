"""Sampling parameters behave as in vLLM: seeds, filters, penalties, stops, logprobs, n."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers.engine import assert_no_leaks, random_prompts

from pdfleet.engine import LLM, SamplingParams
from pdfleet.engine.sample.sampler import (
    Sampler,
    SamplingMetadata,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
)


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, max_model_len=512)


@pytest.fixture(scope="module")
def prompts(llm):
    return random_prompts(llm.engine.config.model_config.vocab_size, [12, 30, 5, 60], seed=21)


def gen(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params)


def test_seeded_sampling_is_reproducible_across_runs_and_batches(llm, prompts):
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=24, ignore_eos=True)
    alone = gen(llm, prompts[:1], seeded)[0].outputs[0].token_ids
    again = gen(llm, prompts[:1], seeded)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True)
    mixed = gen(llm, [prompts[1], prompts[0], prompts[2]], [others, seeded, others])
    assert alone == again == mixed[1].outputs[0].token_ids
    other_seed = gen(llm, prompts[:1], seeded.clone(seed=99))[0].outputs[0].token_ids
    assert other_seed != alone
    assert_no_leaks(llm)


def test_seeded_sampling_survives_preemption(tiny_model, prompts):
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=40, ignore_eos=True)
    calm = LLM(tiny_model, max_model_len=512)
    tight = LLM(tiny_model, max_model_len=128, num_gpu_blocks_override=12, max_num_seqs=4)
    batch = [{"prompt_token_ids": p} for p in prompts]
    a = [o.outputs[0].token_ids for o in calm.generate(batch, seeded)]
    b = [o.outputs[0].token_ids for o in tight.generate(batch, seeded)]
    assert tight.engine.stats.num_preemptions > 0
    assert a == b


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1, max_tokens=12, ignore_eos=True, seed=3),
        SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=12, ignore_eos=True, seed=3),
        SamplingParams(temperature=1.0, min_p=1.0, max_tokens=12, ignore_eos=True, seed=3),
        SamplingParams(temperature=1e-7, max_tokens=12, ignore_eos=True, seed=3),
    ],
)
def test_degenerate_filters_equal_greedy(llm, prompts, params):
    greedy = gen(llm, prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in gen(llm, prompts, params)] == [
        o.outputs[0].token_ids for o in greedy
    ]


def test_sampler_draws_from_the_filtered_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]]).repeat(20000, 1)
    meta = SamplingMetadata(
        temperature=torch.full((20000,), 0.8),
        all_greedy=False,
        all_random=True,
        top_k=torch.full((20000,), 4),
        top_p=torch.full((20000,), 0.95),
        min_p=None,
        generators={},
    )
    drawn = Sampler(seed=0, device=torch.device("cpu"))(logits, meta).sampled_token_ids
    freq = torch.bincount(drawn, minlength=6).float() / 20000
    expected = (logits[0] / 0.8)[:4].softmax(-1)
    keep = expected.cumsum(0) - expected < 0.95  # top-p over the top-4
    expected = torch.where(keep, expected, 0.0)
    expected = torch.cat([expected / expected.sum(), torch.zeros(2)])
    torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_filter_functions():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0]])
    out = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert torch.isinf(out[0, [1, 3]]).all() and out[0, 0] == 3.0 and out[0, 2] == 2.0
    out = apply_top_k_top_p(logits, None, torch.tensor([0.5]))
    assert torch.isfinite(out[0]).tolist() == [True, False, False, False]
    out = apply_min_p(logits, torch.tensor([0.3]))  # keeps p >= 0.3 * max
    assert torch.isfinite(out[0]).tolist() == [True, False, True, False]


def test_penalties_match_their_definitions():
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5, 3.0]])
    meta = SamplingMetadata(
        temperature=torch.ones(1),
        all_greedy=True,
        all_random=False,
        top_k=None,
        top_p=None,
        min_p=None,
        generators={},
        prompt_token_ids=torch.tensor([[0, 5]]),  # 5 = padding (vocab size)
        output_token_ids=torch.tensor([[1, 2, 2]]),
        presence_penalties=torch.tensor([0.5]),
        frequency_penalties=torch.tensor([0.25]),
        repetition_penalties=torch.tensor([2.0]),
    )
    out = apply_penalties(logits.clone(), meta)[0].tolist()
    # token 0: prompt only -> repetition 1/2; token 1: output once (negative -> x2), -0.25 -0.5;
    # token 2: output twice -> 2/2 - 0.5 - 0.5; tokens 3, 4 unseen.
    assert out == pytest.approx([0.5, -2.75, 0.0, 0.5, 3.0])


def test_repetition_penalty_discourages_repeats(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, repetition_penalty=50.0)
    for prompt, out in zip(prompts, gen(llm, prompts, params), strict=True):
        toks = out.outputs[0].token_ids
        assert len(set(toks)) == len(toks)
        assert not set(toks) & set(prompt)


def test_stop_token_ids_and_min_tokens(llm, prompts):
    greedy = gen(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    first = greedy[0].outputs[0].token_ids[0]
    out = gen(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first]))
    o = out[0].outputs[0]
    assert o.token_ids == [first] and o.finish_reason == "stop" and o.stop_reason == first
    out = gen(
        llm,
        prompts[:1],
        SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[first], min_tokens=4),
    )
    o = out[0].outputs[0]
    assert first not in o.token_ids[:4] and len(o.token_ids) >= 4


def test_stop_strings_are_trimmed(llm, prompts):
    base = gen(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    text = base[0].outputs[0].text
    stop = text[10:13]
    assert len(stop) == 3 and "\ufffd" not in stop
    o = gen(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=32, stop=[stop]))[0].outputs[
        0
    ]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == text[: text.index(stop)]
    o = gen(
        llm,
        prompts[:1],
        SamplingParams(
            temperature=0,
            max_tokens=32,
            stop=["zzzz-never", stop],
            include_stop_str_in_output=True,
        ),
    )[0].outputs[0]
    assert o.text == text[: text.index(stop) + 3]
    assert_no_leaks(llm)


def test_eos_from_generation_config_stops(tmp_path, tiny_model, prompts):
    llm = LLM(tiny_model, max_model_len=512)
    first = gen(llm, prompts[:1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    eos = first.outputs[0].token_ids[1]
    model = tmp_path / "m"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "generation_config.json").read_text())
    cfg["eos_token_id"] = [eos]
    Path(model / "generation_config.json").write_text(json.dumps(cfg))
    llm2 = LLM(str(model), max_model_len=512)
    o = gen(llm2, prompts[:1], SamplingParams(temperature=0, max_tokens=10))[0].outputs[0]
    assert o.token_ids == first.outputs[0].token_ids[:2] and o.finish_reason == "stop"
    o = gen(llm2, prompts[:1], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert o[0].outputs[0].finish_reason == "length"


def test_logprobs_are_raw_model_logprobs(llm, prompts, hf_model_factory, tiny_model):
    params = SamplingParams(
        temperature=0, max_tokens=4, ignore_eos=True, logprobs=5, prompt_logprobs=3
    )
    out = gen(llm, prompts[:1], params)[0]
    hf = hf_model_factory(tiny_model)
    seq = prompts[0] + out.outputs[0].token_ids
    with torch.inference_mode():
        ref = hf(torch.tensor([seq])).logits[0].log_softmax(-1)
    plen = len(prompts[0])
    for i, (tok, entry) in enumerate(
        zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)
    ):
        assert len(entry) in (5, 6)
        assert entry[tok].rank == 1
        assert entry[tok].logprob == pytest.approx(ref[plen - 1 + i, tok].item(), abs=1e-4)
        top5 = ref[plen - 1 + i].topk(5).indices.tolist()
        assert set(top5) <= set(entry)
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(
            e[t].logprob
            for t, e in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)
        )
    )
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == plen
    for pos in range(1, plen):
        tok = prompts[0][pos]
        assert out.prompt_logprobs[pos][tok].logprob == pytest.approx(
            ref[pos - 1, tok].item(), abs=1e-4
        )


def test_n_sequences_share_the_prompt(llm, prompts):
    before = llm.engine.stats.prefix_cache_hits
    long_prompt = prompts[3] * 3  # 180 tokens: 11 full blocks to share
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    (out,) = gen(llm, [long_prompt], params)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    seqs = [o.token_ids for o in out.outputs]
    assert len({tuple(s) for s in seqs}) > 1
    assert llm.engine.stats.prefix_cache_hits - before >= 2 * 176
    (again,) = gen(llm, [long_prompt], params)
    assert [o.token_ids for o in again.outputs] == seqs
    (greedy,) = gen(llm, [long_prompt], SamplingParams(n=2, temperature=0, max_tokens=6))
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_input_is_rejected_and_the_engine_keeps_serving(llm, prompts):
    vocab = llm.engine.config.model_config.vocab_size
    ok = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="max_model_len"):
        gen(llm, [prompts[0], [9] * 600], ok)
    with pytest.raises(ValueError, match="prompt.*empty"):
        gen(llm, [prompts[0], []], ok)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        gen(llm, [[vocab + 5]], ok)
    with pytest.raises(ValueError, match="logprobs.*max_logprobs"):
        gen(llm, prompts[:1], SamplingParams(logprobs=50))
    with pytest.raises(ValueError, match="unknown engine argument"):
        LLM("/nonexistent", max_num_seq=3)
    assert_no_leaks(llm)
    out = gen(llm, prompts[:2], ok)
    for o in out:
        c = o.outputs[0]
        assert c.finish_reason in ("length", "stop")
        assert len(c.token_ids) == 4 if c.finish_reason == "length" else 1 <= len(c.token_ids) <= 4
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"top_k": 2**63, "temperature": 1.0}, "top_k"),
        ({"stop_token_ids": [2**70], "min_tokens": 2}, "stop_token_ids"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"n": 10**6}, "n"),
    ],
)
def test_values_beyond_int_ranges_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_stop_ids_outside_the_vocabulary_are_refused_and_the_engine_serves_on(llm, prompts):
    vocab = llm.engine.config.model_config.vocab_size
    bad = SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[vocab])
    with pytest.raises(ValueError, match="stop_token_ids.*vocabulary"):
        gen(llm, prompts[:1], bad)
    assert_no_leaks(llm)
    # In range extremes are served: the last id as a stop id, top_k past the vocabulary,
    # the largest seed for n=2 (the children's seeds wrap inside int64).
    edge = SamplingParams(
        max_tokens=4, min_tokens=2, stop_token_ids=[vocab - 1], top_k=10**6, n=2, seed=2**63 - 1
    )
    (out,) = gen(llm, prompts[:1], edge)
    assert [len(c.token_ids) >= 2 for c in out.outputs] == [True, True]
    assert_no_leaks(llm)


def test_sampler_ignores_ids_outside_the_vocabulary_and_clamps_top_k():
    vocab = 8
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0, 0.0, 0.0, 0.0, 0.0]] * 2)
    meta = SamplingMetadata(
        temperature=torch.tensor([0.0, 1.0]),
        all_greedy=False,
        all_random=False,
        top_k=torch.tensor([vocab * 1000, 2**40]),
        top_p=None,
        min_p=None,
        generators={},
        banned_token_ids={0: [2, vocab, 2**40, -3], 1: [vocab + 1]},
    )
    out = Sampler(0, torch.device("cpu"))(logits, meta).sampled_token_ids.tolist()
    assert out[0] == 3  # id 2 banned, the out-of-range ids ignored
    assert 0 <= out[1] < vocab


def test_child_request_ids_never_collide_with_other_requests(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=2, n=2, temperature=0)
    one = SamplingParams(max_tokens=2, temperature=0)
    engine.add_request("c", {"prompt_token_ids": [1, 2, 3]}, params)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("c-0", {"prompt_token_ids": [4, 5]}, one)
    engine.add_request("d-1", {"prompt_token_ids": [4, 5]}, one)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("d", {"prompt_token_ids": [1, 2, 3]}, params)
    finished = {}
    deadline = 200
    while engine.has_unfinished_requests() and deadline:
        deadline -= 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [len(c.token_ids) for c in out.outputs]
    assert finished == {"c": [2, 2], "d-1": [2]}
    assert_no_leaks(llm)


def test_text_prompts_chat_and_max_tokens_default(llm):
    (out,) = llm.generate("Hello, world", SamplingParams(temperature=0, max_tokens=5))
    assert out.prompt == "Hello, world"
    assert out.prompt_token_ids == llm.get_tokenizer()("Hello, world").input_ids
    (chat,) = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=3))
    tok = llm.get_tokenizer()
    expected = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.prompt_token_ids == tok(expected, add_special_tokens=False).input_ids
    assert chat.prompt_token_ids.count(tok.bos_token_id) == 1
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
    (full,) = llm.generate({"prompt_token_ids": [9] * 500}, params)
    assert len(full.outputs[0].token_ids) == 12 and full.outputs[0].finish_reason == "length"
    assert math.isfinite(full.metrics.first_token_time)
