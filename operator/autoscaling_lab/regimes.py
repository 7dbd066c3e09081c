"""The regimes the target matrix runs: a fleet model, a trace and a spec each.

* ``gpu`` (the main matrix): Llama-3.1-8B in bf16 on one H100 SXM (80 GB)
  per replica, at 5x the CPU regime's request rate, with prompts of about
  8k tokens: 15-75 replicas per role, and SLOs near what such a fleet
  realistically achieves at its p99, so that attainment varies with the
  sizing. Every constant is derived below from published numbers;
  docs/autoscaling.md ("The GPU regime") lists the sources.
* ``cpu``: the matrix as it was (the simulator's defaults: 12 requests/s,
  12k prefill tokens/s per replica, 1-11 replicas per role, SLOs that do
  not bind), kept as a second case.

A regime is data: :func:`regime` returns it, and ``pdfleet sim --regime``
uses its trace, fleet model and spec as the defaults that flags override.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .sim_fleet import FleetModel
from .traces import TraceConfig

# --------------------------------------------------------------------------
# The GPU regime's derivation (units in the names). Llama-3.1-8B: 32 layers,
# hidden 4096, 8 KV heads of 128; 6.98e9 parameters outside the embedding,
# 15.01 GB of bf16 weights that a decode step streams.
LAYERS = 32
HIDDEN = 4096
NONEMBED_PARAMS = 6.98e9
WEIGHT_BYTES = 15.01e9
KV_BYTES_PER_TOKEN = 2 * LAYERS * 8 * 128 * 2  # K and V, bf16: 128 KiB
# H100 SXM: 989 TFLOPS dense bf16, 3.35 TB/s HBM3, 80 GB.
H100_FLOPS = 989e12
H100_BYTES_PER_SECOND = 3.35e12
H100_BYTES = 80e9
# Achieved fractions of those peaks: 55% MFU in prefill (a 2k-token prefill
# in about 55 ms; the published 60% goal gives 50 ms), 75% of the memory
# bandwidth in decode (gpt-fast's measured 69-82%).
PREFILL_MFU = 0.55
DECODE_BANDWIDTH_SHARE = 0.75
# The engine's own memory share, and what activations and CUDA graphs keep
# of it besides the weights.
GPU_MEMORY_UTILIZATION = 0.9
ACTIVATION_BYTES = 4e9
# RDMA KV transfer: NIXL over one 400G NIC, measured at 42.6 GB/s.
TRANSFER_BYTES_PER_SECOND = 42.6e9

_flops = H100_FLOPS * PREFILL_MFU
_bandwidth = H100_BYTES_PER_SECOND * DECODE_BANDWIDTH_SHARE
GPU_MODEL = FleetModel(
    # Linear layers: 2 FLOPs per parameter per token.
    prefill_tokens_per_second=round(_flops / (2 * NONEMBED_PARAMS)),
    # Causal attention: 2 x layers x T^2 x hidden FLOPs for T tokens.
    prefill_seconds_per_token_squared=2 * LAYERS * HIDDEN / _flops,
    # Scheduling, sampling and KV registration of one request (a 10 ms TTFT
    # for short prompts on H100, published for NIM).
    prefill_overhead_seconds=0.010,
    # The empty-batch step streams the weights: 6.0 ms at 75% of the
    # bandwidth; vLLM's CI measured 7.8 ms per token at batch 8 on H100.
    decode_step_seconds=0.007,
    # Per sequence: its share of compute and sampling (NIM's H100 ITL rises
    # from 4.6 ms at 1 stream to 12.7 ms at 200: about 40 us a stream).
    decode_step_seconds_per_seq=4e-5,
    # Per context token: its KV read each step.
    decode_step_seconds_per_token=KV_BYTES_PER_TOKEN / _bandwidth,
    kv_capacity_tokens=int(
        round(
            (H100_BYTES * GPU_MEMORY_UTILIZATION - WEIGHT_BYTES - ACTIVATION_BYTES)
            / KV_BYTES_PER_TOKEN,
            -4,
        )
    ),
    max_num_seqs=256,
    transfer_seconds_per_token=KV_BYTES_PER_TOKEN / TRANSFER_BYTES_PER_SECOND,
    # Engines whose weights are cached on the node; the field reports 2-3
    # minutes without (the cold start x2 case).
    cold_start_seconds=60.0,
    # Near the p99 such a fleet reaches at the usual sizing (docs).
    ttft_slo_seconds=1.5,
    itl_slo_seconds=0.025,
)

GPU_TRACE = TraceConfig(
    base_rate=60.0,  # 5x the CPU regime's 12 requests/s
    prompt_tokens_mean=8000.0,
    prompt_tokens_sigma=0.6,
    prompt_tokens_max=32768,
    output_tokens_mean=400.0,
    output_tokens_sigma=0.8,
    output_tokens_max=4096,
    chat_tokens_mean=2000.0,
    document_tokens_mean=12000.0,
    document_share=0.2,
)

# Steps proportionate to 15-75 replicas (the defaults, 4 up and 1 down, are
# sized for a few); the matrix's spec is the same for every strategy's
# bounds and for the reference schedules.
GPU_SPEC: dict[str, Any] = {
    "prefill": {"maxReplicas": 160, "maxScaleUpStep": 16, "maxScaleDownStep": 8},
    # The KV ceiling: an H100's KV holds what its step time allows (the ITL
    # target binds first).
    "decode": {
        "maxReplicas": 160,
        "maxScaleUpStep": 16,
        "maxScaleDownStep": 8,
        "targetKVCacheUsage": 0.9,
    },
}
CPU_SPEC: dict[str, Any] = {
    "prefill": {"maxReplicas": 64},
    # The KV ceiling where the SLOs leave decode to its KV: most of it.
    "decode": {"maxReplicas": 64, "targetKVCacheUsage": 0.95},
}


@dataclass(frozen=True)
class Regime:
    name: str
    description: str
    trace: TraceConfig
    model: FleetModel
    spec: dict[str, Any]
    """The autoscaling section (camelCase): bounds and steps of both roles."""

    def section(self) -> dict[str, Any]:
        """The spec section with the SLOs of the fleet model as the
        policy's targets (``ttftTargetSeconds``, ``itlTargetSeconds``)."""
        out = {k: dict(v) if isinstance(v, dict) else v for k, v in self.spec.items()}
        out.setdefault("prefill", {}).setdefault("ttftTargetSeconds", self.model.ttft_slo_seconds)
        out.setdefault("decode", {}).setdefault("itlTargetSeconds", self.model.itl_slo_seconds)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "trace": dataclasses.asdict(self.trace),
            "model": dataclasses.asdict(self.model),
            "spec": self.spec,
        }


REGIMES = {
    "gpu": Regime(
        "gpu",
        "Llama-3.1-8B bf16, one H100 per replica, 60 requests/s of ~8k-token prompts",
        GPU_TRACE,
        GPU_MODEL,
        GPU_SPEC,
    ),
    "cpu": Regime(
        "cpu",
        "the simulator's defaults: 12 requests/s, 12k prefill tokens/s per replica",
        TraceConfig(),
        FleetModel(),
        CPU_SPEC,
    ),
}


def regime(name: str) -> Regime:
    try:
        return REGIMES[name]
    except KeyError:
        raise ValueError(f"unknown regime {name!r}; choose from {', '.join(REGIMES)}") from None
