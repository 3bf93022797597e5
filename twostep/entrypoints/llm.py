"""The offline API, shaped like vLLM's: LLM(model=...).generate(prompts, params)."""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Iterator, Sequence

import torch
from tqdm import tqdm

from twostep.config import EngineConfig, PoolingModel
from twostep.engine.llm_engine import LLMEngine
from twostep.entrypoints.harmony import is_harmony_tokenizer, turn_end_token_ids
from twostep.entrypoints.reasoning import ReasoningParser, ReasoningSplit
from twostep.entrypoints.reasoning_plan import defer_constraint, plan_reasoning
from twostep.outputs import (ClassificationRequestOutput, CompletionOutput, EmbeddingRequestOutput,
                             PoolingRequestOutput, RequestOutput, ScoringOutput, ScoringRequestOutput)
from twostep.pooling_params import PoolingParams
from twostep.sampling_params import RequestOutputKind, SamplingParams

Prompt = str | list[int] | dict


class LLM:
    """vLLM's arguments are accepted: model, tokenizer (an HF folder or hub id), dtype, seed,
    max_model_len, quantization, gpu_memory_utilization and the other EngineConfig fields;
    trust_remote_code (twostep never runs a checkpoint's code: its own decoder covers the
    architectures it lists, any other is refused by name), enforce_eager (twostep always runs
    eagerly), and tensor_parallel_size (worker processes on torch.distributed: released by
    shutdown(), the end of a with-block, dropping the LLM, or the interpreter's exit, so another
    tensor-parallel LLM can follow in the same process)."""

    def __init__(self, model: str | None = None, *, trust_remote_code: bool = False,
                 tensor_parallel_size: int = 1, enforce_eager: bool = False, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, tensor_parallel_size=tensor_parallel_size, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._queues: dict[str, deque[RequestOutput]] = {}

    def shutdown(self) -> None:
        """Stop what runs beside this process: tensor-parallel workers, KV transfer threads."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for the engine underneath."""
        return self.engine

    def get_tokenizer(self):
        """The Hugging Face tokenizer, as vLLM's LLM.get_tokenizer returns it (a
        PreTrainedTokenizerFast over the same tokenizer, with its special tokens and chat template)."""
        if self._hf_tokenizer is None:
            self._hf_tokenizer = self.tokenizer.to_hf()
        return self._hf_tokenizer

    _hf_tokenizer = None

    def get_stats(self) -> dict:
        """Engine counters: tokens prefilled and decoded, preemptions, prefix-cache queries,
        hits and hit rate, KV blocks."""
        return self.engine.get_stats()

    def reset_prefix_cache(self) -> None:
        self.engine.reset_prefix_cache()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion with continuous batching; outputs in input order.
        priority: one per prompt, with scheduling_policy="priority" (lower first)."""
        prompts = _as_prompt_list(prompts)
        params = _as_params_list(sampling_params or self.engine.default_sampling_params(), len(prompts))
        # generate returns whole outputs: only the final one of each request is needed (vLLM's rule)
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        if priority is not None and len(priority) != len(prompts):
            raise ValueError(f"got {len(priority)} priorities for {len(prompts)} prompts")
        ids = self._add_all(prompts, params, priority)
        return self._run(ids, use_tqdm)

    def chat(self, messages: list[dict] | Sequence[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, chat_template: str | None = None,
             chat_template_kwargs: dict | None = None, continue_final_message: bool = False,
             reasoning_parser: str | None = None, structured_outputs_in_reasoning: bool = False,
             ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or several, through the chat template
        (the model's, or chat_template: a template's text or name). tools: OpenAI-style tool
        definitions the template states to the model (a template without a tool section gets them
        in the system message, see tokenizer/tool_prompt.py). continue_final_message: the model
        continues the last (assistant) message; pass add_generation_prompt=False with it.

        reasoning_parser (the server's --reasoning-parser names, see entrypoints/reasoning.py):
        each output is a ChatCompletionOutput whose text is the answer and whose ``reasoning`` is
        the chain of thought (None if there was none); a structured-output constraint applies to
        the answer (structured_outputs_in_reasoning: to the whole output). A model that speaks harmony (gpt-oss, see entrypoints/harmony.py) always gets
        this split (its answer is the final channel). token_ids are all the tokens generated."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        extra = dict(chat_template_kwargs or {})
        if tools:
            extra["tools"] = tools
        if chat_template is not None:
            extra["chat_template"] = chat_template
        if continue_final_message:
            extra["continue_final_message"] = True
        prompts = [self.engine.input_processor.encode_chat(c, add_generation_prompt, **extra) for c in conversations]
        plans = [plan_reasoning(self.tokenizer, reasoning_parser, structured_outputs_in_reasoning, chat_template_kwargs,
                                ids) for ids in prompts]
        params = _as_params_list(sampling_params or self.engine.default_sampling_params(), len(prompts))
        params = [dataclasses.replace(p) for p in params]
        for p, plan in zip(params, plans):
            defer_constraint(plan, p)
        if is_harmony_tokenizer(self.tokenizer):
            stops = turn_end_token_ids(self.tokenizer)
            params = [dataclasses.replace(p, skip_special_tokens=False,   # channels are special tokens
                                          stop_token_ids=list(dict.fromkeys(p.stop_token_ids + stops)))
                      for p in params]
        outputs = self.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm)
        for out, plan in zip(outputs, plans):
            if plan.parser is not None or reasoning_parser is not None:
                out.outputs = [ChatCompletionOutput.of(c, plan.parser) for c in out.outputs]
        return outputs

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None,
               ) -> Iterator[RequestOutput]:
        """Yield this request's outputs as tokens arrive. Several streams (and generate calls)
        can be interleaved: every output goes to the queue of the request it belongs to."""
        rid = self._add_all([prompt], [sampling_params or self.engine.default_sampling_params()])[0]
        queue = self._queues[rid]
        try:
            while True:
                while not queue:
                    self._pump()
                out = queue.popleft()
                yield out
                if out.finished:
                    return
        finally:
            self._queues.pop(rid, None)
            self.engine.abort_request(rid)   # no-op once finished; frees blocks if abandoned

    # ---- pooling models (--runner pooling): embeddings, classification, scores ----------------------

    def encode(self, prompts: Prompt | Sequence[Prompt],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
               use_tqdm: bool = True) -> list[PoolingRequestOutput]:
        """Each prompt's pooled vector (vLLM's LLM.encode), in input order; the prompts are batched and
        chunked like any others. Needs a pooling engine (runner pooling)."""
        if self.engine.pooling is None:
            raise ValueError("this LLM generates (runner generate): pooling needs LLM(model, runner='pooling') "
                             "and an embedding or classification model")
        prompts = _as_prompt_list(prompts)
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * len(prompts)
        else:
            params = list(pooling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} PoolingParams for {len(prompts)} prompts")
        return self._run(self._add_all(prompts, params), use_tqdm)

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Each prompt's embedding (.outputs.embedding), as vLLM's LLM.embed."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in self.encode(prompts, params, use_tqdm)]

    def classify(self, prompts: Prompt | Sequence[Prompt], pooling_params: PoolingParams | None = None,
                 use_tqdm: bool = True) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (.outputs.probs), as vLLM's LLM.classify."""
        params = dataclasses.replace(pooling_params or PoolingParams(), task="classify")
        return [ClassificationRequestOutput.from_base(o) for o in self.encode(prompts, params, use_tqdm)]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str], use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None) -> list[ScoringRequestOutput]:
        """vLLM's LLM.score: text_1 (one text) against each of text_2, or the two lists pair by pair.
        A classifier of one label (a cross-encoder) reads each pair as one prompt, joined as its
        tokenizer joins a pair; an embedding model scores the cosine similarity of the two embeddings."""
        pairs = score_pairs(text_1, text_2)
        pooling = self.engine.pooling
        if pooling is not None and pooling.task == "classify":
            check_cross_encoder(pooling)
            prompts = [{"prompt_token_ids": self.tokenizer.encode_pair(a, b)} for a, b in pairs]
            outs = self.encode(prompts, dataclasses.replace(pooling_params or PoolingParams(), task="classify"),
                               use_tqdm)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(float(o.outputs.data[0])), o.prompt_token_ids)
                    for o in outs]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        embedded = dict(zip(texts, self.encode(texts, dataclasses.replace(pooling_params or PoolingParams(),
                                                                          task="embed"), use_tqdm)))
        return [_cosine_output(embedded[a], embedded[b]) for a, b in pairs]

    def _add_all(self, prompts: list[Prompt], params: list[SamplingParams],
                 priority: list[int] | None = None) -> list[str]:
        ids: list[str] = []
        try:
            for k, (prompt, p) in enumerate(zip(prompts, params)):
                ids.append(self.engine.add_request(_unwrap(prompt), p, priority=priority[k] if priority else 0))
        except Exception:
            self.engine.abort_request(ids, emit_output=False)  # all or nothing: a bad prompt adds no work
            raise
        for rid in ids:
            self._queues[rid] = deque()
        return ids

    def _pump(self) -> None:
        """One engine step; outputs are routed to the queues of the requests they belong to."""
        if not self.engine.has_unfinished_requests():
            raise RuntimeError("the engine has no work left but a request never finished")
        for out in self.engine.step():
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.append(out)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Generating", unit="req", disable=not use_tqdm or len(ids) < 2)
        try:
            while len(finished) < len(ids):
                self._pump()
                for rid in ids:
                    queue = self._queues[rid]
                    while queue:
                        out = queue.popleft()
                        if out.finished:
                            finished[rid] = out
                            bar.update(1)
        finally:
            bar.close()
            for rid in ids:
                self._queues.pop(rid, None)
            self.engine.abort_request([i for i in ids if i not in finished])
        return [finished[i] for i in ids]


