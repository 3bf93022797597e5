"""The engine loop: add requests, step, abort. Each step schedules, runs the model once on a
mixed batch of prefill chunks and decodes, samples, and turns new tokens into outputs."""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from twostep.config import EngineConfig, resolve_device, resolve_dtype
from twostep.core.detokenizer import IncrementalDetokenizer
from twostep.core.model_runner import ModelRunner, StepResult
from twostep.core.parallel_sampling import ParentRequest, child_params
from twostep.core.request import Request
from twostep.core.sampler import Sampler, make_generator
from twostep.core.scheduler import Scheduler
from twostep.core.tokenizer import Tokenizer
from twostep.core.trace import StepTracer
from twostep.kv.cache_tensors import KVCachePlan, allocate_kv_cache, plan_kv_cache
from twostep.kv.kv_cache_manager import KVCacheManager
from twostep.layers.attention import get_attention_backend
from twostep.layers.kv_storage import kv_format
from twostep.models.cpu_kernels import apply_cpu_kernels
from twostep.models.loader import build_model, load_checkpoint, resolve_model_path
from twostep.outputs import CompletionOutput, RequestMetrics, RequestOutput
from twostep.sampling_params import SamplingParams
from twostep.spec_decode.draft_model import TargetShape
from twostep.spec_decode.proposer import make_proposer
from twostep.spec_decode.stats import SpecDecodeStats

logger = logging.getLogger(__name__)

PromptInput = str | list[int]


