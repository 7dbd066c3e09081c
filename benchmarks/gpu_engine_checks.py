"""Engine-level sections of benchmarks/gpu_check.py: whole-model correctness on
the fused Triton path and a P/D pair over NIXL.

1. **Greedy agreement with transformers** in bf16 on the same device, over
   ``>= 16`` prompts: the first position where pdfleet's greedy tokens part
   from transformers' (same-dtype) run. bf16 rounds differently in each, so
   late divergence is expected; the first token of every prompt must agree.
2. **Triton vs torch attention backend**, bf16: first-divergence positions, the
   first token of every prompt must agree.
3. **CUDA graphs on vs off**: the same engine with graph decode and eager
   decode must give identical tokens (CUDA only; skipped on a dry run).
4. **P/D pair on one device** joined by NIXL (VRAM on a GPU): two engine
   processes plus an aggregated one; the decode leg's text must equal
   aggregated serving; reports pull GB/s and the mean handover (pull) ms from
   the decode engine's metrics.

The model is a random-weight Llama-architecture model (tiny builder, head
size 80 so the padded attention tiles run) written to a temporary directory:
no download. See docs/gpu.md.
"""

from __future__ import annotations

import gc
import json
import os
import random
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from pdfleet.engine.contracts.launch import python_module

# (spec, prompts, tokens per prompt, prompt lengths, P/D prompt length)
GPU_MODEL = dict(
    hidden_size=1280,
    intermediate_size=3456,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=80,
    vocab_size=2048,
)
DRY_MODEL = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=80,
    vocab_size=2048,
)
# Token ids the tiny tokenizer knows (its trained vocabulary is under vocab_size).
PROMPT_VOCAB = 1800
KV_CACHE_BYTES = 4 << 30  # each engine's share of the one GPU


def build_model(dry_run: bool) -> str:
    from pdfleet.engine.tiny.builder import TinyModelSpec, build_tiny_model

    spec = TinyModelSpec(arch="llama", dtype="bfloat16", **(DRY_MODEL if dry_run else GPU_MODEL))
    return build_tiny_model(tempfile.mkdtemp(prefix="pdfleet-gpucheck-model-"), spec)


def random_prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def first_divergence(ours: list[int], theirs: list[int]) -> int:
    """Index of the first differing token; the length when they agree throughout."""
    return next(
        (i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), len(ours)
    )


