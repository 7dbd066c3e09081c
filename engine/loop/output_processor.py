"""Engine-core outputs -> RequestOutputs: detokenization, stop strings, logprobs, n > 1."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from ..core.sched_output import Logprobs
from ..core.scheduler import EngineCoreOutput
from ..outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams
from .detokenizer import IncrementalDetokenizer


@dataclass
class RequestTiming:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None


@dataclass
class IterationStats:
    """What finished or progressed in one step (for latency histograms)."""

    time_to_first_token: list[float] = field(default_factory=list)
    inter_token_latency: list[float] = field(default_factory=list)
    # (finish_reason, e2e seconds, queue seconds, prompt tokens, generation tokens)
    finished: list[tuple[str, float, float, int, int]] = field(default_factory=list)


class ChildState:
    """One sequence of a request (a request with n > 1 has n of them)."""

    def __init__(self, index: int, params: SamplingParams, prompt_ids: list[int], tokenizer: Any):
        self.index = index
        self.params = params
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.detok = (
            IncrementalDetokenizer(
                tokenizer,
                prompt_ids,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )
            if tokenizer is not None
            else None
        )
        self.text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        self.kv_transfer_params: dict[str, Any] | None = None
        # How much has been handed out already (for delta outputs).
        self.sent_tokens = 0
        self.sent_text = 0
        # Delta outputs: this sequence's finish was handed out (it is never sent again).
        self.sent_finish = False
        # Text withheld while it could still turn out to start a stop string.
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        if params.resumed_token_ids:
            self.replay(params.resumed_token_ids)

    def replay(self, token_ids: list[int]) -> None:
        """A migrated request: take the tokens another engine already sent,
        token by token as that engine did, so that the detokenizer, the text
        withheld for stop strings and the sent offsets are what they were
        there; nothing of them is handed out again. Their logprobs went out
        with them: empty entries keep the lists aligned."""
        for token in token_ids:
            self.token_ids.append(token)
            if self.logprobs is not None:
                self.logprobs.append({})
            if self.detok is not None:
                new_text = self.detok.add(token)
                self.text += new_text
                # The other engine found no stop string in these (it went on,
                # and sent them); one here means the request already ended.
                stop = self.check_stop_strings(new_text)
                if stop is not None:
                    raise ValueError(
                        f"migration.output_token_ids: the sent tokens already hold the stop "
                        f"string {stop!r}: nothing to resume"
                    )
        self.sent_tokens = len(self.token_ids)
        self.sent_text = len(self.visible_text())

    def visible_text(self) -> str:
        if self.finish_reason is not None or not self.holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]

    def check_stop_strings(self, new_text: str) -> str | None:
        """Find a stop string in the text added now; trim the text at it."""
        if not self.params.stop or not new_text:
            return None
        window_start = max(0, len(self.text) - len(new_text) - self.holdback)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            idx = self.text.find(stop, window_start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = (
            self.text[: idx + len(stop)]
            if self.params.include_stop_str_in_output
            else self.text[:idx]
        )
        return stop


class RequestState:
    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_ids: list[int],
        params: SamplingParams,
        child_ids: list[str],
        tokenizer: Any,
        arrival: float,
        output_kind: str = "cumulative",
    ) -> None:
        """``output_kind``: ``cumulative`` (everything so far, every step), ``delta``
        (only what is new, every step: for streaming) or ``final`` (once, at the end)."""
        if output_kind not in ("cumulative", "delta", "final"):
            raise ValueError(f"output_kind must be cumulative, delta or final, got {output_kind!r}")
        self.output_kind = output_kind
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_ids = prompt_ids
        self.params = params
        self.child_ids = child_ids
        self.children = {
            cid: ChildState(i, params, prompt_ids, tokenizer) for i, cid in enumerate(child_ids)
        }
        self.timing = RequestTiming(arrival)
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children.values())

    def to_output(self) -> RequestOutput:
        delta = self.output_kind == "delta"
        outs = []
        for c in self.children.values():
            if delta and c.sent_finish:
                # A finished sequence of an n > 1 request: its end was sent once;
                # the steps of its siblings add nothing to it.
                continue
            text = c.visible_text()
            t0, s0 = (c.sent_tokens, c.sent_text) if delta else (0, 0)
            outs.append(
                CompletionOutput(
                    index=c.index,
                    text=text[s0:],
                    token_ids=c.token_ids[t0:],
                    cumulative_logprob=c.cumulative_logprob,
                    logprobs=c.logprobs[t0:] if c.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
            )
            c.sent_tokens, c.sent_text = len(c.token_ids), len(text)
            c.sent_finish = c.finish_reason is not None
        first = next(iter(self.children.values()))
        t = self.timing
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_ids,
            outputs=outs,
            finished=self.finished,
            num_cached_tokens=first.num_cached_tokens,
            kv_transfer_params=first.kv_transfer_params,
            metrics=RequestMetrics(t.arrival, t.first_scheduled, t.first_token, t.finished),
            prompt_logprobs=self.prompt_logprobs,
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add(self, state: RequestState) -> None:
        self.requests[state.request_id] = state
        for cid in state.child_ids:
            self.child_to_parent[cid] = state.request_id

    def parent_of(self, child_id: str) -> RequestState | None:
        parent = self.child_to_parent.get(child_id)
        return self.requests.get(parent) if parent is not None else None

    def _logprob_dict(self, entry: Logprobs) -> dict[int, Logprob]:
        out: dict[int, Logprob] = {}
        rank = entry.rank
        for pos, (tid, lp) in enumerate(zip(entry.token_ids, entry.logprobs, strict=True)):
            if tid in out:
                continue
            decoded = self.tokenizer.decode([tid]) if self.tokenizer is not None else None
            out[tid] = Logprob(lp, rank if pos == 0 else pos, decoded)
        return out

    def process(
        self, core_outputs: list[EngineCoreOutput], stats: IterationStats
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns (outputs of requests that progressed, child ids stopped by a stop string)."""
        now = time.monotonic()
        touched: dict[str, RequestState] = {}
        to_stop: list[str] = []
        for co in core_outputs:
            state = self.parent_of(co.request_id)
            if state is None:
                continue
            child = state.children[co.request_id]
            if child.finish_reason is not None:
                continue
            t = state.timing
            if t.first_scheduled is None and co.scheduled_time is not None:
                t.first_scheduled = co.scheduled_time
            if t.first_token is None:
                t.first_token = now
                stats.time_to_first_token.append(now - t.arrival)
            elif t.last_token is not None and child.index == 0:
                stats.inter_token_latency.append(now - t.last_token)
            if child.index == 0:
                t.last_token = now
            child.num_cached_tokens = co.num_cached_tokens
            if co.prompt_logprobs is not None and state.prompt_logprobs is None:
                state.prompt_logprobs = [
                    None if e is None else self._logprob_dict(e) for e in co.prompt_logprobs
                ]
            for token in co.new_token_ids:
                child.token_ids.append(token)
                if co.new_logprobs is not None and child.logprobs is not None:
                    entry = self._logprob_dict(co.new_logprobs)
                    child.logprobs.append(entry)
                    chosen = co.new_logprobs.logprobs[0]
                    child.cumulative_logprob = (child.cumulative_logprob or 0.0) + chosen
                if child.detok is not None:
                    new_text = child.detok.add(token)
                    if co.finish_reason is not None:
                        new_text += child.detok.flush()
                    child.text += new_text
                    stop = child.check_stop_strings(new_text)
                    if stop is not None and co.finish_reason is None:
                        child.finish_reason, child.stop_reason = "stop", stop
                        to_stop.append(co.request_id)
                        break
            if co.finish_reason is not None and child.finish_reason is None:
                child.finish_reason, child.stop_reason = co.finish_reason, co.stop_reason
            if co.kv_transfer_params is not None:
                # The engine's one encoding of the params it lends (the API's JSON).
                child.kv_transfer_params = co.kv_transfer_params.to_wire()
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if state.finished:
                self._finish(state, now, stats)
            if state.finished or state.output_kind != "final":
                outputs.append(state.to_output())
        return outputs, to_stop

    def _finish(self, state: RequestState, now: float, stats: IterationStats) -> None:
        t = state.timing
        t.finished = now
        queue = (t.first_scheduled or now) - t.arrival
        reason = next(iter(state.children.values())).finish_reason or "stop"
        generated = sum(len(c.token_ids) for c in state.children.values())
        stats.finished.append((reason, now - t.arrival, queue, len(state.prompt_ids), generated))
        self.requests.pop(state.request_id, None)
        for cid in state.child_ids:
            self.child_to_parent.pop(cid, None)

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its child ids for the core to abort."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        for cid in state.child_ids:
            self.child_to_parent.pop(cid, None)
        return list(state.child_ids)
