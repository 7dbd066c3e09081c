#!/usr/bin/env python3
"""One-call GPU verdict: pdfleet's Triton kernels and the engine on them.

    python benchmarks/gpu_check.py --out DIR [--seed N] [--dry-run] [--skip-engine]

``--out DIR`` gets ``gpu_check.json`` and ``gpu_check.md`` (every table in
markdown); ``--json PATH`` writes the JSON alone. Runs in under 8 minutes on
one H200.

On a CUDA GPU, in one run of a few minutes:

1. **Ceilings**, measured here: device-to-device copy bandwidth (a 2 GiB
   copy, bytes read + written) and the bf16 matmul rate (8192^3).
2. **Correctness**: every kernel against its torch reference in bf16 on fresh
   random inputs (``--seed``; default: from the clock), and decode attention
   captured in a CUDA graph, replayed after its context lengths change.
3. **Speed** (``triton.testing.do_bench`` medians, L2 flushed between runs),
   at Llama-3.1-8B shapes: decode attention in GB/s of KV read against the
   copy bandwidth, prefill attention in TFLOP/s against the matmul rate, the
   per-layer kernels in GB/s.
4. **Tuning sweep**: the two target cases again under other tile sizes,
   warps and stages (and decode split counts), so one run shows whether a
   different default would be faster.
5. **Engine end-to-end decode** (ms/step at batch 1/16/64, 1k context, against
   the memory floor): the engine's model runner with random bf16 Llama-3.1-8B
   weights, Triton attention and CUDA-graph decode.

6. **Engine correctness** (benchmarks/gpu_engine_checks.py): greedy agreement
   with transformers in bf16 on the GPU (first-divergence position over 16
   prompts), Triton vs torch attention backend, CUDA graphs on vs off
   (identical tokens), on the fused path with head size 80.
7. **P/D pair on the one GPU** joined by NIXL over VRAM: decode-leg text
   identical to aggregated serving, pull GB/s and handover ms.

Targets: decode attention >= 70% of copy bandwidth; prefill
attention >= 50% of the matmul rate at 2k tokens; batch-1 decode step <=
1.25x its floor. Misses are reported, not failed: the exit status is 1 only
when a correctness check fails.

``--dry-run`` (automatic without CUDA) runs the same code end to end at tiny
sizes on the CPU under Triton's interpreter, timed by a wall clock; its
numbers are not measurements.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Llama-3.1-8B.
LLAMA_8B = dict(
    hidden=4096,
    intermediate=14336,
    layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    vocab=128256,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)
BLOCK_SIZE = 16
DECODE_TARGET_PCT = 70.0
PREFILL_TARGET_PCT = 50.0
E2E_TARGET_RATIO = 1.25
TOL_ATTENTION = 2e-2  # bf16 inputs and probabilities against a float32 reference
TOL_ELEMENTWISE = 2e-2  # a bf16 rounding or two (one ulp is 2^-8 relative)


@dataclass(frozen=True)
class Sizes:
    copy_bytes: int
    matmul_n: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    ops_tokens: int
    # (batch, context); the first is the case the target is judged on.
    decode_cases: tuple[tuple[int, int], ...]
    # (label, seq_lens, q_lens); the first is the case the target is judged on.
    prefill_cases: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]
    check_long: int  # longest context in the correctness checks
    decode_configs: tuple[dict[str, int], ...]  # the sweep; the first is the default
    prefill_configs: tuple[dict[str, int], ...]
    split_counts: tuple[int | None, ...]
    split_cases: tuple[tuple[int, int], ...]  # (batch, context) for the split-count sweep
    e2e_batches: tuple[int, ...] = (1, 16, 64)
    e2e_context: int = 1024


FULL = Sizes(
    copy_bytes=2 << 30,
    matmul_n=8192,
    num_heads=LLAMA_8B["num_heads"],
    num_kv_heads=LLAMA_8B["num_kv_heads"],
    head_dim=LLAMA_8B["head_dim"],
    hidden=LLAMA_8B["hidden"],
    intermediate=LLAMA_8B["intermediate"],
    ops_tokens=4096,
    decode_cases=((64, 4096), (1, 1024), (16, 1024), (64, 1024), (1, 32768), (256, 2048)),
    prefill_cases=(
        ("prompt 2k", (2048,), (2048,)),
        ("prompt 8k", (8192,), (8192,)),
        ("8 prompts x 512", (512,) * 8, (512,) * 8),
        ("chunk 512 after 3.5k cached", (4096,), (512,)),
    ),
    check_long=2100,
    decode_configs=(
        {"BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
        {"BLOCK_N": 32, "num_warps": 4, "num_stages": 4},
        {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
        {"BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
        {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
        {"BLOCK_N": 64, "num_warps": 2, "num_stages": 4},
    ),
    prefill_configs=(
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 2},
        {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 4},
        {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
        {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
    ),
    split_counts=(None, 1, 4, 16, 32, 64),
    split_cases=((1, 32768), (16, 1024)),
)
DRY = Sizes(
    copy_bytes=1 << 20,
    matmul_n=64,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    hidden=64,
    intermediate=96,
    ops_tokens=8,
    decode_cases=((4, 96), (1, 40)),
    prefill_cases=(("prompt 64", (64,), (64,)), ("chunk 16 after 48 cached", (64,), (16,))),
    check_long=70,
    decode_configs=({"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}, {"BLOCK_N": 16}),
    prefill_configs=(
        {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
        {"BLOCK_M": 16},
    ),
    split_counts=(None, 2),
    split_cases=((1, 40),),
    e2e_batches=(1, 2),
    e2e_context=40,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument(
        "--out", metavar="DIR", help="write gpu_check.json and gpu_check.md into DIR"
    )
    parser.add_argument(
        "--skip-engine",
        action="store_true",
        help="skip the engine sections (greedy agreement, backends, graphs, P/D pair)",
    )
    parser.add_argument("--seed", type=int, default=None, help="random seed (default: clock)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny sizes on the CPU under Triton's interpreter (automatic without CUDA)",
    )
    return parser.parse_args(argv)


def llama_8b_weight_bytes(dtype_bytes: int = 2) -> int:
    """Bytes a decode step reads of Llama-3.1-8B's weights: every layer, the
    final norm and the LM head (the embedding table only by row)."""
    m = LLAMA_8B
    hd, kv = m["hidden"], m["num_kv_heads"] * m["head_dim"]
    per_layer = hd * hd * 2 + hd * kv * 2 + 3 * hd * m["intermediate"] + 2 * hd
    return dtype_bytes * (m["layers"] * per_layer + hd + m["vocab"] * hd)


def llama_8b_kv_bytes_per_token(dtype_bytes: int = 2) -> int:
    m = LLAMA_8B
    return 2 * m["layers"] * m["num_kv_heads"] * m["head_dim"] * dtype_bytes


def config_label(config: dict[str, int] | None) -> str:
    if not config:
        return "default"
    short = {"BLOCK_M": "M", "BLOCK_N": "N", "num_warps": "w", "num_stages": "s"}
    return " ".join(f"{short.get(k, k)}{v}" for k, v in config.items())


class GpuCheck:
    """The sections of the check; each returns rows (dicts) for the report."""

    def __init__(self, dry_run: bool, seed: int) -> None:
        import torch

        if dry_run:
            # Before any @triton.jit module is imported.
            os.environ["TRITON_INTERPRET"] = "1"
        import triton
        import triton.testing

        import pdfleet.kernels as kernels
        from pdfleet.kernels import testing
        from pdfleet.kernels.decode_attention import num_sms

        self.torch, self.triton, self.kernels, self.testing = torch, triton, kernels, testing
        self.dry_run = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.num_sms = num_sms(self.device)
        self.sizes = DRY if dry_run else FULL
        self.seed = seed
        self.ceilings: dict[str, float] = {}
        torch.manual_seed(seed)

    # ----------------------------------------------------------------- timing

    def bench(self, fn: Callable[[], Any]) -> float:
        """Median milliseconds: do_bench on CUDA; one wall-clocked call under the
        interpreter (nothing to warm up, and the dry run only exercises the code)."""
        if self.device.type == "cuda":
            return float(self.triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    def environment(self) -> dict[str, Any]:
        torch = self.torch
        name = torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        return {
            "device": name + ("" if self.device.type == "cuda" else " (Triton interpreter)"),
            "num_sms": self.num_sms,
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "triton": self.triton.__version__,
            },
        }

    # --------------------------------------------------------------- ceilings

    def measure_ceilings(self) -> dict[str, float]:
        torch, dev, sizes = self.torch, self.device, self.sizes
        src = torch.empty(sizes.copy_bytes // 2, dtype=torch.bfloat16, device=dev).normal_()
        dst = torch.empty_like(src)
        copy_ms = self.bench(lambda: dst.copy_(src))
        n = sizes.matmul_n
        a = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
        b = torch.randn(n, n, dtype=torch.bfloat16, device=dev)
        matmul_ms = self.bench(lambda: a @ b)
        self.ceilings = {
            "copy_GBps": 2 * sizes.copy_bytes / (copy_ms * 1e-3) / 1e9,  # read + write
            "matmul_TFLOPs": 2 * n**3 / (matmul_ms * 1e-3) / 1e12,
        }
        return self.ceilings

    # ------------------------------------------------------------ correctness

    def paged_case(self, seq_lens, q_lens, poison=True):
        s = self.sizes
        return self.testing.make_paged_case(
            list(seq_lens), list(q_lens), s.num_heads, s.num_kv_heads, s.head_dim, BLOCK_SIZE,
            self.torch.bfloat16, self.device, seed=self.torch.randint(0, 2**31, ()).item(),
            spare_blocks=3 if poison else 0, poison=poison,
        )  # fmt: skip

    def correctness(self) -> list[dict]:
        """Each kernel against its reference in bf16 on fresh random inputs."""
        torch, k, err, dev = self.torch, self.kernels, self.testing.rel_error, self.device
        bf16 = torch.bfloat16
        h, hk, d = self.sizes.num_heads, self.sizes.num_kv_heads, self.sizes.head_dim
        tokens, hidden = self.sizes.ops_tokens, self.sizes.hidden
        scale = d**-0.5
        rows: list[dict] = []

        def record(name: str, error: float, tol: float) -> None:
            rows.append(
                {"check": name, "max_rel_error": error, "tolerance": tol, "ok": error <= tol}
            )

        # store_kv copies, so it must be bit-exact.
        k_cache = torch.randn(64, BLOCK_SIZE, hk, d, device=dev).to(bf16)
        v_cache = torch.randn_like(k_cache)
        ref_k, ref_v = k_cache.clone(), v_cache.clone()
        slots = torch.randperm(64 * BLOCK_SIZE, device=dev)[:200]
        slots[::7] = -1
        key = torch.randn(200, hk, d, device=dev).to(bf16)
        value = torch.randn_like(key)
        k.store_kv(key, value, k_cache, v_cache, slots)
        k.store_kv_reference(key, value, ref_k, ref_v, slots)
        exact = torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
        record("store_kv (bit-exact)", 0.0 if exact else float("inf"), 0.0)

        x = torch.randn(tokens, hidden, device=dev).to(bf16)
        residual = torch.randn_like(x)
        weight = torch.randn(hidden, device=dev).to(bf16)
        out = k.rms_norm(x, weight, 1e-5)
        record("rms_norm", err(out, k.rms_norm_reference(x, weight, 1e-5)), TOL_ELEMENTWISE)
        out, new_res = k.fused_add_rms_norm(x, residual, weight, 1e-5)
        ref_out, ref_res = k.fused_add_rms_norm_reference(x, residual, weight, 1e-5)
        error = max(err(out, ref_out), err(new_res, ref_res))
        record("fused_add_rms_norm", error, TOL_ELEMENTWISE)

        cos_sin = k.build_cos_sin_cache(
            d, 8192, LLAMA_8B["rope_theta"], LLAMA_8B["rope_scaling"], device=dev
        )
        for is_neox in (True, False):
            qkv = torch.randn(tokens, h + 2 * hk, d, device=dev).to(bf16)
            q, key = qkv[:, :h], qkv[:, h : h + hk]
            ref_q, ref_key = q.clone(), key.clone()
            positions = torch.randint(0, 8192, (tokens,), device=dev)
            k.rotary_embedding(positions, q, key, cos_sin, d, is_neox)
            k.rotary_embedding_reference(positions, ref_q, ref_key, cos_sin, d, is_neox)
            error = max(err(q, ref_q), err(key, ref_key))
            style = "neox" if is_neox else "gpt-j"
            record(f"rotary_embedding ({style}, llama3)", error, TOL_ELEMENTWISE)

        gate_up = torch.randn(tokens, 2 * self.sizes.intermediate, device=dev).to(bf16)
        error = err(k.silu_and_mul(gate_up), k.silu_and_mul_reference(gate_up))
        record("silu_and_mul", error, TOL_ELEMENTWISE)

        long = self.sizes.check_long
        # A prompt, a decode, a chunk over a long cached prefix, a one-token prompt, a short chunk.
        seq_lens, q_lens = (long // 3, 1, long, 37, long // 2), (long // 3, 1, long // 4, 1, 17)
        for window in (None, long // 5):
            c = self.paged_case(seq_lens, q_lens)
            args = (c.q, c.k_cache, c.v_cache, c.block_table, c.query_start_loc, c.seq_lens)
            error = err(
                k.paged_prefill_attention(*args, scale, window),
                k.paged_prefill_attention_reference(*args, scale, window),
            )
            record(f"paged_prefill_attention (window {window})", error, TOL_ATTENTION)

        lens = (1, BLOCK_SIZE, BLOCK_SIZE + 1, long // 2, long, 300)
        for window, num_splits in ((None, None), (None, 1), (None, 7), (long // 3, None)):
            c = self.paged_case(lens, [1] * len(lens))
            args = (c.q, c.k_cache, c.v_cache, c.block_table, c.seq_lens)
            error = err(
                k.paged_decode_attention(*args, scale, window, num_splits),
                k.paged_decode_attention_reference(*args, scale, window),
            )
            record(
                f"paged_decode_attention (window {window}, splits {num_splits})",
                error,
                TOL_ATTENTION,
            )

        name = "paged_decode_attention in a CUDA graph, replayed"
        if self.device.type == "cuda":
            record(name, self.decode_graph_error(), TOL_ATTENTION)
        else:
            rows.append({"check": name, "skipped": "no CUDA"})
        return rows

    def decode_graph_error(self) -> float:
        """Capture decode once, change every context length in place (one to 0,
        as batch padding), replay: the replay must match the reference for the
        new lengths (no host sync, no value-dependent allocation or launch shape)."""
        torch, k, d = self.torch, self.kernels, self.sizes.head_dim
        c = self.paged_case((self.sizes.check_long, 700, 65, 300), (1, 1, 1, 1))
        args = (c.q, c.k_cache, c.v_cache, c.block_table, c.seq_lens)
        out = torch.empty_like(c.q)
        k.paged_decode_attention(*args, d**-0.5, out=out)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            k.paged_decode_attention(*args, d**-0.5, out=out)
        c.seq_lens.copy_(torch.tensor([17, 0, 64, 299], dtype=torch.int32, device=self.device))
        graph.replay()
        torch.cuda.synchronize()
        return self.testing.rel_error(out, k.paged_decode_attention_reference(*args, d**-0.5))

    # ------------------------------------------------------------------ speed

    def time_decode(self, batch: int, context: int, configs, split_counts=(None,)) -> list[dict]:
        """One row per (config, num_splits): ms, GB/s of KV read, % of copy."""
        hk, d = self.sizes.num_kv_heads, self.sizes.head_dim
        c = self.paged_case([context] * batch, [1] * batch, poison=False)
        args = (c.q, c.k_cache, c.v_cache, c.block_table, c.seq_lens)
        out = self.torch.empty_like(c.q)
        kv_bytes = 2 * batch * context * hk * d * c.k_cache.element_size()
        default_splits = self.kernels.choose_num_splits(
            batch, hk, c.block_table.shape[1] * BLOCK_SIZE, d, self.num_sms
        )
        rows = []
        for config in configs:
            for splits in split_counts:
                row = {"batch": batch, "context": context, "config": config_label(config)}
                row["num_splits"] = splits or default_splits
                fn = functools.partial(
                    self.kernels.paged_decode_attention,
                    *args, d**-0.5, num_splits=splits, out=out, config=config,
                )  # fmt: skip
                try:
                    ms = self.bench(fn)
                except Exception as e:  # a config the GPU cannot run: report it, go on
                    rows.append(row | {"error": f"{type(e).__name__}: {e}"[:200]})
                    continue
                gbs = kv_bytes / (ms * 1e-3) / 1e9
                row |= {"ms": ms, "KV_MB": kv_bytes / 1e6, "GBps": gbs}
                rows.append(row | {"pct_of_copy": 100 * gbs / self.ceilings["copy_GBps"]})
        return rows

    def time_prefill(self, label: str, seq_lens, q_lens, configs) -> list[dict]:
        """One row per config: ms, TFLOP/s of the visible (causal) attention, % of matmul."""
        h, d = self.sizes.num_heads, self.sizes.head_dim
        c = self.paged_case(seq_lens, q_lens, poison=False)
        args = (c.q, c.k_cache, c.v_cache, c.block_table, c.query_start_loc, c.seq_lens)
        out = self.torch.empty_like(c.q)
        # Visible (query, key) pairs; QK^T and PV each cost 2 FLOPs per pair and dim.
        pairs = sum(q * (n - q) + q * (q + 1) // 2 for n, q in zip(seq_lens, q_lens, strict=True))
        rows = []
        for config in configs:
            row = {"case": label, "tokens": sum(q_lens), "config": config_label(config)}
            fn = functools.partial(
                self.kernels.paged_prefill_attention, *args, d**-0.5, out=out, config=config
            )
            try:
                ms = self.bench(fn)
            except Exception as e:  # a config the GPU cannot run: report it, go on
                rows.append(row | {"error": f"{type(e).__name__}: {e}"[:200]})
                continue
            tflops = 4 * pairs * h * d / (ms * 1e-3) / 1e12
            row |= {"ms": ms, "TFLOPs": tflops}
            rows.append(row | {"pct_of_matmul": 100 * tflops / self.ceilings["matmul_TFLOPs"]})
        return rows

    def decode_speed(self) -> list[dict]:
        return [r for b, n in self.sizes.decode_cases for r in self.time_decode(b, n, [None])]

    def prefill_speed(self) -> list[dict]:
        cases = self.sizes.prefill_cases
        return [r for label, s, q in cases for r in self.time_prefill(label, s, q, [None])]

    def sweep(self) -> list[dict]:
        """The target cases under other launch configurations and split counts."""
        rows = []
        batch, context = self.sizes.decode_cases[0]
        for r in self.time_decode(batch, context, self.sizes.decode_configs):
            rows.append({"kernel": "decode", "case": f"batch {batch} x {context}"} | r)
        for batch, context in self.sizes.split_cases:
            for r in self.time_decode(batch, context, [None], self.sizes.split_counts):
                rows.append({"kernel": "decode splits", "case": f"batch {batch} x {context}"} | r)
        label, seq_lens, q_lens = self.sizes.prefill_cases[0]
        for r in self.time_prefill(label, seq_lens, q_lens, self.sizes.prefill_configs):
            rows.append({"kernel": "prefill"} | r)
        for r in rows:
            r["value"] = r.get("pct_of_copy", r.get("pct_of_matmul"))
        return rows

    def ops_speed(self) -> list[dict]:
        """The per-layer elementwise kernels, in GB/s of bytes read and written."""
        torch, k, dev = self.torch, self.kernels, self.device
        bf16 = torch.bfloat16
        t, hd, inter = self.sizes.ops_tokens, self.sizes.hidden, self.sizes.intermediate
        h, hk, d = self.sizes.num_heads, self.sizes.num_kv_heads, self.sizes.head_dim
        x = torch.randn(t, hd, device=dev).to(bf16)
        residual, weight = torch.randn_like(x), torch.randn(hd, device=dev).to(bf16)
        gate_up = torch.randn(t, 2 * inter, device=dev).to(bf16)
        qkv = torch.randn(t, h + 2 * hk, d, device=dev).to(bf16)
        q, key, value = qkv[:, :h], qkv[:, h : h + hk], qkv[:, h + hk :]
        positions = torch.arange(t, device=dev)
        cos_sin = k.build_cos_sin_cache(d, t, LLAMA_8B["rope_theta"], device=dev)
        num_blocks = -(-t // BLOCK_SIZE)
        k_cache = torch.empty(num_blocks, BLOCK_SIZE, hk, d, dtype=bf16, device=dev)
        v_cache = torch.empty_like(k_cache)
        slots = torch.randperm(num_blocks * BLOCK_SIZE, device=dev)[:t]
        e = 2  # bytes per bf16 element
        cases = [
            ("rms_norm", f"{t}x{hd}", lambda: k.rms_norm(x, weight, 1e-5), 2 * t * hd * e),
            ("fused_add_rms_norm", f"{t}x{hd}",
             lambda: k.fused_add_rms_norm(x, residual, weight, 1e-5), 4 * t * hd * e),
            ("silu_and_mul", f"{t}x{2 * inter}", lambda: k.silu_and_mul(gate_up), 3 * t * inter * e),
            ("rotary_embedding", f"{t}x({h}+{hk})x{d}",
             lambda: k.rotary_embedding(positions, q, key, cos_sin, d), 2 * t * (h + hk) * d * e),
            ("store_kv", f"{t}x{hk}x{d} (k and v)",
             lambda: k.store_kv(key, value, k_cache, v_cache, slots), 4 * t * hk * d * e),
        ]  # fmt: skip
        rows = []
        for name, shape, fn, nbytes in cases:
            ms = self.bench(fn)
            gbs = nbytes / (ms * 1e-3) / 1e9
            pct = 100 * gbs / self.ceilings["copy_GBps"]
            rows.append({"op": name, "shape": shape, "ms": ms, "GBps": gbs, "pct_of_copy": pct})
        return rows

    # ---------------------------------------------------------- end to end

    def engine_e2e_decode(self) -> dict:
        """End-to-end decode ms/step of the engine's model runner for Llama-3.1-8B
        shapes with random bf16 weights (``--load-format dummy``), Triton attention
        and CUDA-graph decode, at each batch in ``sizes.e2e_batches`` with
        ``sizes.e2e_context`` tokens of context each, against the memory floor:
        (weights + KV bytes) / measured copy bandwidth. One step = input
        preparation, graph replay (or eager forward), sampling, one host sync.
        """
        torch = self.torch
        runner, steps = self._engine_runner(), (2 if self.dry_run else 30)
        rows = []
        for batch in self.sizes.e2e_batches:
            context = self.sizes.e2e_context
            if self.dry_run:
                weights, kv_token = 0, 0
            else:
                weights, kv_token = llama_8b_weight_bytes(), llama_8b_kv_bytes_per_token()
            nbytes = weights + batch * context * kv_token
            floor_ms = nbytes / (self.ceilings["copy_GBps"] * 1e9) * 1e3
            ms = self._time_decode_steps(runner, batch, context, steps)
            rows.append({
                "batch": batch, "context": context, "floor_GB": nbytes / 1e9,
                "floor_ms": floor_ms, "ms_per_step": ms,
                "x_floor": ms / floor_ms if floor_ms else None,
                "graphs": runner.graphs is not None,
            })  # fmt: skip
        del runner
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return {"status": "measured" if not self.dry_run else "dry-run", "rows": rows}

    def _engine_runner(self):
        """A ModelRunner on a generated Llama-3.1-8B (dry run: tiny) config.json."""
        import tempfile

        from pdfleet.engine.config import EngineArgs
        from pdfleet.engine.worker.model_runner import ModelRunner

        m = (
            LLAMA_8B
            if not self.dry_run
            else dict(
                hidden=64,
                intermediate=96,
                layers=2,
                num_heads=4,
                num_kv_heads=2,
                head_dim=16,
                vocab=256,
                rope_theta=10000.0,
                rope_scaling=None,
            )
        )
        directory = tempfile.mkdtemp(prefix="pdfleet-gpucheck-")
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump({
                "architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": m["hidden"], "intermediate_size": m["intermediate"],
                "num_hidden_layers": m["layers"], "num_attention_heads": m["num_heads"],
                "num_key_value_heads": m["num_kv_heads"], "head_dim": m["head_dim"],
                "vocab_size": m["vocab"], "rope_theta": m["rope_theta"],
                "rope_scaling": m["rope_scaling"], "max_position_embeddings": 131072,
                "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "tie_word_embeddings": False,
            }, f)  # fmt: skip
        batches, context = self.sizes.e2e_batches, self.sizes.e2e_context
        blocks = max(batches) * (-(-(context + 64) // BLOCK_SIZE)) + 1
        args = EngineArgs(
            model=directory,
            load_format="dummy",
            dtype="bfloat16",
            skip_tokenizer_init=True,
            max_model_len=context + 64,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(2048, max(batches)),
            attention_backend="triton",
            device=self.device.type,
            num_gpu_blocks_override=blocks,
            cudagraph_capture_sizes=sorted({1, 2, 4, 8, *batches}) if not self.dry_run else None,
            enforce_eager=self.dry_run,
        )
        return ModelRunner(args.create_engine_config("server"))

    def _time_decode_steps(self, runner, batch: int, context: int, steps: int) -> float:
        """Milliseconds per decode step of ``batch`` requests at ``context`` tokens."""
        from pdfleet.engine.core.sched_output import (
            CachedRequestData,
            NewRequestData,
            SchedulerOutput,
        )
        from pdfleet.engine.sampling_params import SamplingParams

        per_req = -(-(context + steps + 8) // BLOCK_SIZE)
        params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
        ids = [f"b{batch}-{i}" for i in range(batch)]
        tables = {rid: list(range(1 + i * per_req, 1 + (i + 1) * per_req))
                  for i, rid in enumerate(ids)}  # fmt: skip
        out = SchedulerOutput(
            [NewRequestData(rid, [7] * context, [], params, tables[rid], context - 1)
             for rid in ids],
            [], dict.fromkeys(ids, 1), batch,
        )  # fmt: skip
        runner.execute_model(out)  # the prompt's last token: a decode-shaped step
        computed = context
        times = []
        for step in range(steps + 3):
            out = SchedulerOutput(
                [],
                [CachedRequestData(rid, [], computed) for rid in ids],
                dict.fromkeys(ids, 1),
                batch,
            )
            start = time.perf_counter()
            runner.execute_model(out)  # ends in a host sync (the sampled ids)
            if step >= 3:
                times.append(time.perf_counter() - start)
            computed += 1
        runner.execute_model(SchedulerOutput([], [], {}, 0, finished_req_ids=set(ids)))
        times.sort()
        return 1e3 * times[len(times) // 2]


# ------------------------------------------------------------------- report


MARKDOWN: list[str] = []  # every table printed, in markdown, for --out


def markdown_table(title: str, rows: list[dict], columns: list[tuple[str, str]]) -> str:
    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "**NO**"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value).replace("|", "/")

    out = [f"### {title}", "", "| " + " | ".join(h for _, h in columns) + " |"]
    out.append("|" + "---|" * len(columns))
    out += ["| " + " | ".join(cell(r.get(k)) for k, _ in columns) + " |" for r in rows]
    return "\n".join(out) + "\n"


def table(title: str, rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A fixed-width table; ``columns`` are (key, header); floats get 4 significant digits."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, bool):
            return "yes" if value else "NO"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value)

    body = [[cell(row.get(key)) for key, _ in columns] for row in rows]
    widths = [max(len(head), *(len(r[i]) for r in body)) for i, (_, head) in enumerate(columns)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

    out = [title, line([head for _, head in columns]), line(["-" * w for w in widths])]
    MARKDOWN.append(markdown_table(title, rows, columns))
    return "\n".join(out + [line(r) for r in body]) + "\n"


def targets(decode: list[dict], prefill: list[dict], e2e: dict) -> list[dict]:
    dec, pre = decode[0], prefill[0]
    e2e_batch1 = next(r for r in e2e["rows"] if r["batch"] == 1)
    pending = e2e["status"] != "measured"
    return [
        {
            "target": f"decode attention >= {DECODE_TARGET_PCT:g}% of copy bandwidth "
            f"(batch {dec['batch']}, context {dec['context']})",
            "value": dec.get("pct_of_copy"),
            "met": dec.get("pct_of_copy", 0.0) >= DECODE_TARGET_PCT,
        },
        {
            "target": f"prefill attention >= {PREFILL_TARGET_PCT:g}% of matmul rate ({pre['case']})",
            "value": pre.get("pct_of_matmul"),
            "met": pre.get("pct_of_matmul", 0.0) >= PREFILL_TARGET_PCT,
        },
        {
            "target": f"batch-1 decode step <= {E2E_TARGET_RATIO:g}x its floor",
            "value": e2e_batch1["x_floor"],
            "met": None if pending else e2e_batch1["x_floor"] <= E2E_TARGET_RATIO,
        },
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    dry_run = args.dry_run or not torch.cuda.is_available()
    seed = args.seed if args.seed is not None else int(time.time()) % 2**31
    check = GpuCheck(dry_run, seed)
    started = time.perf_counter()
    report: dict[str, Any] = {"dry_run": dry_run, "seed": seed} | check.environment()
    note = ", DRY RUN: tiny sizes, numbers are not measurements" if dry_run else ""
    print(f"pdfleet GPU check on {report['device']} (seed {seed}{note})")

    report["ceilings"] = ceil = check.measure_ceilings()
    print(
        f"ceilings: copy {ceil['copy_GBps']:.4g} GB/s (read + write), "
        f"bf16 matmul {ceil['matmul_TFLOPs']:.4g} TFLOP/s\n"
    )
    report["correctness"] = checks = check.correctness()
    print(table("correctness (bf16, fresh random inputs)", checks, [
        ("check", "check"), ("max_rel_error", "max rel err"), ("tolerance", "tol"),
        ("ok", "ok"), ("skipped", "skipped"),
    ]))  # fmt: skip
    s = check.sizes
    report["decode_attention"] = decode = check.decode_speed()
    print(table(
        f"decode attention ({s.num_heads}/{s.num_kv_heads} heads, head_dim {s.head_dim}, "
        f"block {BLOCK_SIZE}, bf16)", decode, [
            ("batch", "batch"), ("context", "context"), ("num_splits", "splits"),
            ("KV_MB", "KV MB"), ("ms", "ms"), ("GBps", "GB/s"), ("pct_of_copy", "% copy"),
        ],
    ))  # fmt: skip
    report["prefill_attention"] = prefill = check.prefill_speed()
    print(table("prefill attention (causal, bf16)", prefill, [
        ("case", "case"), ("tokens", "tokens"), ("ms", "ms"), ("TFLOPs", "TFLOP/s"),
        ("pct_of_matmul", "% matmul"),
    ]))  # fmt: skip
    report["ops"] = ops = check.ops_speed()
    print(table("per-layer kernels (bf16)", ops, [
        ("op", "op"), ("shape", "shape"), ("ms", "ms"), ("GBps", "GB/s"), ("pct_of_copy", "% copy"),
    ]))  # fmt: skip
    report["sweep"] = sweep = check.sweep()
    print(table("tuning sweep (value: % of copy for decode, % of matmul for prefill)", sweep, [
        ("kernel", "kernel"), ("case", "case"), ("config", "config"), ("num_splits", "splits"),
        ("ms", "ms"), ("value", "value"), ("error", "error"),
    ]))  # fmt: skip
    report["engine_e2e"] = e2e = check.engine_e2e_decode()
    print(table("engine end-to-end decode, Llama-3.1-8B shapes", e2e["rows"], [
        ("batch", "batch"), ("context", "context"), ("floor_GB", "floor GB"),
        ("floor_ms", "floor ms"), ("ms_per_step", "ms/step"), ("x_floor", "x floor"),
        ("graphs", "graphs"),
    ]))  # fmt: skip
    engine_rows: list[dict] = []
    if not args.skip_engine:
        from gpu_engine_checks import EngineChecks

        engine = EngineChecks(dry_run, seed)
        try:
            engine_rows = engine.model_checks()
        except Exception as e:  # a crash is a failed check; the report is still written
            engine_rows = [{"check": "engine model checks", "ok": False, "error": repr(e)[:500]}]
        report["engine_checks"] = engine_rows
        print(table("engine correctness (fused Triton path, head size 80)", engine_rows, [
            ("check", "check"), ("prompts", "prompts"), ("tokens", "tokens"),
            ("min_first_divergence", "min 1st div"), ("median_first_divergence", "median 1st div"),
            ("identical", "identical"), ("ok", "ok"), ("skipped", "skipped"), ("error", "error"),
        ]))  # fmt: skip
        try:
            pd = engine.pd_pair()
        except Exception as e:
            pd = {"check": "P/D pair over NIXL vs aggregated", "ok": False, "error": repr(e)[:500]}
        report["pd_pair"] = pd
        engine_rows = [*engine_rows, pd]
        print(table("P/D pair on one device over NIXL", [pd], [
            ("memory", "memory"), ("requests", "requests"), ("mismatches", "mismatches"),
            ("pulls", "pulls"), ("pulled_MB", "pulled MB"), ("pull_GBps", "pull GB/s"),
            ("pull_ms", "pull ms"), ("decode_leg_ms", "decode leg ms"), ("ok", "ok"),
            ("error", "error"),
        ]))  # fmt: skip
        # Section 5: P/D between unequal TP sizes (each decode rank on its own GPU
        # reads its KV heads' slice). Needs two GPUs; skipped in the dry run, as on
        # CPU tests/kv_transfer/test_tp_pd.py checks the same with gloo ranks.
        tp_rows = []
        for prefill_tp, decode_tp in ((1, 2), (2, 1)):
            name = f"P/D TP{prefill_tp} -> TP{decode_tp} over NIXL vs aggregated"
            if dry_run or torch.cuda.device_count() < 2:
                tp_rows.append({"check": name, "skipped": "dry run" if dry_run else "needs 2 GPUs"})
                continue
            try:
                tp_rows.append(engine.pd_pair(prefill_tp, decode_tp))
            except Exception as e:
                tp_rows.append({"check": name, "ok": False, "error": repr(e)[:500]})
        report["pd_tp"] = tp_rows
        engine_rows = [*engine_rows, *tp_rows]
        print(table("P/D between tensor-parallel sizes over NIXL", tp_rows, [
            ("check", "check"), ("requests", "requests"), ("mismatches", "mismatches"),
            ("pulls", "pulls"), ("pulled_MB", "pulled MB"), ("pull_GBps", "pull GB/s"),
            ("decode_leg_ms", "decode leg ms"), ("ok", "ok"), ("skipped", "skipped"),
            ("error", "error"),
        ]))  # fmt: skip
    report["targets"] = goals = targets(decode, prefill, e2e)
    print(table("targets", goals, [("target", "target"), ("value", "value"), ("met", "met")]))

    report["seconds"] = time.perf_counter() - started
    verdicts = [*checks, *engine_rows]
    failed = [c["check"] for c in verdicts if c.get("ok") is False]
    report["failed"] = failed
    summary = (
        f"{len(verdicts) - len(failed)}/{len(verdicts)} correctness checks passed, "
        f"{report['seconds']:.1f} s"
    )
    print(summary)
    paths = [args.json] if args.json else []
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        paths.append(os.path.join(args.out, "gpu_check.json"))
        with open(os.path.join(args.out, "gpu_check.md"), "w") as f:
            f.write(f"# pdfleet GPU check: {report['device']}\n\n")
            f.write(f"seed {seed}{note}; {summary}\n\n" + "\n".join(MARKDOWN))
    for path in paths:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
