"""What the user sees, built from what the engine core reports: incremental detokenization,
stop strings, cumulative outputs with their deltas, logprobs, n > 1 children merged into their
parent, and the token-timing metrics (vLLM v1's OutputProcessor).

It reads EngineCoreOutputs and never writes a Request's state: a stop string it finds comes back to
the engine as a request to finish, which the scheduler carries out. It shares one object with the
Request, its RequestMetrics: the token-timing fields (first/last token, token_times, generated
tokens, finished) are written here, the scheduling ones by the scheduler."""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Iterable

from twostep.core.step_outputs import EngineCoreOutput
from twostep.core.scheduling.request import Request
from twostep.engine.input_processor import ProcessedPrompt
from twostep.engine.parallel_sampling import ParentRequest
from twostep.engine.trace import StepTracer
from twostep.outputs import (CompletionOutput, PoolingOutput, PoolingRequestOutput, PositionLogprobs, RequestMetrics,
                             RequestOutput)
from twostep.sampling_params import RequestOutputKind, SamplingParams
from twostep.tokenizer.detokenizer import IncrementalDetokenizer
from twostep.tokenizer.tokenizer import Tokenizer


@dataclass(eq=False)
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    emitted_text: str = ""           # text handed out so far (deltas concatenated)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    kv_transfer_params: dict | None = None   # a producer's finished prefill: where its blocks wait


