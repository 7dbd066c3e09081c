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
def reference(smollm2_dir):
    """The chat prompts' ids and transformers' greedy continuations of them."""
    torch = pytest.importorskip("torch")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = os.path.realpath(os.path.join(smollm2_dir, "model.gguf"))
    directory, name = os.path.split(gguf)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    # The weights come from the GGUF file; the config transformers read from its
    # metadata when the directory was prepared is passed in to skip a second read.
    model = AutoModelForCausalLM.from_pretrained(
        directory,
        gguf_file=name,
        config=AutoConfig.from_pretrained(smollm2_dir),
        dtype=torch.float32,
    ).eval()
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        for text in PROMPTS
    ]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    outputs = []
    with torch.no_grad():
        for prompt in ids:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.eos_token_id,
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return ids, outputs


@pytest.fixture(scope="module")
def pdfleet_llm(smollm2_dir):
    from pdfleet.engine.llm import LLM

    gguf = os.path.realpath(os.path.join(smollm2_dir, "model.gguf"))
    # The GGUF file itself, as `pdfleet serve model.gguf` takes it.
    return LLM(model=gguf, dtype="float32", max_model_len=512, load_format="gguf")


def test_greedy_chat_tokens_equal_transformers_on_the_same_gguf(reference, pdfleet_llm):
    from pdfleet.engine.sampling_params import SamplingParams

    prompt_ids, expected = reference
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    results = pdfleet_llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params)
    got = [list(r.outputs[0].token_ids) for r in results]
    eos = pdfleet_llm.get_tokenizer().eos_token_id
    # transformers keeps the EOS token it stopped on; pdfleet reports it too.
    for text, ours, theirs in zip(PROMPTS, got, expected, strict=True):
        assert ours == theirs, f"{text!r}: pdfleet {ours} != transformers {theirs} (eos {eos})"


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
