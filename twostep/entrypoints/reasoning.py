"""Reasoning parsers: a reasoning model's chain of thought told apart from its answer, as vLLM's
``--reasoning-parser`` does, for the chat API (``message.reasoning``) and ``LLM.chat``.

The names are vLLM's:

- ``deepseek_r1``: the DeepSeek-R1 family and its distills. The output is reasoning until
  ``</think>`` (the template opens ``<think>`` in the prompt, and R1 may or may not repeat it);
  an output that never closes it is all reasoning.
- ``qwen3``: Qwen3, Qwen3.5 and QwQ. Reasoning is inside ``<think>...</think>``; whether the output
  begins inside it depends on the prompt: the thinking-only templates open ``<think>`` in the prompt,
  the hybrid ones let the model open it, and ``enable_thinking: false`` writes an empty block into the
  prompt. So the parser reads the prompt's end: if its last ``<think>`` is not closed, the output
  starts in reasoning; otherwise only an output that opens ``<think>`` has any.
- ``think``: the same rule for any other model that writes ``<think>`` markers (SmolLM3, OLMo 3,
  GLM-4.5's, Hunyuan's).
- ``gpt_oss``: harmony's channels (entrypoints/harmony.py): the analysis channel is the reasoning,
  the final channel the answer. A harmony model gets this parser whether or not it is named.

Every parser is a pure function of the whole output text (``split``), consistent under prefixes as
the tool-call parsers are (tool_parsers/base.py): the reasoning and the content of any prefix are
prefixes of those of the whole text, so a stream sends only what is new. Whitespace around the
markers is not text: reasoning is stripped and the answer's leading whitespace dropped, and while
streaming a trailing piece that could still be whitespace before a marker, or the start of a marker
split across tokens, is held back until the next text shows what it is.

``answer_marker`` is where the answer begins: structured outputs (a JSON schema, a forced tool call)
constrain only what follows it, as in vLLM, so a model may think freely first.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

from twostep.entrypoints.harmony import CHANNEL, MESSAGE, HarmonyChat

THINK_START, THINK_END = "<think>", "</think>"


@dataclass
class ReasoningSplit:
    reasoning: str       # the chain of thought ("" when there is none)
    content: str         # the answer


class ReasoningParser:
    """Base class: see the module docstring for the contract of split."""

    name: ClassVar[str]
    answer_marker: ClassVar[str]    # the text after which the answer (and any constraint) begins

    def split(self, text: str, final: bool) -> ReasoningSplit:
        raise NotImplementedError

    def answer_offset(self, text: str) -> int | None:
        """Where the answer begins in a whole output: 0 with no reasoning, None when the output
        never left its reasoning."""
        raise NotImplementedError

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)


class ThinkParser(ReasoningParser):
    """``<think>reasoning</think>answer``; opened: the prompt left the block open, so the output
    begins inside it."""

    name = "think"
    answer_marker = THINK_END
    always_open: ClassVar[bool] = False

    def __init__(self, opened: bool = False) -> None:
        self.opened = opened or self.always_open

    def split(self, text: str, final: bool) -> ReasoningSplit:
        body = self._reasoning_body(text, final)
        if body is None:        # no reasoning: the output is the answer
            return ReasoningSplit("", text)
        end = body.find(THINK_END)
        if end < 0:
            kept = body if final else _hold_back(body, THINK_END)
            return ReasoningSplit(kept.strip() if final else kept.lstrip().rstrip(), "")
        answer = body[end + len(THINK_END):].lstrip()
        return ReasoningSplit(body[:end].strip(), answer)

    def answer_offset(self, text: str) -> int | None:
        body = self._reasoning_body(text, final=True)
        if body is None:
            return 0
        end = body.find(THINK_END)
        return None if end < 0 else len(text) - len(body) + end + len(THINK_END)

    def _reasoning_body(self, text: str, final: bool) -> str | None:
        """The text from inside the thinking block on; None when the output has no reasoning
        (not final: also while it is still too short to tell, with everything held back as "")."""
        stripped = text.lstrip()
        if stripped.startswith(THINK_START):     # opened or not, a <think> the output writes is a marker
            return stripped[len(THINK_START):]
        if not final and THINK_START.startswith(stripped):
            return ""           # maybe the start of <think>: nothing to say yet
        return text if self.opened else None


class Qwen3Parser(ThinkParser):
    name = "qwen3"


class DeepSeekR1Parser(ThinkParser):
    name = "deepseek_r1"
    always_open = True


class GptOssParser(ReasoningParser):
    """Harmony: the analysis channel is the reasoning, the final channel the answer."""

    name = "gpt_oss"
    answer_marker = f"{CHANNEL}final{MESSAGE}"

    def __init__(self, opened: bool = False) -> None:
        del opened               # the channels say it all

    def split(self, text: str, final: bool) -> ReasoningSplit:
        chat = HarmonyChat()
        chat.feed(text, final)
        return ReasoningSplit(chat.reasoning, chat.content)

    def answer_offset(self, text: str) -> int | None:
        start = text.find(f"{CHANNEL}final")
        if start < 0:
            return 0 if not text.lstrip().startswith("<|") else None    # plain text: all answer
        end = text.find(MESSAGE, start)
        return None if end < 0 else end + len(MESSAGE)

    def stream(self) -> ReasoningStream:
        return _HarmonyStream()


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1Parser, Qwen3Parser, ThinkParser, GptOssParser)}


def get_reasoning_parser(name: str, opened: bool = False) -> ReasoningParser:
    """A parser for a --reasoning-parser value; opened: the prompt leaves a thinking block open
    (prompt_opens_thinking). ValueError for an unknown name."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name](opened)


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """Whether a prompt ending in this text leaves a <think> block open for the output."""
    return prompt_tail.rfind(THINK_START) > prompt_tail.rfind(THINK_END)