@dataclass(slots=True)
class PoolingState:
    """A pooling request as the user sees it: one output, when it ends (with its vector, or without)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics


@dataclass(slots=True)
class ProcessedOutputs:
    outputs: list[RequestOutput | PoolingRequestOutput] = field(default_factory=list)
    stopped_by_string: list[tuple[str, str]] = field(default_factory=list)   # (request id, stop string)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}
        self.pooling: dict[str, PoolingState] = {}   # pooling requests (no text, no tokens)
        self.parents: dict[str, ParentRequest] = {}  # n > 1: parent and child ids -> parent
        self.num_generated_tokens = 0
        self.tracer: StepTracer | None = None

    def add(self, processed: ProcessedPrompt) -> None:
        for request in processed.requests:
            if request.pooling_params is not None:
                self.pooling[request.request_id] = PoolingState(request.request_id, processed.prompt,
                                                                request.prompt_token_ids, request.metrics)
                continue
            self.states[request.request_id] = self._state(processed.prompt, request)
        if processed.parent is not None:
            for rid in processed.request_ids:
                self.parents[rid] = processed.parent

    def is_known(self, request_id: str) -> bool:
        return request_id in self.states or request_id in self.parents or request_id in self.pooling

    def expand_parents(self, request_ids: Iterable[str]) -> list[str]:
        """A parent's id stands for its children."""
        out = []
        for rid in request_ids:
            parent = self.parents.get(rid)
            out.extend(parent.child_ids if parent is not None and rid == parent.request_id else [rid])
        return out

    def process(self, core_outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        now = time.monotonic()
        for core in core_outputs:
            if core.request_id in self.pooling:
                if core.finish_reason is not None:
                    result.outputs.append(self._pooling_output(core.request_id, core.finish_reason,
                                                               core.stop_reason, core.pooled, now))
                continue
            state = self.states[core.request_id]
            if core.new_prompt_logprobs:
                if state.params.detokenize:
                    for entry in core.new_prompt_logprobs:
                        if entry is not None:
                            self._decode_logprob_tokens(entry)
                state.prompt_logprobs.extend(core.new_prompt_logprobs)
            if not core.new_token_ids and core.finish_reason is None:
                continue                         # a prompt chunk that samples nothing
            if core.kv_transfer_params is not None:
                state.kv_transfer_params = core.kv_transfer_params
            prev_len = len(state.output_token_ids)
            stop_string = self._add_tokens(state, core, now)
            if stop_string is not None:
                result.stopped_by_string.append((core.request_id, stop_string))
                self._finish(state, "stop", stop_string, now)
            elif core.finish_reason is not None:
                self._finish(state, core.finish_reason, core.stop_reason, now)
            if state.finish_reason is None and state.params.output_kind is RequestOutputKind.FINAL_ONLY:
                continue                         # nothing to hand out yet: its text is taken at the end
            out = _of_kind(self._make_output(state, prev_len), state.params.output_kind)
            if out is not None:
                result.outputs.append(out)
        return result

    def finish(self, request_id: str, finish_reason: str,
               stop_reason: int | str | None) -> RequestOutput | PoolingRequestOutput:
        """The final output of a request ended from outside (abort, timeout)."""
        if request_id in self.pooling:
            return self._pooling_output(request_id, finish_reason, stop_reason, None, time.monotonic())
        state = self.states[request_id]
        self._finish(state, finish_reason, stop_reason, time.monotonic())
        out = self._make_output(state, None)
        return _of_kind(out, state.params.output_kind) or out

    def _pooling_output(self, request_id: str, reason: str, stop_reason: int | str | None,
                        vector, now: float) -> PoolingRequestOutput:
        """A pooling request's one output: its vector (None when it ended without one)."""
        state = self.pooling.pop(request_id)
        state.metrics.finished_time = now
        if self.tracer is not None:
            self.tracer.record_request(request_id, state.metrics, reason)
        return PoolingRequestOutput(request_id, None if vector is None else PoolingOutput(vector),
                                    state.prompt_token_ids, True, state.metrics, state.prompt,
                                    state.metrics.num_cached_tokens, reason, stop_reason)

    def _decode_logprob_tokens(self, entry: PositionLogprobs) -> None:
        """Fill each Logprob's decoded_token (the token's own text, special tokens included)."""
        for token_id, lp in entry.items():
            if lp.decoded_token is None:
                lp.decoded_token = self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _add_tokens(self, state: RequestState, core: EngineCoreOutput, now: float) -> str | None:
        """Take in the step's tokens in order; the stop string one of them completes, if any (the
        tokens after it are dropped)."""
        m, p = state.metrics, state.params
        if core.new_token_ids and m.first_token_time is None:
            m.first_token_time = now
        last = len(core.new_token_ids) - 1
        stop_string = None
        for j, token in enumerate(core.new_token_ids):
            self.num_generated_tokens += 1
            m.token_times.append(now)
            state.output_token_ids.append(token)
            logprobs = core.new_logprobs[j] if core.new_logprobs else None
            if logprobs is not None:
                if p.detokenize:
                    self._decode_logprob_tokens(logprobs)
                state.logprobs.append(logprobs)
                state.cumulative_logprob += logprobs[token].logprob
            if j == last and core.stopped_on_token:
                break                            # EOS or a stop token id: not part of the text
            if not p.detokenize:
                continue                         # token ids only (vLLM's detokenize=False)
            past_min = len(state.output_token_ids) >= p.min_tokens
            matched = state.detokenizer.update([token], check_stop=past_min)
            if past_min and matched is not None:
                stop_string = matched
                break
        if core.new_token_ids:
            m.last_token_time = now
            m.num_generated_tokens = len(state.output_token_ids)
        return stop_string

    def _finish(self, state: RequestState, reason: str, stop_reason: int | str | None, now: float) -> None:
        state.finish_reason, state.stop_reason = reason, stop_reason
        state.metrics.finished_time = now

    def _make_output(self, state: RequestState, new_tokens_from: int | None) -> RequestOutput:
        det, finished = state.detokenizer, state.finish_reason is not None
        delta = det.get_delta()
        if finished:
            delta += det.flush()  # the held-back tail (a stop string already cut it off)
        state.emitted_text += delta
        ids, wants_logprobs = state.output_token_ids, state.params.logprobs is not None
        completion = CompletionOutput(
            index=0, text=state.emitted_text, token_ids=list(ids),
            cumulative_logprob=state.cumulative_logprob if wants_logprobs else None,
            logprobs=list(state.logprobs) if wants_logprobs else None,
            finish_reason=state.finish_reason, stop_reason=state.stop_reason, delta_text=delta,
            delta_token_ids=list(ids[new_tokens_from:]) if new_tokens_from is not None else [],
        )
        if finished:
            self.states.pop(state.request_id, None)
            if self.tracer is not None:
                self.tracer.record_request(state.request_id, state.metrics, state.finish_reason)
        out = RequestOutput(
            request_id=state.request_id, prompt=state.prompt, prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs, outputs=[completion], finished=finished,
            metrics=state.metrics, num_cached_tokens=state.metrics.num_cached_tokens,
            kv_transfer_params=state.kv_transfer_params,
        )
        return self._merge_into_parent(out)

    def _merge_into_parent(self, out: RequestOutput) -> RequestOutput:
        parent = self.parents.get(out.request_id)
        if parent is None:
            return out
        merged = parent.merge(out)
        if merged.finished:
            for rid in (parent.request_id, *parent.child_ids):
                self.parents.pop(rid, None)
        return merged

    def _state(self, prompt: str | None, request: Request) -> RequestState:
        p = request.params
        return RequestState(
            request.request_id, prompt, request.prompt_token_ids, p, request.metrics,
            IncrementalDetokenizer(self.tokenizer, p.stop, p.include_stop_str_in_output,
                                   p.skip_special_tokens),
            prompt_logprobs=[None] if p.prompt_logprobs is not None else None)


def _of_kind(out: RequestOutput, kind: RequestOutputKind) -> RequestOutput | None:
    """The output as the request's output_kind wants it: as is (cumulative), only what is new
    (delta), or nothing until it finishes (final only)."""
    if kind is RequestOutputKind.CUMULATIVE:
        return out
    if kind is RequestOutputKind.FINAL_ONLY:
        return out if out.finished else None
    changed = [c for c in out.outputs if c.delta_text or c.delta_token_ids] or out.outputs
    deltas = [dataclasses.replace(c, text=c.delta_text, token_ids=list(c.delta_token_ids),
                                  logprobs=None if c.logprobs is None else c.logprobs[len(c.logprobs) - len(c.delta_token_ids):])
              for c in changed]
    return dataclasses.replace(out, outputs=deltas)
