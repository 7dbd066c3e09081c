"""Random PEFT adapters for the tiny models, and transformers + peft as the reference."""

from __future__ import annotations

import json
import os

import pytest
import torch

ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(
    base_dir: str,
    out_dir: str,
    seed: int,
    r: int = 8,
    alpha: int = 16,
    targets: list[str] | None = None,
    rslora: bool = False,
    scale: float = 0.3,
) -> str:
    """A random LoRA adapter of ``base_dir`` saved by peft (A and B both random:
    peft's default B = 0 would leave the base model unchanged)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    cfg = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets or ALL_TARGETS,
        init_lora_weights=False,
        use_rslora=rslora,
        lora_dropout=0.0,
    )
    model = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * scale)
    model.save_pretrained(out_dir)
    assert os.path.exists(os.path.join(out_dir, "adapter_model.safetensors"))
    return out_dir


@pytest.fixture(scope="session")
def adapter_factory(tmp_path_factory):
    """``make(base_dir, seed, **kw) -> adapter directory``, cached per spec."""
    cache: dict[str, str] = {}

    def make(base_dir: str, seed: int, **kw) -> str:
        key = json.dumps({"base": base_dir, "seed": seed, **kw}, sort_keys=True)
        if key not in cache:
            cache[key] = make_adapter(
                base_dir, str(tmp_path_factory.mktemp(f"lora{seed}")), seed, **kw
            )
        return cache[key]

    return make


@pytest.fixture(scope="session")
def peft_factory():
    """``load(base_dir, adapter_dir)``: transformers + peft, cached."""
    cache: dict[tuple[str, str | None], object] = {}

    def load(base_dir: str, adapter_dir: str | None):
        key = (base_dir, adapter_dir)
        if key not in cache:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
            if adapter_dir is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, adapter_dir)
            cache[key] = model.eval()
        return cache[key]

    return load