def thinking_disabled(template_kwargs: dict | None) -> bool:
    """chat_template_kwargs turning thinking off: enable_thinking (Qwen3) or thinking (others) false."""
    kwargs = template_kwargs or {}
    return kwargs.get("enable_thinking", True) is False or kwargs.get("thinking", True) is False


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningStream:
    """One output's split as its text arrives: feed(delta, final) returns what the reasoning and the
    content gained. It re-splits the whole text (short next to a step's work) and sends the part
    beyond what it sent, which the parser's prefix consistency makes final."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = ReasoningSplit("", "")

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        self.text += delta
        split = self.parser.split(self.text, final)
        out = ReasoningDelta(_growth(self.sent.reasoning, split.reasoning), _growth(self.sent.content, split.content))
        self.sent = ReasoningSplit(self.sent.reasoning + out.reasoning, self.sent.content + out.content)
        return out


class _HarmonyStream(ReasoningStream):
    """Harmony's own incremental parser: no re-parsing of the whole text."""

    def __init__(self) -> None:
        self.chat = HarmonyChat()

    def feed(self, delta: str, final: bool = False) -> ReasoningDelta:
        d = self.chat.feed(delta, final)
        return ReasoningDelta(d.reasoning, d.content)


def count_reasoning_tokens(parser: ReasoningParser, text: str, token_ids: list[int],
                           decode: Callable[[list[int]], str]) -> int:
    """How many of an output's tokens are reasoning: those up to the end of the reasoning's closing
    marker (all of them if it never closed). decode(ids) -> text as the output was decoded; the
    shortest prefix of ids that reaches the marker's end is found by bisection."""
    offset = parser.answer_offset(text)
    if offset is None:
        return len(token_ids)
    if offset == 0:
        return 0
    lo, hi = 1, len(token_ids)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(decode(token_ids[:mid])) >= offset:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _hold_back(text: str, marker: str) -> str:
    """text without a trailing piece that could be the start of marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


def _growth(sent: str, now: str) -> str:
    """What now adds to what was sent (nothing if a parser ever broke prefix consistency)."""
    return now[len(sent):] if now.startswith(sent) else ""
