"""Which reasoning parser a chat request gets, and whether its structured output waits for the
answer (the parsers themselves are in reasoning.py); for the chat API and LLM.chat alike.

A harmony model (gpt-oss) always gets the harmony parser: its chain of thought must never reach
content. Other models get the server's --reasoning-parser unless the request turns thinking off
(``chat_template_kwargs: {"enable_thinking": false}``). A constraint (a JSON schema, a forced tool
call) then applies to the answer only, as in vLLM, unless the prompt already closed the thinking
block or the server runs with --structured-outputs-in-reasoning (the grammar covers the whole
output, thinking included). For a harmony model the constraint is deferred only when
--reasoning-parser gpt_oss is named: by default its grammar covers the output, which is then plain
text (entrypoints/harmony.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from twostep.entrypoints.harmony import is_harmony_tokenizer
from twostep.entrypoints.reasoning import (THINK_END, THINK_START, GptOssParser, ReasoningParser, get_reasoning_parser,
                                           prompt_opens_thinking, thinking_disabled)
from twostep.sampling_params import SamplingParams

_PROMPT_TAIL_TOKENS = 16     # enough of the prompt's end to see a thinking block opened or closed


@dataclass
class ReasoningPlan:
    parser: ReasoningParser | None = None
    defer_constraint: bool = False     # the grammar starts after parser.answer_marker


def plan_reasoning(tokenizer, parser_name: str | None, in_reasoning: bool, template_kwargs: dict | None,
                   prompt_ids: list[int]) -> ReasoningPlan:
    """in_reasoning: --structured-outputs-in-reasoning."""
    if is_harmony_tokenizer(tokenizer):
        return ReasoningPlan(GptOssParser(), parser_name == GptOssParser.name and not in_reasoning)
    if parser_name is None or thinking_disabled(template_kwargs):
        return ReasoningPlan()
    tail = tokenizer.decode(prompt_ids[-_PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    opened = prompt_opens_thinking(tail)
    closed = tail.rfind(THINK_END) > tail.rfind(THINK_START)
    parser = get_reasoning_parser(parser_name, opened)
    return ReasoningPlan(parser, not in_reasoning and not (closed and not parser.opened))


def defer_constraint(plan: ReasoningPlan, params: SamplingParams) -> None:
    """The request's constraint, if any, made to start at the answer."""
    so = params.structured_outputs
    if plan.defer_constraint and so is not None:
        params.structured_outputs = dataclasses.replace(so, starts_after=plan.parser.answer_marker)
