"""Offline throughput: pdfleet's LLM engine vs transformers' batched generate.

Same model (random weights), same prompts, same thread count, one run:
64 prompts of mixed lengths (32-512 tokens), 128 generated tokens each.
Prints generated tokens/s of both, their ratio, and the engine's overhead
(the share of wall time outside the model forward + sampling), overall and
over steps with at least 16 sequences.

    .venv/bin/python benchmarks/offline_throughput.py [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch


def build_model(directory: str, quick: bool) -> str:
    from pdfleet.engine.tiny.builder import TinyModelSpec, ensure_tiny_model

    spec = dict(
        hidden_size=256 if quick else 1024,
        intermediate_size=704 if quick else 2816,
        num_hidden_layers=2 if quick else 8,
        num_attention_heads=4 if quick else 16,
        num_key_value_heads=2 if quick else 4,
        max_position_embeddings=2048,
        initializer_range=0.02,
    )
    TinyModelSpec(**spec)  # validate
    return ensure_tiny_model(directory, **spec)


def workload(vocab: int, n: int, quick: bool) -> list[list[int]]:
    rng = random.Random(0)
    hi = 128 if quick else 512
    return [[rng.randrange(8, vocab) for _ in range(rng.randint(32, hi))] for _ in range(n)]


def run_pdfleet(model: str, prompts: list[list[int]], out_len: int) -> dict:
    from pdfleet.engine import LLM, SamplingParams

    llm = LLM(model, max_model_len=1024, max_num_seqs=len(prompts), enforce_eager=True)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    # Warm up kernels and allocator on a short request.
    llm.generate({"prompt_token_ids": prompts[0][:16]}, params.clone(max_tokens=4))
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", {"prompt_token_ids": p}, params)
    forward = forward_big = wall_big = 0.0
    generated = 0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        for out in engine.step():
            if out.finished:
                generated += len(out.outputs[0].token_ids)
        step_wall = time.perf_counter() - t0
        stats = engine.stats
        forward += stats.forward_seconds
        if stats.num_scheduled_reqs >= 16:
            forward_big += stats.forward_seconds
            wall_big += step_wall
    wall = time.perf_counter() - start
    return {
        "seconds": wall,
        "generated_tokens": generated,
        "tokens_per_second": generated / wall,
        "overhead_share": 1 - forward / wall,
        "overhead_share_batch_ge_16": 1 - forward_big / wall_big if wall_big else None,
    }


def run_transformers(model: str, prompts: list[list[int]], out_len: int) -> dict:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    pad = hf.config.pad_token_id or 0
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as generate expects
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        hf.generate(
            ids[:1, -16:],
            attention_mask=mask[:1, -16:],
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=pad,
        )
        start = time.perf_counter()
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=out_len,
            min_new_tokens=out_len,
            do_sample=False,
            pad_token_id=pad,
        )
        wall = time.perf_counter() - start
    generated = (out.shape[1] - width) * len(prompts)
    return {"seconds": wall, "generated_tokens": generated, "tokens_per_second": generated / wall}


def padding_bound(prompts: list[list[int]], out_len: int) -> float:
    n, width = len(prompts), max(len(p) for p in prompts)
    padded = n * (width + out_len)
    exact = sum(len(p) for p in prompts) + n * out_len
    return padded / exact


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--model-dir", default=os.path.join(tempfile.gettempdir(), "pdfleet-bench"))
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args()
    n_prompts = 8 if args.quick else args.num_prompts
    out_len = 8 if args.quick else args.output_len
    model = build_model(args.model_dir + ("-quick" if args.quick else ""), args.quick)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(model).vocab_size
    prompts = workload(vocab, n_prompts, args.quick)
    threads = torch.get_num_threads()
    ours = run_pdfleet(model, prompts, out_len)
    theirs = run_transformers(model, prompts, out_len)
    result = {
        "model": {"layers": 2 if args.quick else 8, "hidden": 256 if args.quick else 1024},
        "num_prompts": n_prompts,
        "output_len": out_len,
        "threads": threads,
        "pdfleet": ours,
        "transformers": theirs,
        "throughput_ratio": ours["tokens_per_second"] / theirs["tokens_per_second"],
        # Token positions each side runs through the model: transformers pads every
        # prompt to the longest; when both are compute-bound this bounds the ratio.
        "padding_bound": padding_bound(prompts, out_len),
    }
    print(f"threads={threads} prompts={n_prompts} output_len={out_len}")
    print(f"pdfleet       {ours['tokens_per_second']:9.1f} tok/s  ({ours['seconds']:.1f}s)")
    print(f"transformers  {theirs['tokens_per_second']:9.1f} tok/s  ({theirs['seconds']:.1f}s)")
    print(f"ratio         {result['throughput_ratio']:9.2f}x   (target >= 3x)")
    print(
        f"padding bound {result['padding_bound']:9.2f}x   "
        "(token positions transformers computes / pdfleet computes)"
    )
    print(f"overhead      {ours['overhead_share']:9.1%}   overall")
    big = ours["overhead_share_batch_ge_16"]
    if big is not None:
        print(f"overhead      {big:9.1%}   steps with >= 16 sequences (target <= 15%)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
