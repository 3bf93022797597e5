"""The engine: construction and the step loop. A step is three calls, as vLLM v1's EngineCore.step:
the scheduler's plan, one forward pass over it, the scheduler's update from its results; then the
output processor turns what changed into RequestOutputs. Everything else has its own module:
inputs (input_processor.py), outputs (output_processor.py), scheduling and request/KV state
(core/scheduling/scheduler.py), the model and its cache (core/execution/model_builder.py)."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Iterable

import torch

from twostep.config import EngineConfig
from twostep.core.execution.model_builder import CacheSpec, ModelSpec, build_model_instance
from twostep.core.scheduling.scheduler_output import SchedulerOutput
from twostep.core.step_outputs import ModelRunnerOutput
from twostep.core.scheduling.proposer import HiddenStateProposer, Proposer
from twostep.core.scheduling.scheduler import Scheduler
from twostep.core.execution.tp_group import TPGroup, WorkerSpec, cores_for, default_init_method, launched_rank
from twostep.distributed.parallel import TensorParallel
from twostep.engine.input_processor import InputProcessor, ModelLimits, PromptInput
from twostep.engine.output_processor import OutputProcessor
from twostep.engine.trace import StepTracer
from twostep.kv_transfer.connector import KVConnector
from twostep.kv_transfer.factory import make_connector
from twostep.kv_transfer.params import RemotePrefill
from twostep.models.loader import resolve_model_path
from twostep.models.pooling import resolve_pooling
from twostep.outputs import PoolingRequestOutput, RequestOutput
from twostep.platforms import get_platform, resolve_device, resolve_dtype
from twostep.pooling_params import PoolingParams
from twostep.sample.sampler import Sampler
from twostep.sampling_params import SamplingParams
from twostep.spec_decode.proposer import make_proposer
from twostep.structured_output.compiler import GrammarCompiler
from twostep.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        tp = TensorParallel(0, config.tensor_parallel_size)
        cores = sorted(os.sched_getaffinity(0))        # before rank 0 takes its share
        if tp.enabled:
            if launched_rank(tp.world_size) not in (None, 0):
                raise ValueError("started as a rank > 0 (RANK is set): only rank 0 runs the engine; "
                                 "start every rank with `twostep serve` (the others become its workers)")
            self._pin_rank0(tp, cores)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.platform = get_platform(resolve_device(config.device), config)
        self.device, self.dtype = self.platform.device, resolve_dtype(config.dtype, self.platform)
        if config.dtype == "auto":
            logger.info("dtype auto: %s, as %s", str(self.dtype).removeprefix("torch."),
                        self.platform.default_dtype_reason())
        sampler = Sampler(torch.Generator(device=self.device).manual_seed(config.seed),
                          argmax=self.platform.custom_op("first_argmax", torch.float32))
        model_path = resolve_model_path(config.model)
        # a pooling engine's vectors (config/pooling.py), or None: it generates
        self.pooling = resolve_pooling(model_path, config.runner, config.convert, config.pooler_config)
        if self.pooling is not None:
            _check_pooling_config(config)
        model_spec = ModelSpec(model_path, self.dtype, self.platform, config.max_model_len,
                               attention_backend=config.attention_backend, quantization=config.quantization, tp=tp,
                               pooling=self.pooling)
        cache_spec = CacheSpec(config.block_size, config.kv_cache_dtype, config.enable_prefix_caching,
                               config.num_kv_blocks, config.kv_cache_memory, config.kv_cache_memory_fraction,
                               config.max_num_seqs, config.max_num_batched_tokens, config.gpu_memory_utilization)
        target = build_model_instance(model_spec, cache_spec, sampler)
        t = target
        self.tp_group: TPGroup | None = None
        if tp.enabled:     # the workers build their shards with rank 0's cache size
            self.tp_group = t.runner.peers = self._start_workers(model_spec, cache_spec, t, cores)
        self.model_path, self.model_config, self.max_model_len = t.path, t.config, t.max_model_len
        self.model, self.runner, self.kv_plan = t.model, t.runner, t.kv_plan
        self.tokenizer = _make_tokenizer(resolve_model_path(config.tokenizer) if config.tokenizer
                                         else t.tokenizer_source)
        self.generation_config = t.generation_config
        logger.info("%s; largest context that fits: %d tokens (max_model_len %d)", self.kv_plan.describe(),
                    min(self.kv_plan.num_tokens, self.max_model_len), self.max_model_len)
        if config.kv_transfer_config and len(t.kv_plan.groups) > 1:
            raise ValueError(f"{t.path}: prefill/decode disaggregation moves one block table per request, and "
                             "this model keeps its sliding-window layers' blocks apart (KV-cache groups); run it "
                             "without --kv-transfer-config")
        if config.kv_transfer_config and t.num_state_slots:
            raise ValueError(f"{t.path}: prefill/decode disaggregation moves K/V blocks, and this model's "
                             "linear-attention layers keep a state per sequence instead; run it without "
                             "--kv-transfer-config")
        self.kv_connector: KVConnector | None = (make_connector(config.kv_transfer_config, t.runner.kv_caches)
                                                 if config.kv_transfer_config else None)
        self.scheduler = Scheduler(t.kv_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.scheduling_policy, self.kv_connector)
        self.proposer: Proposer | None = (make_proposer(config, t, self.platform, sampler)
                                          if config.speculative_config else None)
        # an MTP proposer reads the target's final hidden states of every step: the runner keeps them
        self._observer = self.proposer if isinstance(self.proposer, HiddenStateProposer) else None
        t.runner.keep_hidden = self._observer is not None
        self.eos_token_ids = _eos_ids(self.tokenizer, t.config, t.path)
        limits = ModelLimits(t.config.vocab_size, self.max_model_len,
                             self.scheduler.kv.sequence_capacity(config.max_num_batched_tokens),
                             frozenset(self.eos_token_ids))
        self.grammar_compiler = GrammarCompiler(self.tokenizer, t.config.vocab_size, self.eos_token_ids)
        self.input_processor = InputProcessor(self.tokenizer, config, limits, self.device,
                                              speculative=self.proposer is not None,
                                              grammars=self.grammar_compiler, pooling=self.pooling,
                                              can_generate=self.can_generate)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.tracer: StepTracer | None = None          # set by enable_tracing()
        self._pending: list[RequestOutput] = []        # aborts' final outputs, for the next step()
        self._next_id = 0
        logger.info("model %s: %s, %d layers, dtype %s on %s, max_model_len %d", t.path,
                    t.config.architecture, t.config.num_layers, str(self.dtype).removeprefix("torch."),
                    self.device, self.max_model_len)
        if self.pooling is not None:
            p = self.pooling
            logger.info("pooling runner: %s, %s pooling%s", p.task, p.pooling_type,
                        f", normalized: {p.normalize}" if p.task == "embed" else f", {p.num_labels} labels")

    def _pin_rank0(self, tp: TensorParallel, cores: list[int]) -> None:
        """Rank 0's share of this machine's cores (all ranks here, or torchrun's ranks on it)."""
        local = (0, tp.world_size)
        if launched_rank(tp.world_size) is not None:
            local = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        cpus = cores_for(*local, cores)
        if cpus:
            os.sched_setaffinity(0, cpus)
            if not self.config.num_threads:
                torch.set_num_threads(len(cpus))

    def _start_workers(self, model_spec: ModelSpec, cache_spec: CacheSpec, t, cores: list[int]) -> TPGroup:
        c = self.config
        spec = WorkerSpec(dataclasses.replace(model_spec, platform=None, max_model_len=t.max_model_len),
                          dataclasses.replace(cache_spec, num_blocks=tuple(g.num_blocks for g in t.kv_plan.groups)),
                          str(self.device), c,
                          "nccl" if self.device.type == "cuda" else "gloo",
                          c.distributed_init_method or default_init_method(), c.distributed_timeout_s,
                          num_threads=c.num_threads)
        return TPGroup(spec, c.tensor_parallel_size, cores)

    @classmethod
    def from_args(cls, **kwargs) -> "LLMEngine":
        return cls(EngineConfig(**kwargs))

    # ---- the step ------------------------------------------------------------------------

    @property
    def can_generate(self) -> bool:
        """The model has an lm_head (a pooling checkpoint may have none: then it only pools)."""
        return self.model.lm_head is not None

    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
        """One scheduling decision, one forward pass, one token (or a few, with speculative
        decoding) for each request that completed its known tokens, and its vector for each pooling
        request whose prompt the step completed. Returns outputs of requests that changed."""
        start = time.monotonic()
        if self.kv_connector is not None:
            self.kv_connector.write_loaded(self.runner.write_blocks)
        scheduler_output = self.scheduler.schedule()
        runner_output = self.runner.execute(scheduler_output.plan)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        processed = self.output_processor.process(core_outputs)
        for request_id, stop_string in processed.stopped_by_string:
            self.scheduler.finish_requests([request_id], "stop", stop_string)
        self._forget_released()
        if not scheduler_output.is_empty:
            self._propose(scheduler_output, runner_output)
        self._trace(start, scheduler_output)
        outputs, self._pending = self._pending + processed.outputs, []
        if scheduler_output.is_empty and self.scheduler.loading and not outputs:
            self.kv_connector.wait(0.005)     # only remote loads in flight: do not spin
        return outputs

    def _propose(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        """Drafts for every request whose next step is a decode; the next step verifies them. A
        proposer that drafts from the target's hidden states sees every step's first."""
        if self.proposer is None:
            return
        if self._observer is not None:
            self._observer.observe(scheduler_output.scheduled, runner_output.results)
        candidates = self.scheduler.draft_candidates(self.config.speculative_config.num_speculative_tokens)
        if candidates:
            requests, ks = map(list, zip(*candidates))
            self.scheduler.update_draft_token_ids(requests, self.proposer.propose(requests, ks))

    def _forget_released(self) -> None:
        """Requests that finished or were preempted: the proposer drops what it held for them."""
        for request_id in self.scheduler.take_released():
            if self.proposer is not None:
                self.proposer.remove(request_id)

    def _trace(self, start: float, scheduler_output: SchedulerOutput) -> None:
        if self.tracer is None:
            return
        for request in scheduler_output.preempted:
            self.tracer.record_preemption(request.request_id, start)
        if scheduler_output.is_empty:
            return
        parts = [(s.request.request_id, 0 if s.is_decode else s.num_tokens, int(s.is_decode))
                 for s in scheduler_output.scheduled]
        kv = self.scheduler.kv_stats()
        self.tracer.record_step(start, time.monotonic(), parts, kv["blocks_in_use"],
                                kv["prefix_cache_hits"], self.scheduler.num_preemptions)

    # ---- requests in and out ---------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """The model authors' defaults from generation_config.json (temperature, top_p, top_k,
        min_p, repetition_penalty; do_sample=false means greedy), else SamplingParams()."""
        g = self.generation_config
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        found = {k: g[k] for k in keys if g.get(k) is not None}
        if g.get("do_sample") is False:
            found["temperature"] = 0.0
        return SamplingParams(**found)

    def add_request(self, prompt: PromptInput, params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> str:
        """Validate, tokenize and queue a request; raises ValueError on bad input, leaving
        the engine and every other request untouched. priority counts with
        scheduling_policy "priority" (lower first); any other policy takes only 0. PoolingParams
        (a pooling engine's; its default without params): the request ends with its pooled vector."""
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority {priority} needs scheduling_policy 'priority' "
                             "(--scheduling-policy priority); this engine serves first come, first served")
        if params is None:
            params = PoolingParams() if self.pooling is not None else self.default_sampling_params()
        if request_id is None:
            request_id = self._new_id()
        processed = self.input_processor.process(prompt, params, request_id,
                                                 arrival_time or time.monotonic())
        for rid in processed.request_ids:
            if self.output_processor.is_known(rid):
                raise ValueError(f"request_id {rid!r} is already in use")
            if rid in self.scheduler.sending:
                raise ValueError(f"request_id {rid!r} is still in use: its KV blocks wait for a remote decode")
        self._attach_kv_transfer(processed.requests, params)
        self.output_processor.add(processed)
        for request in processed.requests:
            request.priority = priority
            self.scheduler.add_request(request)
        return request_id

    def _attach_kv_transfer(self, requests, params: SamplingParams | PoolingParams) -> None:
        """kv_transfer_params (vLLM: in SamplingParams.extra_args): do_remote_decode keeps the
        finished prefill's blocks for a consumer; do_remote_prefill loads the prompt's KV from
        the producer they name. Checked here, so a bad one is a ValueError before anything runs."""
        if isinstance(params, PoolingParams):
            return
        kv = (params.extra_args or {}).get("kv_transfer_params")
        if kv is None:
            return
        c = self.kv_connector
        if not isinstance(kv, dict):
            raise ValueError("kv_transfer_params must be an object")
        if c is None:
            raise ValueError("kv_transfer_params need an engine started with --kv-transfer-config")
        if len(requests) != 1:
            raise ValueError("kv_transfer_params take one sequence per request (n = 1)")
        request = requests[0]
        if kv.get("do_remote_decode"):
            if not c.is_producer:
                raise ValueError(f"do_remote_decode needs kv_role kv_producer or kv_both; this engine is "
                                 f"{self.config.kv_transfer_config.kv_role}")
            request.remote_decode = True
        if kv.get("do_remote_prefill"):
            if not c.is_consumer:
                raise ValueError(f"do_remote_prefill needs kv_role kv_consumer or kv_both; this engine is "
                                 f"{self.config.kv_transfer_config.kv_role}")
            if params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs need the prompt computed here: not with do_remote_prefill")
            remote = RemotePrefill.parse(kv)
            remote.check_prompt(request.prompt_token_ids, self.config.block_size)
            request.remote_prefill = remote

    def has_pending_transfers(self) -> bool:
        """KV blocks held for consumers, or loads in flight (prefill/decode disaggregation)."""
        return self.kv_connector is not None and (self.kv_connector.has_pending or bool(self.scheduler.sending))

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and the KV transfer threads, if any (held blocks are
        no longer served)."""
        if self.tp_group is not None:
            self.tp_group.shutdown()
            self.tp_group = self.runner.peers = None
        if self.kv_connector is not None:
            self.kv_connector.close()        # the scheduler keeps it: calls on it are harmless now
            self.kv_connector = None

    def abort_request(self, request_ids: str | Iterable[str], emit_output: bool = True,
                      finish_reason: str = "abort", stop_reason: str | None = None) -> None:
        """Stop requests wherever they are and free their blocks. Their final output
        (finish_reason "abort" unless told otherwise, e.g. "length" with stop_reason
        "timeout" for a deadline) comes from the next step(), unless emit_output is False."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        ids = self.output_processor.expand_parents(request_ids)
        for request in self.scheduler.finish_requests(ids, finish_reason, stop_reason):
            out = self.output_processor.finish(request.request_id, finish_reason, stop_reason)
            if emit_output:
                self._pending.append(out)
        self._forget_released()

    def has_unfinished_requests(self) -> bool:
        """True while any request runs, waits, or has an output (an abort's) not yet returned."""
        return self.scheduler.has_unfinished() or bool(self._pending)

    def _new_id(self) -> str:
        while True:
            self._next_id += 1
            rid = f"req-{self._next_id}"
            if not self.output_processor.is_known(rid):
                return rid

    # ---- figures ---------------------------------------------------------------------------

    def get_stats(self) -> dict:
        """Counters since start, and what follows from them."""
        st = self.scheduler.stats
        return {
            "num_steps": st.num_steps, "num_prefill_tokens": st.num_prefill_tokens,
            "num_decode_tokens": self.output_processor.num_generated_tokens,
            "num_preemptions": st.num_preemptions, "peak_blocks_used": st.peak_blocks_used,
        } | self.scheduler.kv_stats() | (
            {f"spec_decode_{k}": v for k, v in self.scheduler.spec_stats.as_dict().items()}
            if self.proposer else {}) | (self.kv_connector.stats() if self.kv_connector else {})

    def enable_tracing(self) -> StepTracer:
        """Record every step and request from now on (Chrome trace-event JSON)."""
        if self.tracer is None:
            self.tracer = self.output_processor.tracer = StepTracer()
        return self.tracer

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Waiting to be scheduled, or for their prompt's KV from a remote prefill (vLLM counts both)."""
        return len(self.scheduler.waiting) + len(self.scheduler.loading)

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks held by requests (cached-but-evictable blocks count as free)."""
        return self.scheduler.kv_cache_usage


def _check_pooling_config(config: EngineConfig) -> None:
    """What a pooling engine does not combine with: its requests draft nothing, move no KV, and the
    pooler runs on one process's hidden states."""
    for name, unsupported in (("speculative_config", config.speculative_config),
                              ("kv_transfer_config", config.kv_transfer_config),
                              ("tensor_parallel_size > 1", config.tensor_parallel_size > 1)):
        if unsupported:
            raise ValueError(f"the pooling runner does not run with {name}")


def _make_tokenizer(source) -> Tokenizer:
    """From a checkpoint's tokenizer source: an HF folder, or what a GGUF file carries."""
    if isinstance(source, str):
        return Tokenizer.from_folder(source)
    return Tokenizer(source.tokenizer, source.tokenizer_config, source.generation_config)


def _eos_ids(tokenizer: Tokenizer, model_config, path: str) -> set[int]:
    ids = set(tokenizer.eos_token_ids) | set(model_config.eos_token_ids)
    if not ids:
        logger.warning("model %s declares no EOS token: generation stops only at max_tokens, "
                       "stop strings or stop_token_ids", path)
    return ids
