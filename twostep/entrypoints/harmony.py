"""OpenAI's harmony format (gpt-oss): which models speak it, and reading what they generate.

A harmony conversation is a run of messages, each ``<|start|>{header}<|message|>{content}{end}``.
The chat template writes the prompt and ends it with ``<|start|>assistant``; the model then writes
the rest of that header and its messages, for example::

    <|channel|>analysis<|message|>(chain of thought)<|end|>
    <|start|>assistant<|channel|>final<|message|>(the answer)<|return|>

A header names the channel (``analysis``: chain of thought, ``commentary``: tool calls and
preambles, ``final``: the answer for the user) and may name a recipient (``to=functions.NAME``,
before or after the channel) and a content type (``json`` or ``<|constrain|>json``). A message ends
with ``<|end|>``; ``<|return|>`` (the answer is done) and ``<|call|>`` (a tool call is done) end
the generation as well.

Which models speak it (one rule, used by the chat API and LLM.chat): those whose tokenizer has
harmony's four structural special tokens, ``<|start|>``, ``<|message|>``, ``<|channel|>`` and
``<|end|>`` (o200k_harmony, gpt-oss's tokenizer, in an HF folder or a GGUF). The architecture is
not consulted: a model without these tokens cannot write harmony, and a checkpoint that has them
was trained on it.

The parser reads the generated *text* (detokenized with special tokens kept,
``skip_special_tokens=False``), incrementally: text can arrive in any pieces, a marker split
across pieces is held back until it is whole, and feeding a text in one piece or many gives the
same messages. It is lenient with what models get wrong: a message cut off without ``<|end|>`` by a
new ``<|start|>``, a ``<|channel|>`` right after ``<|end|>`` without ``<|start|>``, text between
messages (dropped), a header cut off by an end marker (dropped). Output that does not begin like a
harmony header (``<|...`` or `` to=``) is plain text: one message with no channel, as when the
prompt already opened the message (continue_final_message) or structured outputs forced plain
JSON.

``HarmonyParser`` gives every message (channel, recipient, content type, text); ``HarmonyChat`` splits
a stream into the answer (final channel, or plain text) and the reasoning (analysis channel), what
the chat API returns as content and reasoning. Commentary messages and tool calls are in neither;
they stay available on ``HarmonyParser.messages`` for a tool-call parser.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
RETURN, CALL, CONSTRAIN = "<|return|>", "<|call|>", "<|constrain|>"
MARKERS = (START, END, MESSAGE, CHANNEL, RETURN, CALL, CONSTRAIN)
# the tokens a tokenizer must have to speak harmony (see the module docstring)
STRUCTURE_TOKENS = (START, MESSAGE, CHANNEL, END)
# the tokens that end an assistant's turn: the answer is done, or a tool call waits for its result
TURN_END_TOKENS = (RETURN, CALL)

_MESSAGE_ENDS = (END, RETURN, CALL)
_LONGEST_MARKER = max(len(m) for m in MARKERS)
# how an assistant's output after the prompt's "<|start|>assistant" can begin
_HEADER_OPENINGS = ("<|", " to=")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_WORD = re.compile(r"\s*([^\s<]+)")
_CONTENT_TYPE = re.compile(r"<\|constrain\|>\s*([^\s<]+)")


class _Vocabulary(Protocol):
    def token_to_id(self, token: str) -> int | None: ...


def is_harmony_tokenizer(tokenizer: _Vocabulary) -> bool:
    """Whether a model with this tokenizer speaks harmony (the rule in the module docstring)."""
    return all(tokenizer.token_to_id(t) is not None for t in STRUCTURE_TOKENS)


def turn_end_token_ids(tokenizer: _Vocabulary) -> list[int]:
    """Ids of <|return|> and <|call|>: generation must stop at both, whatever EOS ids the
    checkpoint declares (a GGUF may name only <|return|>)."""
    ids = (tokenizer.token_to_id(t) for t in TURN_END_TOKENS)
    return [i for i in ids if i is not None]


@dataclass
class HarmonyMessage:
    """One message of the output. channel None: plain text (output that is not harmony) or a
    header that named no channel."""

    role: str = "assistant"
    channel: str | None = None
    recipient: str | None = None      # e.g. "functions.get_weather"
    content_type: str | None = None   # e.g. "json"
    content: str = ""
    end: str | None = None            # the marker that closed it: <|end|>, <|return|>, <|call|>, <|start|>

    @property
    def closed(self) -> bool:
        return self.end is not None


@dataclass
class HarmonyDelta:
    """Text added to message number `index`."""

    index: int
    message: HarmonyMessage
    text: str


def parse_header(header: str, role: str | None = None) -> HarmonyMessage:
    """The message a header opens. `header` is the text between <|start|> and <|message|>, which
    begins with the role; role (given) means the header is the rest of one whose role was already
    written (the prompt's "<|start|>assistant")."""
    before, has_channel, after = header.partition(CHANNEL)
    if role is None:
        words = before.split()
        role = words[0] if words and not words[0].startswith("to=") else "assistant"
    channel = content_type = None
    if has_channel:
        word = _WORD.match(after)
        if word is not None:
            channel, after = word.group(1), after[word.end():]
    constrain = _CONTENT_TYPE.search(header)
    if constrain is not None:
        content_type = constrain.group(1)
    elif has_channel:            # "commentary json": the word after the channel that is not a recipient
        content_type = next((w for w in after.split() if not w.startswith("to=")), None)
    recipient = _RECIPIENT.search(header.replace(CHANNEL, " ").replace(CONSTRAIN, " "))
    return HarmonyMessage(role=role, channel=channel, recipient=recipient.group(1) if recipient else None,
                          content_type=content_type)


def _first_marker(text: str, markers: tuple[str, ...], start: int = 0) -> tuple[int, str | None]:
    """The earliest of `markers` in text[start:]: (position, marker), or (-1, None)."""
    best, found = -1, None
    for marker in markers:
        at = text.find(marker, start)
        if at != -1 and (best == -1 or at < best):
            best, found = at, marker
    return best, found


def _partial_marker(text: str) -> int:
    """Length of the longest end of `text` that is the beginning of a marker (held back: the next
    piece may complete it)."""
    at = text.find("<", max(0, len(text) - _LONGEST_MARKER + 1))
    while at != -1:
        tail = text[at:]
        if any(m.startswith(tail) for m in MARKERS):
            return len(text) - at
        at = text.find("<", at + 1)
    return 0


class HarmonyParser:
    """Incremental reader of an assistant's harmony output (the text after the prompt's
    "<|start|>assistant"). feed() the text as it comes, finish() at the end; each returns the text
    added to messages, in order. ``messages`` holds every message so far, the open one last."""

    _BEGIN, _HEADER, _BODY, _BETWEEN = range(4)

    def __init__(self) -> None:
        self.messages: list[HarmonyMessage] = []
        self._state = self._BEGIN
        self._pending = ""          # text received and not yet read
        self._role: str | None = "assistant"   # the open header's role when written before it
        self._scanned = 0           # how much of a pending header has been searched for its end
        self._finished = False

    @property
    def open_message(self) -> HarmonyMessage | None:
        """The message whose text is still coming, if any."""
        if self._state == self._BODY and self.messages and not self.messages[-1].closed:
            return self.messages[-1]
        return None

    def feed(self, text: str) -> list[HarmonyDelta]:
        if self._finished:
            raise RuntimeError("HarmonyParser.feed after finish")
        self._pending += text
        return self._read(final=False)

    def finish(self) -> list[HarmonyDelta]:
        """The output is complete: text held back as a possible marker is text after all; an
        unfinished header is dropped; the last message stays unclosed (end None) if it was cut."""
        if self._finished:
            return []
        out = self._read(final=True)
        self._finished = True
        return out

    def _read(self, final: bool) -> list[HarmonyDelta]:
        out: list[HarmonyDelta] = []
        while True:
            pending = self._pending
            if self._state == self._BEGIN:
                if pending.startswith(_HEADER_OPENINGS):
                    self._state = self._HEADER
                elif not pending or (not final and any(o.startswith(pending) for o in _HEADER_OPENINGS)):
                    return out              # too short to tell yet
                else:                       # not harmony: plain text, one message without a channel
                    self.messages.append(HarmonyMessage())
                    self._state = self._BODY
            elif self._state == self._HEADER:
                at, marker = _first_marker(pending, (MESSAGE, START) + _MESSAGE_ENDS,
                                           max(0, self._scanned - _LONGEST_MARKER + 1))
                if marker is None:
                    self._scanned = len(pending)
                    if final:               # the output ended inside a header: no message
                        self._pending = ""
                    return out
                self._pending, self._scanned = pending[at + len(marker):], 0
                if marker == MESSAGE:
                    self.messages.append(parse_header(pending[:at], self._role))
                    self._state = self._BODY
                elif marker == START:       # a new header begins; this one is dropped
                    self._role = None
                else:                       # ended before <|message|>: malformed, dropped
                    self._state = self._BETWEEN
            elif self._state == self._BODY:
                at, marker = _first_marker(pending, _MESSAGE_ENDS + (START,))
                message = self.messages[-1]
                if marker is None:
                    keep = 0 if final else _partial_marker(pending)
                    self._add(out, pending[:len(pending) - keep])
                    self._pending = pending[len(pending) - keep:]
                    return out
                self._add(out, pending[:at])
                self._pending = pending[at + len(marker):]
                message.end = marker
                if marker == START:         # the model skipped <|end|>
                    self._state, self._role = self._HEADER, None
                else:
                    self._state = self._BETWEEN
            else:                           # between messages: only a new header counts
                at, marker = _first_marker(pending, (START, CHANNEL))
                if marker is None:
                    keep = 0 if final else _partial_marker(pending)
                    self._pending = pending[len(pending) - keep:]
                    return out
                if marker == START:
                    self._pending, self._role = pending[at + len(START):], None
                else:                       # <|channel|> without <|start|>assistant: an assistant header
                    self._pending, self._role = pending[at:], "assistant"
                self._state = self._HEADER

    def _add(self, out: list[HarmonyDelta], text: str) -> None:
        if text:
            message = self.messages[-1]
            message.content += text
            out.append(HarmonyDelta(len(self.messages) - 1, message, text))


def answer_part(message: HarmonyMessage) -> str | None:
    """What a message is to the chat API: "content" (the final channel, or plain text),
    "reasoning" (the analysis channel), or None (commentary, tool calls, other recipients)."""
    if message.recipient is not None or message.role != "assistant":
        return None
    if message.channel in ("final", None):
        return "content"
    if message.channel == "analysis":
        return "reasoning"
    return None


@dataclass
class ChatDelta:
    content: str = ""
    reasoning: str = ""


@dataclass
class HarmonyChat:
    """The answer and the reasoning of one output, as text deltas arrive: feed(delta, final)
    returns what each gained. Several messages of one kind are joined with a newline. Feeding the
    whole text at once gives the same totals as any split of it."""

    parser: HarmonyParser = field(default_factory=HarmonyParser)
    content: str = ""
    reasoning: str = ""
    _last: dict = field(default_factory=dict)   # kind -> index of the message it last took text from

    def feed(self, text: str, final: bool = False) -> ChatDelta:
        deltas = self.parser.feed(text) if text else []
        if final:
            deltas += self.parser.finish()
        delta = ChatDelta()
        for d in deltas:
            kind = answer_part(d.message)
            if kind is None:
                continue
            piece = d.text
            if self._last.get(kind, d.index) != d.index:
                piece = "\n" + piece
            self._last[kind] = d.index
            setattr(delta, kind, getattr(delta, kind) + piece)
        self.content += delta.content
        self.reasoning += delta.reasoning
        return delta


def parse_chat_output(text: str) -> tuple[str, str | None]:
    """(content, reasoning) of a whole output: the final channel's text ("" when the output never
    reached it, e.g. cut by max_tokens while reasoning) and the analysis channel's (None if none)."""
    chat = HarmonyChat()
    chat.feed(text, final=True)
    return chat.content, chat.reasoning or None
