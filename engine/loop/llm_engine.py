"""The synchronous engine: text in, RequestOutputs out, one step at a time."""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..config import EngineArgs, EngineConfig, ModelConfig, UsageContext
from ..config.kv_transfer import kv_bind_host
from ..config.lora import check_adapter_name
from ..contracts.block_hash import lora_identity
from ..contracts.kv_params import LEND_FIELD, KVTransferParams, RefusedParams
from ..kv_transfer.base import KVConnector, KVConnectorScheduler, KVConnectorWorker
from ..lora.adapter import LoRAError, LoRARequest, adapter_digest
from ..models.sources import create_engine_config
from ..outputs import RequestOutput
from ..request import Request
from ..sampling_params import SamplingParams
from .engine_core import EngineCore, StepFailed, StepStats
from .output_processor import IterationStats, OutputProcessor, RequestState

if TYPE_CHECKING:  # xgrammar loads on the first constrained request
    from ..sample.grammar import GrammarCompiler

# Lend requests (peer pulls) go ahead of every queued request: they compute one token.
LEND_PRIORITY = -(2**31)

logger = logging.getLogger(__name__)

# generation_config.json keys that become default sampling parameters.
_GENERATION_DEFAULTS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}

PromptType = str | list[int] | dict[str, Any]


def load_tokenizer(path: str, revision: str | None = None) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, revision=revision, local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {path!r}: {e}") from None


def read_generation_config(model_config: ModelConfig) -> dict[str, Any]:
    source = model_config.generation_config
    if source == "vllm":
        return {}
    directory = (model_config.model_dir or model_config.model) if source == "auto" else source
    path = os.path.join(directory, "generation_config.json")
    if not os.path.exists(path):
        if source != "auto":
            raise ValueError(f"--generation-config {source!r} has no generation_config.json")
        return {}
    with open(path) as f:
        config: dict[str, Any] = json.load(f)
        return config


def child_seed(seed: int, index: int) -> int:
    """The seed of child ``index`` of an n > 1 request, wrapping inside int64."""
    return (seed + index + 2**63) % 2**64 - 2**63


