"""Settings of one serving benchmark run (``pdfleet bench`` flags, one per field)."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import Literal

from ..config.fields import argparse_kwargs, attr_docs, default_of, resolved_fields


@dataclass
class BenchConfig:
    url: str = "http://127.0.0.1:8000"
    """Base URL of any OpenAI-compatible server (with or without a trailing /v1)."""
    endpoint: Literal["completions", "chat"] = "completions"
    """Which API to load: /v1/completions or /v1/chat/completions."""
    model: str | None = None
    """Model name to request (default: the first one /v1/models lists)."""
    api_key: str | None = None
    """Bearer key to send (default: $OPENAI_API_KEY, else the fleet token when
    $PDFLEET_FLEET_SECRET is set, else none)."""
    num_requests: int | None = 100
    """Requests to send (None: as many as --duration allows)."""
    duration: float | None = None
    """Stop sending new requests after this many seconds."""
    concurrency: int | None = None
    """Requests in flight at most. Alone: a closed loop at fixed concurrency.
    With --request-rate: a cap on the open loop."""
    request_rate: float | None = None
    """Poisson arrivals at this many requests per second (default: fixed
    concurrency, or 1 request at a time when neither is given)."""
    input_len: int = 128
    """Prompt length in tokens for random prompts (exact with --tokenizer,
    else about one token per random word)."""
    output_len: int = 64
    """Tokens to generate per request (max_tokens)."""
    shared_prefix_len: int = 0
    """Tokens (random words) of one prefix shared by every random prompt,
    counted in --input-len: exercises prefix caching and prefix routing."""
    dataset: str | None = None
    """JSONL file of prompts: one object per line with `prompt` (completions)
    or `messages` (chat), and optionally `max_tokens`. Replaces random prompts."""
    tokenizer: str | None = None
    """Model directory whose tokenizer.json makes random prompts exactly
    --input-len tokens long."""
    ignore_eos: bool = True
    """Send `ignore_eos` (a vLLM/pdfleet extension) so every request generates
    --output-len tokens; turn off for servers that reject unknown fields."""
    temperature: float = 0.0
    """Sampling temperature of every request."""
    seed: int = 0
    """Seed of prompts and arrival times: equal seeds give equal workloads."""
    timeout: float = 300.0
    """Seconds one request may take in total before it counts as failed."""
    slo_ttft_ms: float | None = None
    """Goodput SLO: a request is good only if its TTFT is at most this."""
    slo_tpot_ms: float | None = None
    """Goodput SLO: a request is good only if its TPOT is at most this."""
    json: str | None = None
    """Write the full result (config, per-metric percentiles) to this JSON file."""
    quiet: bool = False
    """Print nothing but errors (library use)."""
    plot: str | None = None
    """Write a PNG of latency percentiles (TTFT, E2E) and throughput over time
    to this path (needs matplotlib: the `plot` extra)."""

    def __post_init__(self) -> None:
        if self.num_requests is None and self.duration is None:
            raise ValueError("bound the run: give --num-requests and/or --duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        for name in ("duration", "request_rate", "timeout", "slo_ttft_ms", "slo_tpot_ms"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("--input-len and --output-len must be >= 1")
        if not 0 <= self.shared_prefix_len < self.input_len:
            raise ValueError("--shared-prefix-len must be between 0 and --input-len - 1")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"--url {self.url!r} must start with http:// or https://")

    @property
    def base_url(self) -> str:
        url = self.url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        docs = attr_docs(cls)
        for f, tp in resolved_fields(cls):
            kwargs = argparse_kwargs(f.name, tp, default_of(f), docs.get(f.name, ""))
            if f.name in ("json", "plot"):
                kwargs["metavar"] = "PATH"
            parser.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> BenchConfig:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
