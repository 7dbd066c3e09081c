"""Turns a SchedulerOutput into tensors, runs the model, samples.

The runner keeps a small state per request (token ids, block ids, sampling
parameters) that the scheduler updates incrementally; it makes no scheduling
decisions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..attention import AttentionMetadata, get_attention_backend
from ..config import EngineConfig
from ..core.sched_output import Logprobs, ModelRunnerOutput, SchedulerOutput
from ..distributed import get_tp_group
from ..kv_transfer.base import KVConnectorWorker
from ..lora.adapter import LoRAAdapter, LoRARequest, module_shapes
from ..lora.manager import LoRAManager
from ..models.fused import use_kernels
from ..models.loader import load_model, torch_dtype
from ..models.parallel import WeightSlicer
from ..sample.sampler import Sampler, SamplingMetadata, step_seed
from ..sampling_params import SamplingParams
from . import cpu_allocator
from .cuda_graph import DecodeGraphs
from .host_kv import HostKVCache, check_host_memory
from .kv_cache import (
    allocate_kv_caches,
    bytes_per_block,
    check_fits_max_model_len,
    determine_num_blocks,
    local_kv_heads,
    weight_bytes,
)

logger = logging.getLogger(__name__)


@dataclass
class ModelInput:
    """One step's batch, laid out for the forward pass (built by ``_prepare_inputs``)."""

    req_ids: list[str]
    """Scheduled requests in batch order."""
    states: list[CachedRequestState]
    """Their runner states, in the same order."""
    input_ids: torch.Tensor
    """[num_tokens] int64: the tokens to compute, all sequences flattened."""
    positions: torch.Tensor
    """[num_tokens] int64: each token's position in its sequence."""
    attn_metadata: AttentionMetadata
    logits_rows: list[int]
    """Batch rows that reach their last known token this step (they sample)."""
    logits_indices: list[int]
    """For each of ``logits_rows``: the flattened index of its last token."""


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + output
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    prompt_logprobs: list[Logprobs | None] = field(default_factory=list)
    # The grammar matcher of a constrained request (None: free), advanced over
    # every output token (engine/sample/grammar.py).
    matcher: Any = None
    # The LoRA adapter the request runs with (None: the base model).
    lora: LoRARequest | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        connector: KVConnectorWorker | None = None,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        m = config.model_config
        self.device = torch.device(config.device_config.device)
        self.dtype = torch_dtype(m.dtype)
        self.kv_dtype = torch_dtype(config.kv_cache_dtype)
        self.block_size = config.cache_config.block_size
        self.vocab_size = m.vocab_size
        self.max_model_len = config.scheduler_config.max_model_len
        start = time.perf_counter()
        self.model = load_model(config, self.device)
        # The Triton backend brings the fused RMSNorm/RoPE/SiLU kernels with it.
        use_kernels(self.model, self._attention_backend_name() == "triton")
        # LoRA slots before the KV cache is sized: they take device memory too.
        self.lora: LoRAManager | None = None
        self._lora_admitted: Callable[[], set[int]] = set
        # This step's requests whose adapter could not be activated: why.
        self._lora_failed: dict[str, str] = {}
        if config.lora_config is not None:
            self.lora = self._lora_manager()
        load_seconds = time.perf_counter() - start
        peak = 0
        cc = config.compilation_config
        use_graphs = (
            self.device.type == "cuda"
            and cc.cudagraph_mode == "FULL_DECODE_ONLY"
            and bool(cc.cudagraph_capture_sizes)
        )
        if use_graphs and config.device_config.attention_backend != "triton":
            logger.warning("CUDA graphs need --attention-backend triton; running decode eagerly")
            use_graphs = False
        if self.device.type == "cuda":
            peak = self._profile_peak_memory()
            if use_graphs:
                # Graph outputs (logits of the largest batch) and workspaces live outside
                # the profiled peak: keep room for them.
                peak += 2 * (cc.max_cudagraph_capture_size or 0) * m.vocab_size * 4 + (256 << 20)
        self.tp = get_tp_group()
        # Block ids are global: every rank's shard has as many blocks as the smallest.
        self.num_blocks = self.tp.all_min(
            determine_num_blocks(config, self.kv_dtype, self.device, peak, weight_bytes(self.model))
        )
        check_fits_max_model_len(config, self.num_blocks)
        self.max_model_len = config.scheduler_config.max_model_len
        self.kv_buffer, self.kv_caches = allocate_kv_caches(
            config, self.num_blocks, self.kv_dtype, self.device
        )
        config.cache_config.num_gpu_blocks = self.num_blocks - 1
        if self.device.type == "cpu":
            # After loading: the loader's temporaries go back to the kernel rather
            # than setting the peak the tuning keeps (cpu_allocator's docstring).
            cpu_allocator.release()
            cpu_allocator.tune()
        self.host_kv: HostKVCache | None = None
        offload = config.cache_config.kv_offload_bytes
        if offload is not None:
            num_host = check_host_memory(offload, bytes_per_block(config, self.kv_dtype))
            self.host_kv = HostKVCache(self.kv_buffer, num_host)
            config.cache_config.num_cpu_blocks = num_host
        logger.info(
            "Model loaded in %.1fs (weights %.2f GiB); KV cache: %d blocks x %d tokens = %d "
            "tokens (%.2f GiB, %s)",
            load_seconds,
            weight_bytes(self.model) / (1 << 30),
            self.num_blocks - 1,
            self.block_size,
            (self.num_blocks - 1) * self.block_size,
            self.kv_buffer.numel() * self.kv_buffer.element_size() / (1 << 30),
            m.dtype
            if config.cache_config.cache_dtype == "auto"
            else config.cache_config.cache_dtype,
        )
        self.backend = get_attention_backend(self._attention_backend_name())
        self.sampler = Sampler(m.seed, self.device)
        # Set by the engine that owns the tokenizer; needed by constrained requests only.
        self.grammars: Any = None
        self.states: dict[str, CachedRequestState] = {}
        self.connector = connector
        if connector is not None:
            connector.register_kv_caches(self.kv_caches, self.kv_buffer)
        self.graphs: DecodeGraphs | None = None
        if use_graphs:
            self.graphs = DecodeGraphs(
                self.model,
                self.kv_caches,
                self.backend,
                list(cc.cudagraph_capture_sizes or ()),
                -(-self.max_model_len // self.block_size),
                self.device,
            )
            self.graphs.capture()

    def _lora_manager(self) -> LoRAManager:
        """LoRA slots on every target projection (one slot per --max-loras)."""
        lc = self.config.lora_config
        if lc is None:
            raise RuntimeError("broken invariant: lc is not None")
        m = self.config.model_config
        tp = get_tp_group()
        slicer = None
        if tp.size > 1:
            slicer = WeightSlicer(
                m.num_attention_heads,
                m.num_key_value_heads,
                m.head_dim,
                int(m.hf_config["intermediate_size"]),
                m.vocab_size,
                tp,
            )
        triton = self._attention_backend_name() == "triton"
        return LoRAManager(
            self.model,
            lc,
            m.num_hidden_layers,
            module_shapes(m),
            self.dtype,
            self.device,
            slicer,
            use_triton=lambda: triton,
            in_use=lambda: {s.lora.lora_int_id for s in self.states.values() if s.lora is not None},
            admitted=lambda: self._lora_admitted(),
        )

    def pin_loras(self, admitted: Callable[[], set[int]]) -> None:
        """The load ids of the adapters of the scheduler's requests, from
        admission to finish (waiting and preempted ones too): an unload keeps
        such an adapter's host copy until they are done."""
        self._lora_admitted = admitted

    def read_lora(self, request: LoRARequest) -> LoRAAdapter:
        """Read and check an adapter (raises LoRAError naming it); any thread."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this engine (--enable-lora)")
        return self.lora.read(request)

    def install_lora(self, read: LoRAAdapter) -> None:
        """Keep a read adapter in the host cache."""
        if self.lora is None:
            raise ValueError("LoRA is not enabled on this engine (--enable-lora)")
        self.lora.add(read)

    def remove_lora(self, lora_int_id: int) -> str | None:
        """Drop an unloaded adapter, or keep it for admitted requests: None, or
        why its evicted copy could not be read again for them."""
        return self.lora.remove(lora_int_id) if self.lora is not None else None

    def lora_stats(self) -> Any:
        return self.lora.snapshot() if self.lora is not None else None

    def _attention_backend_name(self) -> str:
        name = self.config.device_config.attention_backend
        if name is None:
            raise RuntimeError("DeviceConfig resolves the backend when it is created")
        return name

    def _profile_peak_memory(self) -> int:
        """Peak bytes of a forward pass of max_num_batched_tokens (CUDA only)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.config.scheduler_config.max_num_batched_tokens
        # A one-block throwaway cache is enough to exercise every kernel.
        m = self.config.model_config
        shape = (1, self.block_size, local_kv_heads(self.config), m.head_dim)
        caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(m.num_hidden_layers)
        ]
        chunk = min(n, self.block_size)
        meta = self._dummy_metadata(num_seqs=max(1, n // chunk), chunk=chunk)
        with torch.inference_mode():
            ids = torch.zeros(meta.num_tokens, dtype=torch.long, device=self.device)
            pos = torch.zeros_like(ids)
            hidden = self.model(
                ids,
                pos,
                caches,
                meta,
                get_attention_backend(self._attention_backend_name()),
            )
            self.model.compute_logits(hidden[: self.config.scheduler_config.max_num_seqs])
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del caches, hidden
        torch.cuda.empty_cache()
        return peak

    def _dummy_metadata(self, num_seqs: int, chunk: int) -> AttentionMetadata:
        d = self.device
        lens = [chunk] * num_seqs
        return AttentionMetadata(
            num_tokens=chunk * num_seqs,
            num_seqs=num_seqs,
            query_start_loc=torch.arange(
                0, chunk * (num_seqs + 1), chunk, dtype=torch.int32, device=d
            ),
            seq_lens=torch.full((num_seqs,), chunk, dtype=torch.int32, device=d),
            block_table=torch.zeros((num_seqs, 1), dtype=torch.int32, device=d),
            slot_mapping=torch.arange(chunk * num_seqs, dtype=torch.int64, device=d) % chunk,
            max_query_len=chunk,
            max_seq_len=chunk,
            query_lens_cpu=lens,
            seq_lens_cpu=lens,
        )

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the host KV tier (0: none)."""
        return self.host_kv.buffer.shape[0] if self.host_kv is not None else 0

    def unissued_stores(self, slots: list[int]) -> list[int]:
        """Of a failed step's store slots, those the host tier never started."""
        if self.host_kv is None:
            return list(slots)
        return [s for s in slots if not self.host_kv.issued(s)]

    def host_kv_bytes(self) -> tuple[int, int]:
        """Bytes copied to and from the host tier since the start (stored, loaded)."""
        if self.host_kv is None:
            return 0, 0
        return self.host_kv.stored_bytes, self.host_kv.loaded_bytes

    def attach_grammars(self, grammars: Any) -> None:
        self.grammars = grammars

    def shutdown(self) -> None:
        """Nothing to stop: the model lives and dies with this process."""

    @property
    def kv_bytes_per_block(self) -> int:
        return bytes_per_block(self.config, self.kv_dtype)

    # -- state --------------------------------------------------------------------

    def _update_states(self, out: SchedulerOutput) -> None:
        for rid in out.finished_req_ids:
            self.states.pop(rid, None)
        for new in out.scheduled_new_reqs:
            self.states[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                num_prompt_tokens=len(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                lora=LoRARequest(new.lora_name, new.lora_id, new.lora_path or "")
                if new.lora_name is not None
                else None,
            )
            spec = new.sampling_params.structured_outputs
            if spec is not None:
                if self.grammars is None:
                    raise RuntimeError("a constrained request reached a runner without grammars")
                # Resumed or handed over with outputs: replay them through the grammar.
                self.states[new.req_id].matcher = self.grammars.matcher(
                    spec, list(new.output_token_ids)
                )
        for cached in out.scheduled_cached_reqs:
            state = self.states[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # -- inputs -------------------------------------------------------------------

    def _prepare_inputs(self, out: SchedulerOutput) -> ModelInput:
        bs = self.block_size
        req_ids = list(out.num_scheduled_tokens)
        lora_slots: dict[int, int] = {}
        if self.lora is not None:
            # The step's adapters into device slots, then each adapter's rows
            # together in slot order (base rows first): one segment per
            # adapter, and segments whose slots are usually a contiguous range
            # (the grouped LoRA form then reads the slots' weights in place).
            wanted = [self.states[r].lora for r in req_ids]
            # An adapter that cannot be read fails its own requests, never the
            # step's other rows.
            failed: dict[int, str] = {}
            lora_slots = self.lora.activate([w for w in wanted if w is not None], failed)
            if self.tp.size > 1 and any(w is not None for w in wanted):
                self._agree_lora_failures(wanted, failed, lora_slots)
            for r in req_ids:
                lora = self.states[r].lora
                if failed and lora is not None and lora.lora_int_id in failed:
                    self._lora_failed[r] = failed[lora.lora_int_id]
            req_ids.sort(key=lambda r: self._lora_sort_key(r, lora_slots))
        counts = [out.num_scheduled_tokens[r] for r in req_ids]
        states = [self.states[r] for r in req_ids]
        num_tokens = sum(counts)
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        slot_mapping = np.empty(num_tokens, dtype=np.int64)
        max_blocks = max(len(s.block_ids) for s in states)
        block_table = np.zeros((len(states), max_blocks), dtype=np.int32)
        seq_lens = np.empty(len(states), dtype=np.int32)
        query_start_loc = np.zeros(len(states) + 1, dtype=np.int32)
        logits_rows: list[int] = []  # batch rows that end at the last known token
        logits_indices: list[int] = []
        offset = 0
        for row, (state, n) in enumerate(zip(states, counts, strict=True)):
            start = state.num_computed_tokens
            end = start + n
            input_ids[offset : offset + n] = state.token_ids[start:end]
            pos = np.arange(start, end)
            positions[offset : offset + n] = pos
            blocks = np.asarray(state.block_ids, dtype=np.int64)
            block_table[row, : len(blocks)] = blocks
            slot_mapping[offset : offset + n] = blocks[pos // bs] * bs + pos % bs
            seq_lens[row] = end
            offset += n
            query_start_loc[row + 1] = offset
            if end == len(state.token_ids):
                logits_rows.append(row)
                logits_indices.append(offset - 1)
        d = self.device

        def to_dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(d, non_blocking=True)

        meta = AttentionMetadata(
            num_tokens=num_tokens,
            num_seqs=len(states),
            query_start_loc=to_dev(query_start_loc),
            seq_lens=to_dev(seq_lens),
            block_table=to_dev(block_table),
            slot_mapping=to_dev(slot_mapping),
            max_query_len=max(counts),
            max_seq_len=int(seq_lens.max()),
            query_lens_cpu=counts,
            seq_lens_cpu=seq_lens.tolist(),
        )
        self.backend.prepare(meta, bs)
        if self.lora is not None:
            self._lora_segments(states, counts, num_tokens, lora_slots)
        return ModelInput(
            req_ids=req_ids,
            states=states,
            input_ids=to_dev(input_ids),
            positions=to_dev(positions),
            attn_metadata=meta,
            logits_rows=logits_rows,
            logits_indices=logits_indices,
        )

    def _agree_lora_failures(
        self,
        wanted: list[LoRARequest | None],
        failed: dict[int, str],
        slots: dict[int, int],
    ) -> None:
        """Every rank fails the same adapters: one that any rank could not
        read (its shard evicted from that rank's host cache, then its files
        gone or changed) runs as base rows on all, and rank 0, which answers
        for the step, names it. Every rank has the same step, so the same
        ``wanted`` in the same order, and so meets this collective."""
        ids = list(dict.fromkeys(w.lora_int_id for w in wanted if w is not None))
        mask = torch.tensor(
            [1 if i in failed else 0 for i in ids], dtype=torch.int64, device=self.tp.device
        )
        self.tp.all_reduce(mask)
        for i, bad in zip(ids, mask.tolist(), strict=True):
            if bad and i not in failed:
                name = next(w.lora_name for w in wanted if w is not None and w.lora_int_id == i)
                failed[i] = (
                    f"LoRA adapter {name!r}: another tensor-parallel rank could not read "
                    "its shard again from its directory; load it again"
                )
            if bad:
                # A rank that read it keeps it out of this step too.
                slots.pop(i, None)

    def _lora_sort_key(self, req_id: str, slots: dict[int, int]) -> int:
        lora = self.states[req_id].lora
        # Rows of an adapter that failed to activate run as base rows.
        return 0 if lora is None or lora.lora_int_id not in slots else 1 + slots[lora.lora_int_id]

    def _lora_segments(
        self,
        states: list[CachedRequestState],
        counts: list[int],
        num_tokens: int,
        slots: dict[int, int],
    ) -> None:
        """Set the step's token segments (its adapters are in ``slots``)."""
        if self.lora is None:
            raise RuntimeError("broken invariant: self.lora is not None")
        segments: list[tuple[int, int, int]] = []
        offset = 0
        for state, n in zip(states, counts, strict=True):
            if state.lora is not None and state.lora.lora_int_id in slots:
                slot = slots[state.lora.lora_int_id]
                if segments and segments[-1][2] == slot and segments[-1][1] == offset:
                    segments[-1] = (segments[-1][0], offset + n, slot)
                else:
                    segments.append((offset, offset + n, slot))
            offset += n
        self.lora.begin_step(segments, num_tokens)

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        d = self.device
        params = [s.sampling_params for s in states]
        temps = [0.0 if p.greedy else float(p.temperature) for p in params]
        all_greedy = all(t == 0.0 for t in temps)
        all_random = all(t > 0.0 for t in temps)
        use_top_k = any(p.top_k > 0 for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        use_min_p = any(p.min_p > 0.0 for p in params)
        generators: dict[int, torch.Generator] = {}
        for row, (state, p) in enumerate(zip(states, params, strict=True)):
            if p.seed is not None and not p.greedy:
                gen = torch.Generator(device=d)
                gen.manual_seed(step_seed(p.seed, state.num_output_tokens))
                generators[row] = gen
        banned: dict[int, list[int]] = {}
        for row, (state, p) in enumerate(zip(states, params, strict=True)):
            # A grammar decides alone when its output may end (banning the only
            # token it allows would leave nothing to sample).
            if state.num_output_tokens < p.min_tokens and state.matcher is None:
                ids = [*p.stop_token_ids]
                if not p.ignore_eos:
                    ids += list(self.eos_token_ids)
                if ids:
                    banned[row] = ids
        biased: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for row, p in enumerate(params):
            # Ids outside the vocabulary were refused at admission; never index with one.
            pairs = [(t, b) for t, b in p.logit_bias or () if 0 <= t < self.vocab_size]
            if pairs:
                biased[row] = (
                    torch.tensor([t for t, _ in pairs], dtype=torch.int64, device=d),
                    torch.tensor([b for _, b in pairs], dtype=torch.float32, device=d),
                )
        max_logprobs = None
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        if wanted:
            max_logprobs = max(wanted)
        meta = SamplingMetadata(
            temperature=torch.tensor(temps, dtype=torch.float32, device=d),
            all_greedy=all_greedy,
            all_random=all_random,
            top_k=torch.tensor(
                [min(p.top_k, self.vocab_size) if p.top_k > 0 else self.vocab_size for p in params],
                device=d,
            )
            if use_top_k
            else None,
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=d)
            if use_top_p
            else None,
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=d)
            if use_min_p
            else None,
            generators=generators,
            banned_token_ids=banned or None,
            logit_bias=biased or None,
            max_num_logprobs=max_logprobs,
        )
        if any(p.uses_penalties for p in params):
            pad = self.vocab_size
            prompts = [s.token_ids[: s.num_prompt_tokens] for s in states]
            outputs = [s.token_ids[s.num_prompt_tokens :] for s in states]

            def padded(rows: list[list[int]]) -> torch.Tensor:
                width = max(1, max(len(r) for r in rows))
                arr = np.full((len(rows), width), pad, dtype=np.int64)
                for i, r in enumerate(rows):
                    arr[i, : len(r)] = r
                return torch.from_numpy(arr).to(d)

            meta.prompt_token_ids = padded(prompts)
            meta.output_token_ids = padded(outputs)
            meta.presence_penalties = torch.tensor(
                [p.presence_penalty for p in params], dtype=torch.float32, device=d
            )
            meta.frequency_penalties = torch.tensor(
                [p.frequency_penalty for p in params], dtype=torch.float32, device=d
            )
            meta.repetition_penalties = torch.tensor(
                [p.repetition_penalty for p in params], dtype=torch.float32, device=d
            )
        return meta

    # -- step ---------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(out)
        result = ModelRunnerOutput()
        if self.host_kv is not None and out.kv_offload is not None:
            self.host_kv.run(out.kv_offload)
        if self.connector is not None:
            self.connector.start_load_kv(out.kv_connector_metadata)
        if out.total_num_scheduled_tokens:
            self._lora_failed = {}
            try:
                self._run(out, result)
            finally:
                if self.lora is not None:
                    self.lora.end_step()
            for rid, message in self._lora_failed.items():
                # Computed without its adapter: nothing of it goes out.
                result.failed_requests[rid] = message
                result.sampled_token_ids.pop(rid, None)
                result.logprobs.pop(rid, None)
                result.prompt_logprobs.pop(rid, None)
        if self.connector is not None:
            sending, recving, failed = self.connector.get_finished()
            result.finished_sending, result.finished_recving = sending, recving
            result.failed_recving = failed
        if self.host_kv is not None:
            result.offload_stores_done = self.host_kv.finished()
        return result

    def _run(self, out: SchedulerOutput, result: ModelRunnerOutput) -> None:
        batch = self._prepare_inputs(out)
        states, meta, rows = batch.states, batch.attn_metadata, batch.logits_rows
        input_ids, positions = batch.input_ids, batch.positions
        start = time.perf_counter()
        graphs = self.graphs
        lora_step = self.lora is not None and self.lora.context.batch is not None
        if (
            graphs is not None
            and not lora_step
            and meta.is_decode_only
            and graphs.fits(meta.num_seqs)
            and not any(s.sampling_params.prompt_logprobs is not None for s in states)
        ):
            logits = graphs.run(input_ids, positions, meta)
            if len(rows) < meta.num_seqs:
                logits = logits[torch.tensor(rows, device=self.device)]
        else:
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
            self._prompt_logprobs(states, out, hidden)
            if not rows:
                result.forward_seconds = time.perf_counter() - start
                return
            last = torch.tensor(batch.logits_indices, device=self.device)
            logits = self.model.compute_logits(hidden[last])
        sample_states = [states[r] for r in rows]
        meta_s = self._sampling_metadata(sample_states)
        # On CUDA the forward above is still running (launches are asynchronous):
        # the bitmask is filled on the host meanwhile, before the sampler needs it.
        self._fill_bitmasks(sample_states, meta_s)
        sampled = self.sampler(logits, meta_s)
        if self.tp.size > 1 and not meta_s.all_greedy:
            # Every rank keeps the request's tokens: all take rank 0's samples.
            self.tp.broadcast(sampled.sampled_token_ids)
        token_ids = sampled.sampled_token_ids.tolist()  # the step's one host sync
        result.forward_seconds = time.perf_counter() - start
        lp_ids = (
            sampled.logprob_token_ids.tolist() if sampled.logprob_token_ids is not None else None
        )
        lps = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        ranks = sampled.sampled_ranks.tolist() if sampled.sampled_ranks is not None else None
        for i, (row, token) in enumerate(zip(rows, token_ids, strict=True)):
            state = states[row]
            state.token_ids.append(token)
            if state.matcher is not None and not state.matcher.is_terminated():
                state.matcher.accept_token(token)
            result.sampled_token_ids[state.req_id] = token
            n = state.sampling_params.logprobs
            if n is not None and lp_ids is not None and lps is not None and ranks is not None:
                result.logprobs[state.req_id] = Logprobs(
                    lp_ids[i][: 1 + n], lps[i][: 1 + n], ranks[i]
                )
            if state.sampling_params.prompt_logprobs is not None and state.num_output_tokens == 1:
                result.prompt_logprobs[state.req_id] = state.prompt_logprobs

    def _fill_bitmasks(
        self, sample_states: list[CachedRequestState], meta: SamplingMetadata
    ) -> None:
        """The constrained rows' allowed tokens, for the sampler (free rows: none)."""
        constrained = [i for i, s in enumerate(sample_states) if s.matcher is not None]
        if not constrained:
            return
        bitmask = self.grammars.allocate_bitmask(len(constrained))
        self.grammars.fill_bitmask([sample_states[i].matcher for i in constrained], bitmask)
        meta.grammar_rows, meta.grammar_bitmask = constrained, bitmask

    def _prompt_logprobs(
        self, states: list[CachedRequestState], out: SchedulerOutput, hidden: torch.Tensor
    ) -> None:
        offset = 0
        for state in states:
            n = out.num_scheduled_tokens[state.req_id]
            k = state.sampling_params.prompt_logprobs
            start = state.num_computed_tokens
            if k is not None and start < state.num_prompt_tokens:
                if start == 0:
                    state.prompt_logprobs = [None]
                # Hidden state at position p predicts the token at p + 1.
                last = min(start + n, state.num_prompt_tokens - 1)
                if last > start:
                    h = hidden[offset : offset + (last - start)]
                    logprobs = self.model.compute_logits(h).float().log_softmax(dim=-1)
                    targets = torch.tensor(
                        state.token_ids[start + 1 : last + 1], device=self.device
                    )
                    chosen = logprobs.gather(1, targets[:, None])
                    ranks = (logprobs > chosen).sum(dim=-1) + 1
                    if k:
                        top_lp, top_ids = logprobs.topk(k, dim=-1)
                    for j, target in enumerate(targets.tolist()):
                        ids = [target] + (top_ids[j].tolist() if k else [])
                        vals = [chosen[j, 0].item()] + (top_lp[j].tolist() if k else [])
                        state.prompt_logprobs.append(Logprobs(ids, vals, int(ranks[j])))
            offset += n
