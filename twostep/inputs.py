"""Prompt types, as vLLM's vllm.inputs names them: a prompt is a string, a list of token ids, or one
of these dicts (LLM.generate takes all of them)."""
from __future__ import annotations

from typing import TypedDict


class TextPrompt(TypedDict):
    prompt: str


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]


PromptType = str | list[int] | TextPrompt | TokensPrompt
