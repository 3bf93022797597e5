"""The offline API, shaped like vLLM's: LLM(model=...).generate(prompts, params)."""
from __future__ import annotations

import dataclasses
from collections import deque
from typing import Iterator, Sequence

from tqdm import tqdm

from twostep.config import EngineConfig
from twostep.engine.llm_engine import LLMEngine
from twostep.entrypoints.harmony import is_harmony_tokenizer, parse_chat_output, turn_end_token_ids
from twostep.outputs import CompletionOutput, RequestOutput
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
             ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or several, through the chat template
        (the model's, or chat_template: a template's text or name). tools: OpenAI-style tool
        definitions the template states to the model (a template without a tool section gets them
        in the system message, see tokenizer/tool_prompt.py). continue_final_message: the model
        continues the last (assistant) message; pass add_generation_prompt=False with it.

        A model that speaks harmony (gpt-oss, see entrypoints/harmony.py) answers in channels: each
        output's text is then its answer (the final channel; "" if generation ended before it) and
        each output is a ChatCompletionOutput whose ``reasoning`` holds its chain of thought (the
        analysis channel); token_ids are all the tokens generated."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        extra = dict(chat_template_kwargs or {})
        if tools:
            extra["tools"] = tools
        if chat_template is not None:
            extra["chat_template"] = chat_template
        if continue_final_message:
            extra["continue_final_message"] = True
        prompts = [{"prompt_token_ids": self.engine.input_processor.encode_chat(c, add_generation_prompt,
                                                                                **extra)}
                   for c in conversations]
        if not is_harmony_tokenizer(self.tokenizer):
            return self.generate(prompts, sampling_params, use_tqdm)
        params = _as_params_list(sampling_params or self.engine.default_sampling_params(), len(prompts))
        stops = turn_end_token_ids(self.tokenizer)
        params = [dataclasses.replace(p, skip_special_tokens=False,   # channels are special tokens
                                      stop_token_ids=list(dict.fromkeys(p.stop_token_ids + stops)))
                  for p in params]
        outputs = self.generate(prompts, params, use_tqdm)
        for out in outputs:
            out.outputs = [ChatCompletionOutput.of_harmony(c) for c in out.outputs]
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
    """A chat output of a harmony model: text is the answer, reasoning the chain of thought (None
    if there was none)."""

    reasoning: str | None = None

    @classmethod
    def of_harmony(cls, c: CompletionOutput) -> "ChatCompletionOutput":
        answer, reasoning = parse_chat_output(c.text)
        fields = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
        return cls(**{**fields, "text": answer, "delta_text": answer}, reasoning=reasoning)


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
