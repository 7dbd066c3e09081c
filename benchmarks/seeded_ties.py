"""Seeded draws near a tie: the same requests in two batch shapes, no migration.

Runs ``faults.py``'s scale-down streams in one engine (the tiny model, in
process): prompts 0-3, 1 and 3 seeded (``temperature`` 0.8, ``top_p`` 0.95,
``n`` 2, seed ``1000 + i``), ``--tokens`` each, first together (one batch of
six sequences), then each request alone (a batch of its own choices). Every
seeded draw is recorded in both: the token it chose, the two best scores
(probability over the draw's exponential noise, the sampler's argmax) and
the logits. For each draw that chose another token in the two runs it
prints the relative gap of the two best scores in each run and the largest
difference between the two runs' logits: a draw whose two best scores are
closer than the logits' batch-to-batch difference can go either way, on one
engine as after a move (docs/migration.md, "Exactness and float ties").

The hook wraps the sampler's internals (``Sampler._sample_random`` and the
runner's ``step_seed``) to see each row's (seed, output position); it
changes no draw. Rerun (about a minute)::

    .venv/bin/python -P benchmarks/seeded_ties.py
"""

from __future__ import annotations

import argparse
import json

import torch

import pdfleet.engine.sample.sampler as sampler_mod
import pdfleet.engine.worker.model_runner as runner_mod
from pdfleet.engine.llm import LLM
from pdfleet.engine.sampling_params import SamplingParams
from pdfleet.engine.tiny.builder import ensure_tiny_model

STORY = (
    "The harbor was quiet before dawn, and the fishing boats rocked gently against the old "
    "wooden pier while gulls circled overhead waiting for the first catch of the day. "
)
PROMPTS = [f"Story {i}: " + STORY * (3 if i % 4 else 1) for i in range(4)]

# Per run: (seed, output position) -> what the draw saw.
Draws = dict[tuple[int, int], dict]


def hook(runs: list[Draws]) -> None:
    """Record every seeded draw into ``runs[-1]``."""
    keys: list[tuple[int, int]] = []
    step_seed = runner_mod.step_seed
    sample = sampler_mod.Sampler._sample_random

    def seeded(seed: int, index: int) -> int:
        keys.append((seed, index))
        return step_seed(seed, index)

    def sample_random(self, logits: torch.Tensor, meta) -> torch.Tensor:
        rows = sorted(meta.generators)
        # The runner seeds the rows' generators in row order, just before.
        row_keys = dict(zip(rows, keys[-len(rows) :], strict=True)) if rows else {}
        temperature = torch.where(meta.temperature < 1e-5, 1.0, meta.temperature)
        scaled = logits.to(torch.float32) / temperature.unsqueeze(1)
        kept = sampler_mod.apply_top_k_top_p(scaled, meta.top_k, meta.top_p)
        chosen = sample(self, logits, meta)
        for row, key in row_keys.items():
            g = torch.Generator(device=logits.device).manual_seed(step_seed(*key))
            noise = torch.empty(logits.shape[-1]).exponential_(generator=g).clamp_(min=1e-30)
            best = (kept[row].softmax(-1) / noise).topk(2)
            runs[-1][key] = {
                "chosen": int(chosen[row]),
                "best": best.indices.tolist(),
                "gap": float((best.values[0] - best.values[1]) / best.values[0]),
                "logits": scaled[row].clone(),
            }
        return chosen

    runner_mod.step_seed = seeded  # type: ignore[assignment]
    sampler_mod.Sampler._sample_random = sample_random  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=300)
    args = parser.parse_args()
    runs: list[Draws] = []
    hook(runs)
    llm = LLM(ensure_tiny_model(), max_model_len=1024, max_num_seqs=32)

    def params(i: int) -> SamplingParams:
        if i % 2 == 0:
            return SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
        return SamplingParams(
            max_tokens=args.tokens,
            ignore_eos=True,
            temperature=0.8,
            top_p=0.95,
            seed=1000 + i,
            n=2,
        )

    runs.append({})
    together = llm.generate(PROMPTS, [params(i) for i in range(4)])
    runs.append({})
    alone = [llm.generate([PROMPTS[i]], [params(i)])[0] for i in range(4)]
    report: dict = {"differing_choices": [], "differing_draws": []}
    for i in range(4):
        for c, (a, b) in enumerate(zip(together[i].outputs, alone[i].outputs, strict=True)):
            at = next(
                (
                    k
                    for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=True))
                    if x != y
                ),
                None,
            )
            if at is not None:
                report["differing_choices"].append({"prompt": i, "choice": c, "position": at})
    for key, x in runs[0].items():
        y = runs[1].get(key)
        if y is None or x["chosen"] == y["chosen"]:
            continue
        report["differing_draws"].append(
            {
                "seed": key[0],
                "position": key[1],
                "together": {k: x[k] for k in ("chosen", "best", "gap")},
                "alone": {k: y[k] for k in ("chosen", "best", "gap")},
                "max_logit_diff": float((x["logits"] - y["logits"]).abs().max()),
            }
        )
    report["seeded_draws"] = len(runs[0])
    report["smallest_gap"] = min(d["gap"] for d in runs[0].values())
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
