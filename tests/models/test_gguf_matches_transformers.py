"""pdfleet's GGUF loading produces transformers' greedy tokens on the real SmolLM2 file.

Both sides load the same Q4_1 GGUF and run it in float32: transformers through
``from_pretrained(dir, gguf_file=...)``, pdfleet through the GGUF loader. The
prompts go through the model's own chat template.
"""

from __future__ import annotations

import os

import pytest

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 plus 7?",
    "Translate 'good morning' into Spanish.",
    "Give me one tip for learning to code.",
    "Who wrote Romeo and Juliet?",
]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    """transformers' model of the same GGUF file, in float32, and the tokenizer."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = os.path.realpath(os.path.join(smollm2_dir, "model.gguf"))
    directory, name = os.path.split(gguf)
    # The weights come from the GGUF file; the config transformers read from its
    # metadata when the directory was prepared is passed in to skip a second read.
    model = AutoModelForCausalLM.from_pretrained(
        directory,
        gguf_file=name,
        config=AutoConfig.from_pretrained(smollm2_dir),
        dtype=torch.float32,
    ).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def pdfleet_llm(smollm2_dir):
    from pdfleet.engine.llm import LLM

    gguf = os.path.realpath(os.path.join(smollm2_dir, "model.gguf"))
    # The GGUF file itself, as `pdfleet serve model.gguf` takes it.
    return LLM(model=gguf, dtype="float32", max_model_len=512, load_format="gguf")


def test_greedy_chat_tokens_equal_transformers_on_the_same_gguf(hf_model, pdfleet_llm):
    """pdfleet generates greedily (one batch); transformers scores each prompt plus
    pdfleet's answer in one forward pass. Its argmax at every answer position must be
    pdfleet's token: then transformers' own greedy decoding yields the same tokens
    (and stops on the same end token), at a fraction of the cost of generate()."""
    import torch

    from pdfleet.engine.sampling_params import SamplingParams

    model, tokenizer = hf_model
    prompt_ids = [
        tokenizer(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )["input_ids"]
        for text in PROMPTS
    ]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    results = pdfleet_llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    eos = tokenizer.eos_token_id
    for text, ids, result in zip(PROMPTS, prompt_ids, results, strict=True):
        ours = list(result.outputs[0].token_ids)
        if len(ours) < MAX_TOKENS:
            # Stopped before the limit: on the model's end token, which transformers
            # must predict next (pdfleet may or may not list it among the tokens).
            assert result.outputs[0].finish_reason == "stop", text
            if not ours or ours[-1] != eos:
                ours = [*ours, eos]
        with torch.no_grad():
            logits = model(torch.tensor([ids + ours])).logits[0]
        # logits[i] predicts token i + 1: the answer's tokens follow the prompt.
        theirs = logits[len(ids) - 1 : len(ids) - 1 + len(ours)].argmax(-1).tolist()
        assert ours == theirs, f"{text!r}: pdfleet {ours} != transformers {theirs}"


def test_chat_template_from_the_gguf_answers_the_capital_of_france(pdfleet_llm):
    from pdfleet.engine.sampling_params import SamplingParams

    tokenizer = pdfleet_llm.get_tokenizer()
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPTS[0]}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.startswith("<|im_start|>system")  # SmolLM2's own template
    (result,) = pdfleet_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=32))
    assert "Paris" in result.outputs[0].text
    assert result.outputs[0].finish_reason == "stop"