@dataclasses.dataclass(slots=True)
class ChatCompletionOutput(CompletionOutput):
    """A chat output split by a reasoning parser: text is the answer, reasoning the chain of thought
    (None if there was none)."""

    reasoning: str | None = None

    @classmethod
    def of(cls, c: CompletionOutput, parser: ReasoningParser | None) -> "ChatCompletionOutput":
        """parser None: the request turned thinking off, the text is all answer."""
        split = parser.split(c.text, final=True) if parser is not None else ReasoningSplit("", c.text)
        fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
        return cls(**{**fields, "text": split.content, "delta_text": split.content},
                   reasoning=split.reasoning or None)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt given as token ids
    return prompts


def _as_params_list(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _unwrap(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    return prompt


# ---- scores (LLM.score and the server's /v1/score and /v1/rerank) --------------------------------------

def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 against every text_2, or two lists of one length pair by pair."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("text_1 and text_2 need at least one text each")
    if any(not isinstance(t, str) or not t for t in first + second):
        raise ValueError("every text to score must be a non-empty string")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many "
                         "as text_2 (scored pair by pair)")
    return list(zip(first, second))


def check_cross_encoder(pooling: PoolingModel) -> None:
    """A classifier scores a pair by its one label (vLLM's rule for cross-encoders)."""
    if pooling.num_labels != 1:
        raise ValueError(f"scoring with a classifier needs one label (a cross-encoder); this model has "
                         f"{pooling.num_labels}")


def cosine_similarity(a, b) -> float:
    """Two embeddings' cosine similarity, in float32 as vLLM computes it."""
    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))


def _cosine_output(a: PoolingRequestOutput, b: PoolingRequestOutput) -> ScoringRequestOutput:
    return ScoringRequestOutput(f"{a.request_id}_{b.request_id}",
                                ScoringOutput(cosine_similarity(a.outputs.data, b.outputs.data)),
                                a.prompt_token_ids + b.prompt_token_ids)
