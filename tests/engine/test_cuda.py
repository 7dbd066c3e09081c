"""Device selection for the tests, and the checks that only make sense on a GPU
(marked ``cuda``: skipped without one, run by the same ``make test`` with one)."""

from __future__ import annotations

import pytest
import torch
from helpers import device as test_devices
from helpers.engine import assert_no_leaks, random_prompts

from pdfleet.engine import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_device_selection_follows_the_environment(monkeypatch):
    monkeypatch.setenv("PDFLEET_TEST_DEVICE", "cpu")
    assert test_devices.test_device() == torch.device("cpu")
    assert test_devices.engine_memory_args(["serve", "m"]) == []
    monkeypatch.setenv("PDFLEET_TEST_DEVICE", "cuda")
    assert test_devices.on_cuda()
    share = str(test_devices.KV_CACHE_BYTES_PER_ENGINE)
    assert test_devices.engine_memory_args(["serve", "m"]) == ["--kv-cache-memory-bytes", share]
    # A test that sizes its engine itself keeps its own setting.
    assert test_devices.engine_memory_args(["serve", "--gpu-memory-utilization=0.3"]) == []
    assert test_devices.engine_memory_kwargs({"kv_cache_memory_bytes": 1}) == {}
    assert test_devices.engine_memory_spec() == {"kvCacheMemoryBytes": int(share)}
    monkeypatch.setenv("PDFLEET_TEST_DEVICE", "tpu")
    with pytest.raises(ValueError, match="cpu or cuda"):
        test_devices.device_name()


def _tokens(llm, prompts) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.cuda
def test_cuda_defaults_to_the_fused_triton_path(tiny_model):
    llm = LLM(tiny_model, max_model_len=256)
    runner = llm.engine.core.runner
    assert runner.device.type == "cuda"
    assert runner.backend.name == "triton"
    assert all(m.fused for m in runner.model.modules() if hasattr(m, "fused"))


@pytest.mark.cuda
def test_cuda_graphs_on_and_off_give_identical_tokens(tiny_model):
    prompts = random_prompts(1800, [1, 9, 40, 70, 130], seed=70)
    graphs = LLM(tiny_model, max_model_len=256)
    assert graphs.engine.core.runner.graphs is not None
    eager = LLM(tiny_model, max_model_len=256, enforce_eager=True)
    assert eager.engine.core.runner.graphs is None
    assert _tokens(graphs, prompts) == _tokens(eager, prompts)
    assert_no_leaks(graphs)


@pytest.mark.cuda
@pytest.mark.parametrize("head_dim", [80, 96, 192])
def test_bf16_triton_backend_agrees_with_torch_backend_on_cuda(tiny_model_factory, head_dim):
    path = tiny_model_factory("llama", head_dim=head_dim)
    prompts = random_prompts(1800, [5, 60], seed=head_dim)
    ours = _tokens(LLM(path, max_model_len=256, dtype="bfloat16"), prompts)
    ref = _tokens(
        LLM(path, max_model_len=256, dtype="bfloat16", attention_backend="torch"), prompts
    )
    # bf16 rounds differently in each path: the first tokens agree.
    assert all(a[:2] == b[:2] for a, b in zip(ours, ref, strict=True)), (ours, ref)