def divergence_row(check: str, ours: list[list[int]], theirs: list[list[int]]) -> dict[str, Any]:
    firsts = sorted(first_divergence(a, b) for a, b in zip(ours, theirs, strict=True))
    return {
        "check": check,
        "prompts": len(firsts),
        "tokens": len(ours[0]) if ours else 0,
        "min_first_divergence": firsts[0],
        "median_first_divergence": firsts[len(firsts) // 2],
        "identical": sum(1 for a, b in zip(ours, theirs, strict=True) if a == b),
        "ok": firsts[0] >= 1,  # the first token of every prompt agrees
    }


class EngineChecks:
    def __init__(self, dry_run: bool, seed: int) -> None:
        import torch

        self.torch = torch
        self.dry_run = dry_run
        self.device = "cpu" if dry_run else "cuda"
        self.seed = seed
        self.num_prompts, self.max_tokens = (4, 4) if dry_run else (16, 64)
        self.path = build_model(dry_run)
        lengths = [1, 7, 16, 33, 64, 129, 200, 300, 17, 48, 90, 250, 5, 511, 100, 31]
        self.prompts = random_prompts(PROMPT_VOCAB, lengths[: self.num_prompts], seed)

    def _llm(self, **kwargs: Any):
        from pdfleet.engine import LLM

        memory = {} if self.dry_run else {"kv_cache_memory_bytes": KV_CACHE_BYTES}
        return LLM(self.path, dtype="bfloat16", max_model_len=1024, **memory, **kwargs)

    def _generate(self, llm) -> list[list[int]]:
        from pdfleet.engine import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=self.max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in self.prompts], params)
        return [list(o.outputs[0].token_ids) for o in outs]

    def _free(self, *objects: Any) -> None:
        del objects
        gc.collect()
        if self.device == "cuda":
            self.torch.cuda.empty_cache()

    def _hf_greedy(self) -> list[list[int]]:
        from transformers import AutoModelForCausalLM

        torch = self.torch
        model = AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.bfloat16)
        model = model.to(self.device).eval()
        out = []
        with torch.inference_mode():
            for prompt in self.prompts:
                ids = torch.tensor([prompt], device=self.device)
                generated = model.generate(
                    ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=self.max_tokens,
                    min_new_tokens=self.max_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
                out.append(generated[0, len(prompt) :].tolist())
        self._free(model)
        return out

    def model_checks(self) -> list[dict[str, Any]]:
        """Sections 1-3: rows with ``ok`` (False = a correctness failure)."""
        triton_llm = self._llm(attention_backend="triton")
        runner = triton_llm.engine.core.runner
        fused = all(m.fused for m in runner.model.modules() if hasattr(m, "fused"))
        graphs_on = runner.graphs is not None
        ours = self._generate(triton_llm)
        self._free(triton_llm, runner)
        rows = [
            divergence_row("greedy vs transformers (bf16, same device)", ours, self._hf_greedy())
        ]
        rows[0]["fused_path"] = fused
        rows[0]["ok"] = rows[0]["ok"] and fused
        torch_llm = self._llm(attention_backend="torch")
        rows.append(
            divergence_row("triton vs torch backend (bf16)", ours, self._generate(torch_llm))
        )
        self._free(torch_llm)
        if not graphs_on:
            rows.append({"check": "CUDA graphs on vs off", "skipped": "no CUDA graphs here"})
        else:
            eager = self._llm(attention_backend="triton", enforce_eager=True)
            row = divergence_row("CUDA graphs on vs off", ours, self._generate(eager))
            row["ok"] = row["identical"] == row["prompts"]  # must be token-identical
            rows.append(row)
            self._free(eager)
        return rows

    # ------------------------------------------------------------- P/D pair

    def pd_pair(self, prefill_tp: int = 1, decode_tp: int = 1) -> dict[str, Any]:
        """Section 4: a P/D pair and an aggregated engine as processes. With TP sizes
        (section 5, two GPUs or more) each decode rank pulls its KV heads' slice."""
        from pdfleet.engine.contracts import security

        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.setdefault("PDFLEET_FLEET_SECRET", security.generate_secret())
        token = security.fleet_token(security.fleet_secret_from_env(env))
        headers = {"authorization": f"Bearer {token}"}
        logs = Path(tempfile.mkdtemp(prefix="pdfleet-gpucheck-pd-"))
        base = ["serve", self.path, "--dtype", "bfloat16", "--max-model-len", "4096",
                "--disable-log-stats", "--served-model-name", "m"]  # fmt: skip
        if not self.dry_run:
            base += ["--kv-cache-memory-bytes", str(KV_CACHE_BYTES)]
        procs: dict[str, tuple[subprocess.Popen, str]] = {}
        try:
            for role, kv_role in (
                ("prefill", "kv_producer"),
                ("decode", "kv_consumer"),
                ("agg", None),
            ):
                extra = []
                if kv_role:
                    cfg = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_port": _port()}
                    extra = ["--kv-transfer-config", json.dumps(cfg)]
                    tp = prefill_tp if role == "prefill" else decode_tp
                    extra += ["--tensor-parallel-size", str(tp)] if tp > 1 else []
                port = _port()
                log = open(logs / f"{role}.log", "wb")  # noqa: SIM115 (closed with the process)
                proc = subprocess.Popen(
                    [*python_module("pdfleet.engine.cli"), *base, *extra, "--port", str(port)],
                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                )  # fmt: skip
                procs[role] = (proc, f"http://127.0.0.1:{port}")
            for role, (proc, url) in procs.items():
                _wait_healthy(proc, url, headers, logs / f"{role}.log", timeout=300)
            row = self._pd_requests({r: u for r, (_, u) in procs.items()}, headers)
            if (prefill_tp, decode_tp) != (1, 1):
                row["check"] = f"P/D TP{prefill_tp} -> TP{decode_tp} over NIXL vs aggregated"
            return row
        finally:
            for proc, _ in procs.values():
                proc.terminate()
            for proc, _ in procs.values():
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)

    def _pd_requests(self, urls: dict[str, str], headers: dict[str, str]) -> dict[str, Any]:
        from pdfleet.engine.contracts.metrics import (
            ENGINE_KV_TRANSFER_BYTES,
            ENGINE_KV_TRANSFER_SECONDS,
            parse_metrics,
        )
        from pdfleet.engine.gateway.prefill_leg import prefill_body

        lengths = [40, 300, 1000] if self.dry_run else [512, 1024, 2048, 3000] * 2
        prompts = random_prompts(PROMPT_VOCAB, lengths, self.seed + 1)
        mismatches, handover_ms = 0, []
        with httpx.Client(headers=headers, timeout=120) as client:
            for prompt in prompts:
                body = {"model": "m", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                        "ignore_eos": True}  # fmt: skip
                agg = client.post(urls["agg"] + "/v1/completions", json=body)
                agg.raise_for_status()
                # The prefill leg exactly as the gateway sends it.
                pre = client.post(
                    urls["prefill"] + "/v1/completions", json=prefill_body(body, chat=False)
                )
                pre.raise_for_status()
                params = pre.json()["kv_transfer_params"]
                start = time.perf_counter()
                dec = client.post(
                    urls["decode"] + "/v1/completions", json={**body, "kv_transfer_params": params}
                )
                dec.raise_for_status()
                handover_ms.append((time.perf_counter() - start) * 1e3)
                if dec.json()["choices"][0]["text"] != agg.json()["choices"][0]["text"]:
                    mismatches += 1
            metrics = parse_metrics(client.get(urls["decode"] + "/metrics").text).totals()
        pulled = metrics.get(ENGINE_KV_TRANSFER_BYTES.name, 0.0)
        seconds = metrics.get(ENGINE_KV_TRANSFER_SECONDS.sum, 0.0)
        count = metrics.get(ENGINE_KV_TRANSFER_SECONDS.count, 0.0)
        return {
            "check": "P/D pair over NIXL vs aggregated",
            "memory": "DRAM" if self.dry_run else "VRAM",
            "requests": len(prompts),
            "mismatches": mismatches,
            "pulls": int(count),
            "pulled_MB": pulled / 1e6,
            "pull_GBps": pulled / seconds / 1e9 if seconds else None,
            "pull_ms": 1e3 * seconds / count if count else None,
            "decode_leg_ms": sorted(handover_ms)[len(handover_ms) // 2],
            "ok": mismatches == 0 and count >= 1,
        }


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(proc, url: str, headers: dict[str, str], log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", headers=headers, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"engine at {url} not healthy after {timeout}s:\n{log.read_text()[-3000:]}")