@dataclass(slots=True)
class EngineStats:
    """Counters since start; figures are derived from these, never estimated."""

    num_steps: int = 0
    num_prefill_tokens: int = 0      # prompt (and recomputed) tokens pushed through the model
    num_decode_tokens: int = 0       # tokens generated
    num_preemptions: int = 0
    peak_blocks_used: int = 0


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.model_path = resolve_model_path(config.model)
        ckpt = load_checkpoint(self.model_path, self.dtype)
        self.model_config = ckpt.config
        self.tokenizer = _make_tokenizer(ckpt)
        self.max_model_len = _max_model_len(config, ckpt.config)
        self.model = build_model(ckpt, self.dtype, self.device, self.max_model_len)
        for line in apply_cpu_kernels(self.model, self.dtype, self.device, config.cpu_prepack_weights,
                                      config.cpu_gemv):
            logger.info(line)
        self.generation_config = dict(ckpt.generation_config or {})
        del ckpt
        self.eos_token_ids = _eos_ids(self.tokenizer, self.model_config, self.model_path)
        self.kv_plan = self._plan_kv()
        logger.info("%s; largest context that fits: %d tokens (max_model_len %d)",
                    self.kv_plan.describe(), min(self.kv_plan.num_tokens, self.max_model_len),
                    self.max_model_len)
        self.kv = KVCacheManager(self.kv_plan.num_blocks, config.block_size,
                                 config.enable_prefix_caching)
        kv_caches = allocate_kv_cache(self.kv_plan, self.model_config.num_layers,
                                      self.model_config.num_kv_heads, self.model_config.head_dim,
                                      self.dtype, self.device, self.kv_format)
        sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed))
        self.runner = ModelRunner(self.model, kv_caches, config.block_size,
                                  get_attention_backend(config.attention_backend, self.device), self.device, sampler)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.spec_config = config.speculative_config
        self.spec_stats = SpecDecodeStats()
        self.proposer = None if self.spec_config is None else make_proposer(
            self.spec_config, TargetShape(self.dtype, self.device, self.model_config.vocab_size,
                                          self.max_model_len, config.block_size, self.kv_plan.num_blocks,
                                          config.max_num_batched_tokens, config.attention_backend,
                                          config.cpu_prepack_weights, config.cpu_gemv),
            sampler)
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self._pending: list[RequestOutput] = []
        self._parents: dict[str, ParentRequest] = {}   # n > 1: parent and child ids -> parent
        self.tracer: StepTracer | None = None          # set by enable_tracing()
        self._next_id = 0
        logger.info("model %s: %s, %d layers, dtype %s on %s, max_model_len %d",
                    self.model_path, self.model_config.architecture, self.model_config.num_layers,
                    str(self.dtype).removeprefix("torch."), self.device, self.max_model_len)

    @classmethod
    def from_args(cls, **kwargs) -> "LLMEngine":
        return cls(EngineConfig(**kwargs))

    def _plan_kv(self) -> KVCachePlan:
        """The pool sizes itself in bytes: an 8-bit format gets about twice bf16's blocks."""
        c, m = self.config, self.model_config
        self.kv_format = kv_format(c.kv_cache_dtype)
        per_token = self.kv_format.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, self.dtype)
        plan = plan_kv_cache(per_token, c.block_size, self.device, c.kv_cache_memory,
                             c.kv_cache_memory_fraction, c.max_num_seqs * self.max_model_len,
                             c.num_kv_blocks)
        name = self.kv_format.name if self.kv_format.storage else str(self.dtype).removeprefix("torch.")
        if self.kv_format.quantized:
            plain = kv_format("auto").bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, self.dtype)
            logger.info("%s KV: %.2fx the tokens of %s KV in the same memory", name, plain / per_token,
                        str(self.dtype).removeprefix("torch."))
        return dataclasses.replace(plan, kv_dtype=name, scaled=self.kv_format.quantized)

    # ---- public API -------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """The model authors' defaults from generation_config.json (temperature, top_p, top_k,
        min_p, repetition_penalty; do_sample=false means greedy), else SamplingParams()."""
        g = self.generation_config
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        found = {k: g[k] for k in keys if g.get(k) is not None}
        if g.get("do_sample") is False:
            found["temperature"] = 0.0
        return SamplingParams(**found)

    def add_request(self, prompt: PromptInput, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Validate, tokenize and queue a request; raises ValueError on bad input, leaving
        the engine and every other request untouched."""
        params = params or self.default_sampling_params()
        if request_id is None:
            request_id = self._new_id()
        self._check_params(params)
        text, ids = self._tokenize(prompt)
        self._check_prompt(ids)
        arrival = arrival_time or time.monotonic()
        if params.n == 1:
            self._check_id_free(request_id)
            self._register(self._make_request(request_id, text, ids, params, arrival))
            return request_id
        # n > 1: build every child first, so a failure adds nothing.
        parent = ParentRequest(request_id, params.n)
        for rid in (request_id, *parent.child_ids):
            self._check_id_free(rid)
        children = [self._make_request(cid, text, ids, child_params(params, i), arrival)
                    for i, cid in enumerate(parent.child_ids)]
        self._parents[request_id] = parent
        for child in children:
            self._parents[child.request_id] = parent
            self._register(child)
        return request_id

    def _check_id_free(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self._parents:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def _make_request(self, request_id: str, text: str | None, ids: list[int],
                      params: SamplingParams, arrival_time: float) -> Request:
        params = dataclasses.replace(params)
        params.all_stop_token_ids = set() if params.ignore_eos else set(self.eos_token_ids)
        request = Request(
            request_id=request_id, prompt=text, prompt_token_ids=ids, params=params,
            metrics=RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(ids),
                                   spec_decode=SpecDecodeStats() if self.proposer else None),
            generator=make_generator(params.seed, self.device),
            detokenizer=IncrementalDetokenizer(self.tokenizer, params.stop,
                                               params.include_stop_str_in_output,
                                               params.skip_special_tokens),
        )
        limit = self.max_model_len if params.max_tokens is None else len(ids) + params.max_tokens
        request.max_total_tokens = min(limit, self.max_model_len)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None]
        return request

    def _register(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort_request(self, request_ids: str | Iterable[str], emit_output: bool = True,
                      finish_reason: str = "abort", stop_reason: str | None = None) -> None:
        """Stop requests wherever they are and free their blocks. Their final output
        (finish_reason "abort" unless told otherwise, e.g. "length" with stop_reason
        "timeout" for a deadline) comes from the next step(), unless emit_output is False."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in self._expand_parents(request_ids):
            request = self.requests.get(rid)
            if request is not None and not request.is_finished:
                request.stop_reason = stop_reason
                self._finish(request, finish_reason)
                out = self._make_output(request)
                if emit_output:
                    self._pending.append(out)

    def _expand_parents(self, request_ids: Iterable[str]) -> list[str]:
        out = []
        for rid in request_ids:
            parent = self._parents.get(rid)
            out.extend(parent.child_ids if parent is not None and rid == parent.request_id else [rid])
        return out

    def get_stats(self) -> dict:
        """Counters since start, and what follows from them."""
        st, pc = self.stats, self.kv.prefix_stats
        return {
            "num_steps": st.num_steps, "num_prefill_tokens": st.num_prefill_tokens,
            "num_decode_tokens": st.num_decode_tokens, "num_preemptions": st.num_preemptions,
            "peak_blocks_used": st.peak_blocks_used, "num_blocks": self.kv.pool.num_blocks,
            "blocks_in_use": self.kv.pool.num_used_blocks,
            "prefix_cache_queries": pc.queries, "prefix_cache_hits": pc.hits,
            "prefix_cache_hit_rate": pc.hit_rate,
            "prefix_cache_blocks": self.kv.pool.num_cached_blocks,
            "prefix_cache_evictions": self.kv.pool.num_evictions,
        } | ({f"spec_decode_{k}": v for k, v in self.spec_stats.as_dict().items()}
             if self.proposer else {})

    def enable_tracing(self) -> StepTracer:
        """Record every step and request from now on (Chrome trace-event JSON)."""
        if self.tracer is None:
            self.tracer = StepTracer()
        return self.tracer

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests (cached-but-evictable blocks count as free)."""
        return self.kv.usage

    def has_unfinished_requests(self) -> bool:
        """True while any request runs, waits, or has an output (an abort's) not yet returned."""
        return self.scheduler.has_unfinished() or bool(self._pending)

    def step(self) -> list[RequestOutput]:
        """One scheduling decision, one forward pass, one token for each request that
        completed its known tokens. Returns outputs of requests that changed."""
        step_start = time.monotonic()
        outputs, self._pending = self._pending, []
        sched = self.scheduler.schedule()
        for request in sched.preempted:
            if self.tracer is not None:
                self.tracer.record_preemption(request.request_id, time.monotonic())
            if self.proposer is not None:
                self.proposer.remove(request.request_id)
        for request in sched.cannot_fit:
            logger.warning("request %s no longer fits in the whole KV cache; ending it",
                           request.request_id)
            self._finish(request, "length")
            outputs.append(self._make_output(request))
        if sched.is_empty:
            return outputs
        now = time.monotonic()
        for s in sched.scheduled:
            if s.request.metrics.first_scheduled_time is None:
                s.request.metrics.first_scheduled_time = now
        results = self.runner.execute(sched, self.kv)
        self._account(sched)
        now = time.monotonic()
        for result in results:
            out = self._process(result, now)
            if out is not None:
                outputs.append(out)
        if self.proposer is not None:
            self._propose()
        if self.tracer is not None:
            self._trace_step(step_start, sched)
        return outputs

    def _trace_step(self, start: float, sched) -> None:
        parts = [(s.request.request_id, 0 if s.is_decode else s.num_tokens, int(s.is_decode))
                 for s in sched.scheduled]
        stats = self.kv.prefix_stats
        self.tracer.record_step(start, time.monotonic(), parts, self.kv.pool.num_used_blocks,
                                stats.hits, self.scheduler.num_preemptions)

    # ---- internals --------------------------------------------------------------------

    def _new_id(self) -> str:
        while True:
            self._next_id += 1
            rid = f"req-{self._next_id}"
            if rid not in self.requests and rid not in self._parents:
                return rid

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty: give at least one character or token")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError("prompt must be a string or a list of token ids")

    def _check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot know alone: limits that depend on the model and engine."""
        vocab, c = self.model_config.vocab_size, self.config
        bad = [t for t in params.stop_token_ids if t >= vocab]
        if bad:
            raise ValueError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > c.max_logprobs:
                raise ValueError(f"{name} must be <= {c.max_logprobs} (--max-logprobs), got {value}")
        if params.n > c.max_n:
            raise ValueError(f"n must be <= {c.max_n}, got {params.n}")

    def _check_prompt(self, ids: list[int]) -> None:
        vocab = self.model_config.vocab_size
        if not ids:
            raise ValueError("prompt is empty: give at least one character or token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}, "
                             "which must leave room for at least one generated token")
        if not self.kv.can_ever_fit(len(ids) + 1):
            raise ValueError(f"prompt has {len(ids)} tokens but the whole KV cache holds "
                             f"{self.kv_plan.num_tokens}; raise --kv-cache-memory")

    def _account(self, sched) -> None:
        st = self.stats
        st.num_steps += 1
        st.num_prefill_tokens += sum(s.num_tokens for s in sched.scheduled if not s.is_decode)
        st.num_preemptions = self.scheduler.num_preemptions
        st.peak_blocks_used = max(st.peak_blocks_used, self.kv.pool.num_used_blocks)

    def _process(self, result: StepResult, now: float) -> RequestOutput | None:
        s = result.scheduled
        request = s.request
        request.num_computed_tokens = result.num_computed_tokens
        if s.spec_token_ids:
            self._record_verification(request, len(s.spec_token_ids), result.num_accepted)
        tokens = request.all_token_ids
        if result.num_accepted:     # computed now, appended below
            tokens = tokens + s.spec_token_ids[:result.num_accepted]
        self.kv.cache_full_blocks(request.request_id, tokens, request.num_computed_tokens)
        request.metrics.num_kv_blocks = max(request.metrics.num_kv_blocks,
                                            self.kv.num_blocks_of(request.request_id))
        if result.prompt_logprobs:
            request.prompt_logprobs.extend(result.prompt_logprobs)
        if not result.token_ids:
            return None
        prev_len = len(request.output_token_ids)
        m = request.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        # Tokens in order (accepted drafts, then the target's own); a stop ends the rest.
        for j, token in enumerate(result.token_ids):
            self.stats.num_decode_tokens += 1
            m.token_times.append(now)
            request.append_token(token)
            logprobs = result.logprobs[j] if result.logprobs else None
            if logprobs is not None:
                request.output_logprobs.append(logprobs)
                request.cumulative_logprob += logprobs[token].logprob
            self._check_stop(request, token)
            if request.is_finished:
                break
        m.last_token_time = now
        m.num_generated_tokens = len(request.output_token_ids)
        return self._make_output(request, new_tokens_from=prev_len)

    def _record_verification(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Count the round and roll back the rejected drafts' slots."""
        self.spec_stats.record(num_drafts, num_accepted)
        request.metrics.spec_decode.record(num_drafts, num_accepted)
        self.kv.trim(request.request_id, request.num_computed_tokens)

    def _propose(self) -> None:
        """Drafts for every request whose next step is a decode, up to k and never past its
        length limit; the next step verifies them."""
        k = self.spec_config.num_speculative_tokens
        wanted, ks = [], []
        for request in self.scheduler.running:
            room = request.max_total_tokens - request.num_tokens - 1
            if (request.num_tokens_to_compute == 1 and request.output_token_ids
                    and not request.spec_token_ids and room > 0):
                wanted.append(request)
                ks.append(min(k, room))
        if not wanted:
            return
        for request, (tokens, probs) in zip(wanted, self.proposer.propose(wanted, ks)):
            request.spec_token_ids, request.spec_draft_probs = tokens, probs

    def _check_stop(self, request: Request, token: int) -> None:
        p = request.params
        n_out = len(request.output_token_ids)
        past_min = n_out >= p.min_tokens
        if past_min and token in p.all_stop_token_ids:
            return self._finish(request, "stop")
        if past_min and token in p.stop_token_ids:
            request.stop_reason = token
            return self._finish(request, "stop")
        matched = request.detokenizer.update([token], check_stop=past_min)
        if past_min and matched is not None:
            request.stop_reason = matched
            return self._finish(request, "stop")
        if request.num_tokens >= request.max_total_tokens:
            return self._finish(request, "length")
        return None

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        request.metrics.finished_time = time.monotonic()
        request.clear_draft()
        self.scheduler.finish(request)
        if self.proposer is not None:
            self.proposer.remove(request.request_id)

    def _make_output(self, request: Request, new_tokens_from: int | None = None) -> RequestOutput:
        det = request.detokenizer
        delta = det.get_delta()
        if request.is_finished:
            delta += det.flush()  # the held-back tail (a stop string already cut it off)
        request.emitted_text += delta
        ids = request.output_token_ids
        completion = CompletionOutput(
            index=0, text=request.emitted_text, token_ids=list(ids),
            cumulative_logprob=request.cumulative_logprob if request.params.logprobs is not None else None,
            logprobs=list(request.output_logprobs) if request.params.logprobs is not None else None,
            finish_reason=request.finish_reason, stop_reason=request.stop_reason,
            delta_text=delta,
            delta_token_ids=list(ids[new_tokens_from:]) if new_tokens_from is not None else [],
        )
        if request.is_finished:
            self.requests.pop(request.request_id, None)
            if self.tracer is not None:
                self.tracer.record_request(request.request_id, request.metrics, request.finish_reason)
        out = RequestOutput(
            request_id=request.request_id, prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            prompt_logprobs=request.prompt_logprobs if request.params.prompt_logprobs is not None else None,
            outputs=[completion], finished=request.is_finished, metrics=request.metrics,
            num_cached_tokens=request.metrics.num_cached_tokens,
        )
        parent = self._parents.get(request.request_id)
        if parent is None:
            return out
        merged = parent.merge(out)
        if merged.finished:
            for rid in (parent.request_id, *parent.child_ids):
                self._parents.pop(rid, None)
        return merged


def _make_tokenizer(ckpt) -> Tokenizer:
    if isinstance(ckpt.tokenizer_source, str):
        return Tokenizer.from_folder(ckpt.tokenizer_source)
    g = ckpt.tokenizer_source
    return Tokenizer(g.tokenizer, g.tokenizer_config, g.generation_config)


def _max_model_len(config: EngineConfig, model_config) -> int:
    limit = model_config.max_position_embeddings
    if model_config.sliding_window is not None and model_config.sliding_window < limit:
        logger.info("capping max_model_len at the sliding window (%d): within it attention is "
                    "exactly full causal", model_config.sliding_window)
        limit = model_config.sliding_window
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds what the model supports "
                         f"({limit}{' (sliding window)' if limit == model_config.sliding_window else ''})")
    return config.max_model_len


def _eos_ids(tokenizer: Tokenizer, model_config, path: str) -> set[int]:
    ids = set(tokenizer.eos_token_ids) | set(model_config.eos_token_ids)
    if not ids:
        logger.warning("model %s declares no EOS token: generation stops only at max_tokens, "
                       "stop strings or stop_token_ids", path)
    return ids
