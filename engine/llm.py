"""The offline API, mirroring vLLM's: ``LLM(model=DIR).generate(prompts, params)``."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .config import EngineArgs
from .loop.llm_engine import LLMEngine, PromptType
from .lora.adapter import LoRARequest
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Messages = list[dict[str, str]]


class LLM:
    """An engine for offline batched generation.

    Keyword arguments are engine arguments (``EngineArgs`` fields), e.g.
    ``LLM(model=DIR, max_num_seqs=64, enable_prefix_caching=False)``.
    """

    def __init__(self, model: str, **engine_args: Any) -> None:
        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}")
        args = EngineArgs(model=model, **engine_args)
        self.engine = LLMEngine.from_engine_args(args, usage_context="llm")

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, a token-id list, or a dict with
        ``prompt_token_ids``); outputs come back in prompt order.
        ``lora_request``: one adapter for every prompt, or one (or None) per
        prompt (needs ``enable_lora=True``)."""
        prompt_list = self._as_list(prompts)
        return self._run(
            prompt_list, sampling_params, use_tqdm, priority, True, lora_request=lora_request
        )

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer (skip_tokenizer_init is set)")
        prompts = []
        for conv in conversations:
            text = tokenizer.apply_chat_template(
                list(conv),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
            )
            prompts.append(
                {
                    "prompt": text,
                    "prompt_token_ids": tokenizer(text, add_special_tokens=False).input_ids,
                }
            )
        return self._run(prompts, sampling_params, use_tqdm, None, add_special_tokens=False)

    @staticmethod
    def _as_list(prompts: Any) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if (
            isinstance(prompts, (list, tuple))
            and prompts
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
        ):
            return [list(prompts)]
        return list(prompts)

    def _run(
        self,
        prompts: Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None,
        add_special_tokens: bool,
        lora_request: Any = None,
    ) -> list[RequestOutput]:
        engine = self.engine
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(prompts)
        else:
            loras = list(lora_request)
            if len(loras) != len(prompts):
                raise ValueError(f"got {len(loras)} lora_request for {len(prompts)} prompts")
        if sampling_params is None:
            params_list = [engine.default_sampling_params()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts"
                )
        ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                rid = engine.new_request_id()
                engine.add_request(
                    rid,
                    prompt,
                    params,
                    priority=priority[i] if priority else 0,
                    add_special_tokens=add_special_tokens,
                    output_kind="final",
                    lora_request=loras[i],
                )
                ids.append(rid)
        except Exception:
            engine.abort_request(ids)  # leave nothing half-submitted behind
            raise
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Generating")
        while len(finished) < len(ids):
            for out in engine.step():
                if out.finished and out.request_id in ids:
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finished[rid] for rid in ids]