@dataclass(frozen=True)
class PreparedLoRA:
    """An adapter read and checked, not yet served (:meth:`LLMEngine.prepare_lora`)."""

    request: LoRARequest
    identity: str
    """Its prefix-cache identity (``lora_identity``)."""
    read: Any
    """What the executor read (``read_lora``), handed back to ``install_lora``."""


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        connector: tuple[KVConnectorScheduler, KVConnectorWorker] | None = None,
    ) -> None:
        self.config = config
        m = config.model_config
        self.tokenizer = (
            None
            if m.skip_tokenizer_init
            else load_tokenizer(m.tokenizer_path, m.revision if m.tokenizer is None else None)
        )
        gen = read_generation_config(m)
        eos: list[int] = []
        for source in (
            gen.get("eos_token_id"),
            getattr(self.tokenizer, "eos_token_id", None),
            m.hf_config.get("eos_token_id"),
        ):
            for tid in source if isinstance(source, list) else [source]:
                if isinstance(tid, int) and tid not in eos:
                    eos.append(tid)
        self.eos_token_ids = tuple(eos)
        self.default_sampling = {
            ours: gen[theirs_key]
            for theirs_key, ours in _GENERATION_DEFAULTS.items()
            if theirs_key in gen
        }
        # The override speaks the generation config's names (max_new_tokens), as
        # vLLM's --override-generation-config does; ours are the sampling names.
        self.default_sampling.update(
            {_GENERATION_DEFAULTS.get(k, k): v for k, v in m.override_generation_config.items()}
        )
        kv = config.kv_transfer_config
        if connector is None and kv is not None and kv.kv_connector is not None:
            from ..kv_transfer.connector import create_connector

            connector = create_connector(config)
        self.connector: KVConnector | None = None if connector is None else KVConnector(*connector)
        self.core = EngineCore(config, self.eos_token_ids, self.connector)
        self.output = OutputProcessor(self.tokenizer)
        self.kv_events = None
        ev = config.kv_events_config
        if ev is not None and ev.enable_kv_cache_events and ev.publisher == "zmq":
            from ..contracts import security
            from ..kv_events import KVEventPublisher

            # The ports bind the engine's KV address when it has one (the pod IP).
            kv_ip = kv_bind_host(kv)
            self.kv_events = KVEventPublisher(ev, kv_ip, security.fleet_secret_from_env())
        self.iteration_stats = IterationStats()
        self._next_id = 0
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        # Served LoRA adapters by name, each with its load id and prefix-cache
        # identity; requests per adapter since the start (metrics).
        self.loras: dict[str, LoRARequest] = {}
        self.lora_identities: dict[str, str] = {}
        self.lora_requests: dict[str, int] = {}
        # Load ids (any thread may draw one: a run-time load reads off the engine thread).
        self._lora_ids = itertools.count(1)
        if config.lora_config is not None:
            for name, path in config.lora_config.lora_modules.items():
                self.add_lora(name, path)
        logger.info("Engine ready: %s", config.summary())

    @classmethod
    def from_engine_args(cls, args: EngineArgs, usage_context: UsageContext = "llm") -> LLMEngine:
        return cls(create_engine_config(args, usage_context=usage_context))

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler_config.max_model_len

    # -- input ----------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self.default_sampling)

    def tokenize(
        self, prompt: PromptType, add_special_tokens: bool = True
    ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "prompt: this engine has no tokenizer (skip_tokenizer_init); pass token ids"
                )
            return prompt, self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(
            f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
        )

    def validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise ValueError("prompt: the prompt is empty")
        vocab = self.config.model_config.vocab_size
        for tid in prompt_ids:
            if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab:
                raise ValueError(
                    f"prompt: token id {tid!r} is outside the vocabulary (0..{vocab - 1})"
                )
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt: the prompt is {len(prompt_ids)} tokens, which leaves no room for output "
                f"within max_model_len ({self.max_model_len}); shorten the prompt"
            )

    @property
    def built_grammars(self) -> GrammarCompiler | None:
        """The grammar compiler if a constrained request built it, else None."""
        return self._grammars

    @property
    def grammars(self) -> Any:
        """The grammar compiler and cache (built on first use; thread-safe)."""
        with self._grammars_lock:
            if self._grammars is None:
                if self.config.parallel_config.tensor_parallel_size > 1:
                    raise ValueError(
                        "structured_outputs: not supported with --tensor-parallel-size > 1 "
                        "yet (the rank processes hold no grammar matchers)"
                    )
                if self.tokenizer is None:
                    raise ValueError(
                        "structured_outputs: this engine has no tokenizer (skip_tokenizer_init), "
                        "which grammars need"
                    )
                from ..sample.grammar import GrammarCompiler

                self._grammars = GrammarCompiler(
                    self.tokenizer,
                    self.config.model_config.vocab_size,
                    self.eos_token_ids,
                    self.config.admission_config,
                )
                self.core.runner.attach_grammars(self._grammars)
            return self._grammars

    # -- LoRA adapters --------------------------------------------------------------

    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Load an adapter under ``name``; raises LoRAError (a ValueError) naming it
        when it cannot be served, and then nothing changes."""
        return self.install_lora(self.prepare_lora(name, path))

    def prepare_lora(self, name: str, path: str) -> PreparedLoRA:
        """The slow half of a load: check the name, read and check the adapter and
        hash the bytes it read. Changes nothing, so it may run on any thread while the
        engine keeps stepping (the server's loads do); :meth:`install_lora` then
        makes it servable on the engine thread. Raises LoRAError naming it."""
        lc = self.config.lora_config
        if lc is None:
            raise LoRAError(
                f"LoRA adapter {name!r}: LoRA is not enabled on this engine (--enable-lora)"
            )
        try:
            check_adapter_name(name)
        except ValueError as e:
            raise LoRAError(str(e), bad_name=True) from None
        if name in self.config.model_config.served_model_names:
            raise LoRAError(f"LoRA adapter {name!r}: the name is the base model's", bad_name=True)
        if name in self.loras:
            try:
                identity = lora_identity(name, adapter_digest(name, os.path.abspath(path)))
            except LoRAError:
                identity = None  # unreadable: not the same adapter
            self._check_not_loaded(name, identity)
        request = LoRARequest(name, next(self._lora_ids), os.path.abspath(path))
        read = self.core.runner.read_lora(request)  # LoRAError when it cannot be served
        # The digest of exactly the bytes read (config and weights), never a
        # second read of files that may have changed since.
        identity = lora_identity(name, read.digest)
        return PreparedLoRA(request, identity, read)

    def install_lora(self, prepared: PreparedLoRA) -> LoRARequest:
        """Serve a prepared adapter (the engine thread only; quick: no disk)."""
        request = prepared.request
        self._check_not_loaded(request.lora_name, prepared.identity)
        self.core.runner.install_lora(prepared.read)
        self.loras[request.lora_name] = request
        self.lora_identities[request.lora_name] = prepared.identity
        logger.info("LoRA adapter %r loaded from %s", request.lora_name, request.lora_path)
        return request

    def _check_not_loaded(self, name: str, identity: str | None) -> None:
        """LoRAError when ``name`` is loaded: ``already_loaded`` when from the
        files of ``identity`` (``lora_identity``: name and the files' digest)."""
        if name not in self.loras:
            return
        if identity is not None and self.lora_identities.get(name) == identity:
            raise LoRAError(
                f"LoRA adapter {name!r} is already loaded from the same weights",
                already_loaded=True,
            )
        raise LoRAError(
            f"LoRA adapter {name!r} is already loaded with other weights; unload it first",
            name_taken=True,
        )

    def remove_lora(self, name: str, lora_int_id: int | None = None) -> None:
        """Unload an adapter: new requests naming it are refused; requests
        already running with it finish with it. ``lora_int_id``: unload it
        only when it is loaded under that id (else LoRAError, ``wrong_id``)."""
        request = self.loras.get(name)
        if request is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        if lora_int_id is not None and lora_int_id != request.lora_int_id:
            raise LoRAError(
                f"LoRA adapter {name!r} is loaded with lora_int_id {request.lora_int_id}, "
                f"not {lora_int_id}",
                wrong_id=True,
            )
        del self.loras[name]
        self.lora_identities.pop(name, None)
        self.core.runner.remove_lora(request.lora_int_id)
        logger.info("LoRA adapter %r unloaded", name)

    def resolve_lora(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model or unknown)."""
        return self.loras.get(model) if model else None

    def new_request_id(self) -> str:
        self._next_id += 1
        return str(self._next_id)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        kv_transfer_params: Mapping[str, Any] | None = None,
        add_special_tokens: bool = True,
        output_kind: str = "cumulative",
        group: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validate and queue a request; raises ValueError (nothing queued) on bad input.

        ``output_kind``: ``cumulative``, ``delta`` (streaming) or ``final`` (see
        :class:`RequestState`). ``group``: the client request this one is part
        of (a prompt of a batch); the children of an ``n > 1`` request form a
        group on their own. The scheduler bounds a group's share of a step.
        ``lora_request``: the adapter to run with (loaded by :meth:`add_lora`,
        or loaded now).
        ``kv_transfer_params``: the request's JSON object, decoded (and for a
        decode leg verified) here by the KV connector."""
        params = params if params is not None else self.default_sampling_params()
        bound = self.config.model_config.max_logprobs
        params.verify(None if bound == -1 else bound)
        child_ids = (
            [request_id] if params.n == 1 else [f"{request_id}-{i}" for i in range(params.n)]
        )
        # A parent id, or any child id, that another request uses would mix their outputs.
        if request_id in self.output.requests or any(
            cid in self.output.child_to_parent or cid in self.core.scheduler.requests
            for cid in child_ids
        ):
            raise ValueError(f"request id {request_id!r} is already in use")
        vocab = self.config.model_config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(
                f"stop_token_ids: token id {bad[0]} is outside the model's vocabulary "
                f"(0..{vocab - 1})"
            )
        lora = self._request_lora(lora_request)
        text, prompt_ids = self.tokenize(prompt, add_special_tokens)
        self.validate_prompt(prompt_ids)
        resumed = params.resumed_token_ids
        if resumed:
            # A migrated request: its sent tokens are checked as a prompt is.
            try:
                self.validate_prompt(prompt_ids + resumed)
            except ValueError as e:
                raise ValueError(
                    f"migration.output_token_ids: {str(e).removeprefix('prompt: ')}"
                ) from None
            # Sent tokens that already end the request (a stop token or the end
            # of sequence where one may be sampled): the first engine finished
            # it there, and a resumed leg would run on past its end.
            ends = set(params.stop_token_ids)
            if not params.ignore_eos:
                ends.update(self.eos_token_ids)
            for at, token in enumerate(resumed):
                if token in ends and at >= params.min_tokens:
                    raise ValueError(
                        f"migration.output_token_ids: token {at} ({token}) already ends the "
                        "request (a stop token or the end of sequence): nothing to resume"
                    )
        if params.structured_outputs is not None:
            # The server compiles before admission (off this thread) and pins the
            # result on the spec; offline callers compile here.
            self.grammars.compile(params.structured_outputs)
        kv_params: KVTransferParams | None = None
        if kv_transfer_params:
            if self.connector is None:
                # No connector: compute the prompt here (aggregated serving), hold nothing.
                KVTransferParams.from_wire(kv_transfer_params)
            else:
                kv_params = self.connector.scheduler.accept(kv_transfer_params)
        if kv_params is not None and kv_params.lend_blocks is not None:
            prompt_ids, params, priority = self._lend(kv_params, prompt_ids, params)
        if params.max_tokens is None:
            params = params.clone(max_tokens=self.max_model_len - len(prompt_ids))
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        requests = []
        for i, cid in enumerate(child_ids):
            child_params = (
                params
                if params.n == 1
                else params.clone(
                    n=1, seed=None if params.seed is None else child_seed(params.seed, i)
                )
            )
            requests.append(
                Request(
                    request_id=cid,
                    prompt_token_ids=prompt_ids,
                    sampling_params=child_params,
                    # A resumed request starts as a preempted one: its sent
                    # tokens are recomputed (or found in the prefix cache).
                    output_token_ids=list(resumed),
                    eos_token_ids=self.eos_token_ids,
                    arrival_time=arrival,
                    priority=priority,
                    kv_transfer_params=kv_params,
                    # Siblings wait for the first one's prefill and then share its cached blocks.
                    wait_for=child_ids[0]
                    if i and self.config.cache_config.enable_prefix_caching
                    else None,
                    group_id=group if group is not None or params.n == 1 else request_id,
                    lora_name=lora.lora_name if lora is not None else None,
                    lora_path=lora.lora_path if lora is not None else None,
                    lora_id=lora.lora_int_id if lora is not None else 0,
                    lora_identity=self.lora_identities[lora.lora_name] if lora else None,
                )
            )
        self.output.add(
            RequestState(
                request_id,
                text,
                prompt_ids,
                params,
                child_ids,
                self.tokenizer,
                arrival,
                output_kind,
            )
        )
        for r in requests:
            self.core.add_request(r)
        if lora is not None:
            self.lora_requests[lora.lora_name] = self.lora_requests.get(lora.lora_name, 0) + 1

    def _request_lora(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        """The loaded adapter a request runs with (an offline caller's new
        LoRARequest is loaded first, as vLLM's LLM does)."""
        if lora_request is None:
            return None
        loaded = self.loras.get(lora_request.lora_name)
        if loaded is None:
            return self.add_lora(lora_request.lora_name, lora_request.lora_path)
        if os.path.abspath(lora_request.lora_path) != loaded.lora_path:
            raise LoRAError(
                f"LoRA adapter {lora_request.lora_name!r} is loaded from {loaded.lora_path!r}, "
                f"not {lora_request.lora_path!r}"
            )
        return loaded

    def _lend(
        self, p: KVTransferParams, prompt_ids: list[int], params: SamplingParams
    ) -> tuple[list[int], SamplingParams, int]:
        """A lend request (docs/peer-pull.md): the first ``lend_blocks`` full blocks of
        the prompt and the one token after them, one output token, ahead of every
        queued request. The scheduler refuses it unless its prefix cache holds all
        of those blocks; when it finishes they are leased as a prefill leg's."""
        n = p.lend_blocks
        bs = self.config.cache_config.block_size
        if not p.do_remote_decode:
            raise RefusedParams(f"kv_transfer_params: {LEND_FIELD} needs do_remote_decode")
        if n is None or n < 1:
            raise RefusedParams(f"kv_transfer_params: {LEND_FIELD} must be at least 1")
        if not self.config.cache_config.enable_prefix_caching:
            raise RefusedParams(
                f"kv_transfer_params: {LEND_FIELD} needs prefix caching on this engine"
            )
        if params.n != 1 or params.prompt_logprobs is not None:
            raise RefusedParams(f"kv_transfer_params: {LEND_FIELD} takes n=1, no prompt_logprobs")
        if len(prompt_ids) < n * bs + 1:
            raise RefusedParams(
                f"kv_transfer_params: {LEND_FIELD} {n} needs at least {n * bs + 1} prompt "
                f"tokens, the prompt has {len(prompt_ids)}"
            )
        return prompt_ids[: n * bs + 1], params.clone(max_tokens=1, min_tokens=0), LEND_PRIORITY

    def fail_step(self, failure: StepFailed) -> list[str]:
        """Fail every request of a step that raised; returns their (parent) ids.

        Their blocks are freed and unpublished; the engine keeps serving the
        others."""
        parents = list(
            dict.fromkeys(
                self.output.child_to_parent[rid]
                for rid in failure.request_ids
                if rid in self.output.child_to_parent
            )
        )
        core_ids = list(failure.request_ids)
        for parent in parents:
            core_ids += self.output.abort(parent)
        self.core.fail_requests(list(dict.fromkeys(core_ids)))
        return parents

    def abort_request(self, request_ids: list[str] | str) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            self.core.abort_requests(self.output.abort(rid))

    # -- loop -----------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.output.requests) or self.core.has_work()

    def serve_lends(self) -> list[RequestOutput]:
        """Between steps: the outputs of lends answered without a forward pass
        (``EngineCore.serve_lends``); ``step`` serves them too, with its own."""
        core_outputs = self.core.serve_lends()
        if not core_outputs:
            return []
        outputs, _ = self.output.process(core_outputs, self.iteration_stats)
        return outputs

    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        if self.core.failed_loras:
            self._unload_failed_loras()
        if self.kv_events is not None:
            self.kv_events.publish(self.core.scheduler.take_kv_events())
        outputs, stopped = self.output.process(core_outputs, self.iteration_stats)
        if stopped:
            self.core.stop_requests(stopped)
            # Parents whose last child just hit a stop string are finished now.
        return outputs

    def _unload_failed_loras(self) -> None:
        """Unload the adapters a step could not read (their directory gone, or
        their files changed since the load): new requests naming one get a
        404 and it leaves ``/v1/models`` until it is loaded again. Requests of
        it already admitted fail when they run, as the step's did."""
        failed, self.core.failed_loras = self.core.failed_loras, {}
        for lora_id, why in failed.items():
            name = next((n for n, r in self.loras.items() if r.lora_int_id == lora_id), None)
            if name is not None:
                logger.warning("LoRA adapter %r unloaded: a step could not read it: %s", name, why)
                self.remove_lora(name)

    def take_iteration_stats(self) -> IterationStats:
        stats, self.iteration_stats = self.iteration_stats, IterationStats()
        return stats

    @property
    def stats(self) -> StepStats:
        return self.core.last_stats

    def unhealthy_reason(self) -> str | None:
        """Why this engine must report itself unhealthy although its loop runs."""
        return self.connector.scheduler.unhealthy() if self.connector is not None else None

    def wait_for_kv_leases(self) -> int:
        """Prefill drain: wait (bounded by the lease) until the KV blocks held for
        decode engines are claimed or expired; the engine loop must keep running.
        Returns the leases still held."""
        if self.connector is None:
            return 0
        left = self.connector.scheduler.wait_for_leases()
        if left:
            logger.warning("shutting down with %d KV leases unclaimed", left)
        return left

    def shutdown(self) -> None:
        if self._grammars is not None:
            self._grammars.close()
        self.core.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()
