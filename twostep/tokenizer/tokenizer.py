"""Tokenizer: a thin layer over a `tokenizers.Tokenizer` plus what the HF folder around it says.

It adds the pieces an inference engine needs and `tokenizer.json` alone does not carry:
special tokens and BOS policy from `tokenizer_config.json`, extra EOS ids from
`generation_config.json`, chat templates rendered with Jinja the way transformers renders
them, and a per-sequence decode stream for streaming output.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, Iterable

import tokenizers
from tokenizers.decoders import DecodeStream

from twostep.tokenizer.tool_prompt import messages_with_tools, template_reads_tools

# Named special tokens that transformers hands to chat templates as variables.
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)
# Message keys that carry a reasoning trace; templates differ in which one they read.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")


def _token_text(value: Any) -> str | None:
    """A special-token entry from tokenizer_config: a plain string or an AddedToken-style dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    content = value.get("content") if isinstance(value, dict) else getattr(value, "content", None)
    return content if isinstance(content, str) else None


def _as_id_list(ids: Any) -> list[int]:
    """Accept a list/tuple of ints, a single int, or anything with .tolist() (tensors, arrays)."""
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]


def _read_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


class Tokenizer:
    """Encode/decode text and render chat prompts for one model.

    backend: the fast tokenizer built from tokenizer.json.
    tokenizer_config: the parsed tokenizer_config.json (may be {}); its "chat_template" entry,
        if any, is the template (a string, a list of {"name", "template"}, or a name->template dict).
    generation_config: the parsed generation_config.json, or None; only eos/bos ids are read.
    """

    def __init__(self, backend: tokenizers.Tokenizer, tokenizer_config: dict,
                 generation_config: dict | None = None):
        self.backend = backend
        self._max_token_chars: int | None = None
        self.tokenizer_config = dict(tokenizer_config or {})
        self.generation_config = dict(generation_config or {})

        # Named special tokens as strings, only those that are set (what templates see).
        self.special_tokens_map: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            text = _token_text(self.tokenizer_config.get(name))
            if text is not None:
                self.special_tokens_map[name] = text

        self.chat_template: str | dict[str, str] | None = self._normalise_templates(
            self.tokenizer_config.get("chat_template"))
        self.add_bos_token: bool = bool(self.tokenizer_config.get("add_bos_token", False))

        gen_eos = self.generation_config.get("eos_token_id")
        if gen_eos is None:
            gen_eos = []
        elif isinstance(gen_eos, int):
            gen_eos = [gen_eos]
        self._generation_eos_ids: list[int] = [int(i) for i in gen_eos]

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_folder(cls, path: str | Path) -> "Tokenizer":
        """Load from an HF-style model folder (tokenizer.json required, the rest optional)."""
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json in {folder}; twostep needs a fast (tokenizers) tokenizer file")
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json") or {}

        # Older folders keep special tokens in special_tokens_map.json only.
        legacy_map = _read_json(folder / "special_tokens_map.json") or {}
        for name in SPECIAL_TOKEN_NAMES:
            if config.get(name) is None and legacy_map.get(name) is not None:
                config[name] = legacy_map[name]

        # Separate template files take priority over the entry in tokenizer_config.json.
        templates: dict[str, str] = {}
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text(encoding="utf-8")
        else:
            json_template = _read_json(folder / "chat_template.json")
            if json_template and json_template.get("chat_template"):
                templates["default"] = json_template["chat_template"]
        extra_dir = folder / "additional_chat_templates"
        if extra_dir.is_dir():
            for file in sorted(extra_dir.glob("*.jinja")):
                templates[file.stem] = file.read_text(encoding="utf-8")
        if templates:
            config["chat_template"] = (templates["default"]
                                       if list(templates) == ["default"] else templates)

        generation_config = _read_json(folder / "generation_config.json")
        return cls(backend, config, generation_config)

    @staticmethod
    def _normalise_templates(raw: Any) -> str | dict[str, str] | None:
        if raw is None or raw == "":
            return None
        if isinstance(raw, str):
            return raw
        if isinstance(raw, dict):
            return {str(k): v for k, v in raw.items()}
        if isinstance(raw, list):  # tokenizer_config style: [{"name": ..., "template": ...}, ...]
            return {entry["name"]: entry["template"] for entry in raw}
        raise ValueError(f"unsupported chat_template value of type {type(raw).__name__}")

    # ------------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        """Size of the tokenizer vocabulary including added tokens (may be below the model's embedding rows)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self.backend.id_to_token(i) for i in _as_id_list(ids)]

    def _special_id(self, name: str) -> int | None:
        text = self.special_tokens_map.get(name)
        return None if text is None else self.backend.token_to_id(text)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens_map.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens_map.get("eos_token")

    @property
    def bos_token_id(self) -> int | None:
        token_id = self._special_id("bos_token")
        if token_id is None and isinstance(self.generation_config.get("bos_token_id"), int):
            token_id = self.generation_config["bos_token_id"]
        return token_id

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's EOS; falls back to the first generation_config EOS when the tokenizer names none."""
        token_id = self._special_id("eos_token")
        if token_id is None and self._generation_eos_ids:
            token_id = self._generation_eos_ids[0]
        return token_id

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def eos_token_ids(self) -> set[int]:
        """Every id that ends generation: the tokenizer EOS plus generation_config's eos_token_id(s)."""
        ids = set(self._generation_eos_ids)
        own = self._special_id("eos_token")
        if own is not None:
            ids.add(own)
        return ids

    @property
    def all_special_ids(self) -> set[int]:
        """Ids of added tokens flagged special (the ones skip_special_tokens drops)."""
        return {i for i, tok in self.backend.get_added_tokens_decoder().items() if tok.special}

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`. With add_special_tokens the backend's post-processor runs, and BOS is
        prepended when tokenizer_config asks for it (add_bos_token) and it is not already first."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token:
            bos = self.bos_token_id
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for (the longest vocabulary string: byte-level
        and sentencepiece tokens spell at least one character per character of text), so a text
        of c characters has at least c / max_token_chars tokens: a bound checked before encoding."""
        if self._max_token_chars is None:
            self._max_token_chars = max(len(t) for t in self.backend.get_vocab(with_added_tokens=True))
        return self._max_token_chars

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(t, add_special_tokens) for t in texts]

    def encode_pair(self, text: str, pair: str, add_special_tokens: bool = True) -> list[int]:
        """Two texts as one sequence, as transformers' tokenizer(text, text_pair) joins them: the
        post-processor's pair template (a BERT-style [CLS] a [SEP] b [SEP]; a decoder's tokenizer
        without one just puts b after a), with BOS first where tokenizer_config asks for it. A
        cross-encoder scores such a pair (vLLM's score and rerank)."""
        ids = self.backend.encode(text, pair, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token:
            bos = self.bos_token_id
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(_as_id_list(ids), skip_special_tokens=skip_special_tokens)

    def new_decode_stream(self, skip_special_tokens: bool = True) -> "TokenStream":
        """A fresh incremental decoder for one generated sequence."""
        return TokenStream(self.backend, skip_special_tokens)

    # ------------------------------------------------------------------ chat templates

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template text to use: an explicit template (or the name of one of ours), else ours."""
        named = self.chat_template if isinstance(self.chat_template, dict) else {}
        if chat_template is not None:
            return named.get(chat_template, chat_template)
        if self.chat_template is None:
            raise ValueError(
                "this tokenizer has no chat template (none in tokenizer_config.json, chat_template.jinja "
                "or chat_template.json); pass chat_template= explicitly or send a plain-text prompt")
        if isinstance(self.chat_template, str):
            return self.chat_template
        if tools is not None and "tool_use" in named:
            return named["tool_use"]
        if "default" in named:
            return named["default"]
        raise ValueError(
            f"this tokenizer has several chat templates ({sorted(named)}) and none is named 'default'; "
            "pass chat_template=<name>")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            chat_template: str | None = None, continue_final_message: bool = False,
                            **kwargs) -> str:
        """Render `messages` to prompt text. Extra keyword arguments become template variables
        (e.g. enable_thinking=False) and override the special-token variables.
        continue_final_message: the text ends right after the last message's content (no end of
        turn), so the model continues that message (a prefilled reply)."""
        template_text = self.get_chat_template(chat_template, tools)
        if not messages:
            raise ValueError("cannot apply a chat template to an empty list of messages")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        chat = [_prepare_message(m) for m in messages]
        if tools is not None:
            for tool in tools:
                if not isinstance(tool, dict):
                    raise TypeError(f"tools must be JSON-schema dicts, got {type(tool).__name__}")
            if tools and not template_reads_tools(template_text):   # see tokenizer/tool_prompt.py
                chat, tools = messages_with_tools(chat, tools), None
        variables = {**self.special_tokens_map, **kwargs}
        text = _compile_template(template_text).render(
            messages=chat, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **variables)
        return _cut_after_final_message(text, chat[-1]) if continue_final_message else text

    def to_hf(self):
        """This tokenizer as a transformers PreTrainedTokenizerFast (what vLLM hands out), sharing
        the token table, special tokens and chat template."""
        from transformers import PreTrainedTokenizerFast

        template = self.chat_template
        return PreTrainedTokenizerFast(tokenizer_object=self.backend, chat_template=template,
                                       **self.special_tokens_map)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    add_special_tokens: bool = False, **kwargs) -> list[int]:
        """Prompt ids for a chat. The template already writes BOS etc., so by default no special
        tokens are added."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids


# ---------------------------------------------------------------------- decode stream


class TokenStream:
    """Turns generated ids into text pieces as they arrive, for one sequence.

    Built on `tokenizers.decoders.DecodeStream`, which decodes a short window of ids and hands
    out only the new text, holding ids back while they end in an incomplete UTF-8 character.
    Concatenated pieces (plus flush()) equal backend.decode(all ids) for valid text.

    DecodeStream raises when earlier text changes after more ids arrive; this happens with the
    ByteFallback decoder on invalid byte sequences (a run of <0xNN> tokens that is not valid
    UTF-8 is replaced as a whole). Then we restart the stream from the ids not yet handed out,
    so a model producing junk bytes cannot break streaming.
    """

    _CONTEXT = 4  # ids kept from the last piece, to decode the held-back tail at flush()

    def __init__(self, backend: tokenizers.Tokenizer, skip_special_tokens: bool = True):
        self._backend = backend
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []      # ids fed since the last piece came out
        self._context: list[int] = []   # last few ids whose text has come out

    def step(self, ids: int | list[int]) -> str:
        """Feed new ids; returns the text they complete ("" while a character is still partial).

        Ids go in one at a time: DecodeStream given several at once holds back all their text
        when the last one ends mid-character, where one at a time releases the complete part."""
        pieces = [self._step_one(i) for i in _as_id_list(ids)]
        return "".join(p for p in pieces if p)

    def _step_one(self, token_id: int) -> str | None:
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception:  # tokenizers reports "Invalid prefix" as a bare Exception
            piece = self._restart(self._held + [token_id])
        self._held.append(token_id)
        if piece is None:
            return None
        self._context = (self._context + self._held)[-self._CONTEXT:]
        self._held = []
        return piece

    def _restart(self, ids: list[int]) -> str | None:
        """New DecodeStream fed with the not-yet-emitted ids, first with the recent emitted ids
        as decoding context (keeps e.g. a leading space right), else with none (cannot fail)."""
        attempts = [self._context, []] if self._context else [[]]
        for context in attempts:
            self._stream = DecodeStream(ids=context or None, skip_special_tokens=self._skip)
            try:
                return self._stream.step(self._backend, ids)
            except Exception:
                if not context:
                    raise
        return None

    def flush(self) -> str:
        """Text of ids still held back (an incomplete character at the very end), decoded as-is."""
        if not self._held:
            return ""
        before = self._backend.decode(self._context, skip_special_tokens=self._skip)
        after = self._backend.decode(self._context + self._held, skip_special_tokens=self._skip)
        if after.startswith(before):
            tail = after[len(before):]
        else:
            # ByteFallback turned the emitted text before into U+FFFD as well (its byte run is
            # invalid as a whole); what is out stays out, so decode the held ids on their own.
            tail = self._backend.decode(self._held, skip_special_tokens=self._skip)
        self._context = (self._context + self._held)[-self._CONTEXT:]
        self._held = []
        return tail

    @property
    def pending(self) -> bool:
        return bool(self._held)


# ---------------------------------------------------------------------- jinja


def _cut_after_final_message(text: str, final: dict) -> str:
    """The rendered chat up to the end of the last message's content (what follows it is the
    template's end of turn)."""
    content = final.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not isinstance(content, str) or not content.strip():
        raise ValueError("continue_final_message needs a last message with text content")
    for needle in (content, content.strip()):
        at = text.rfind(needle)
        if at != -1:
            return text[:at + len(needle)]
    raise ValueError("continue_final_message: the chat template does not write the last message's content")


def _tool_call_for_template(call: Any) -> Any:
    """An assistant's tool call with its arguments as an object: templates write them with tojson,
    OpenAI sends them as JSON text."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError('a tool call must be {"id", "type": "function", "function": {"name", "arguments"}}')
    if not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"] or "{}")
    except ValueError:
        raise ValueError(f"a tool call's arguments are not valid JSON: {function['arguments'][:80]!r}") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _prepare_message(message: Any) -> dict:
    """What transformers does before rendering: drop None-valued keys (OpenAI clients send
    content=None with tool calls) and expose a reasoning trace under every key templates read;
    and as the server does for every caller: text content parts joined into one string, a tool
    call's JSON-text arguments as an object."""
    if not isinstance(message, dict):
        raise TypeError(f"chat messages must be dicts, got {type(message).__name__}")
    out = {k: v for k, v in message.items() if v is not None}
    if isinstance(out.get("content"), list):          # OpenAI content parts: text only
        odd = next((p for p in out["content"] if not isinstance(p, dict) or p.get("type") != "text"), None)
        if odd is not None:
            kind = odd.get("type") if isinstance(odd, dict) else type(odd).__name__
            raise ValueError(f"only text content parts are supported, not {kind!r}: twostep runs a model's text "
                             "part (a multimodal checkpoint's vision tower is not loaded)")
        out["content"] = "".join(str(p.get("text", "")) for p in out["content"])
    if out.get("tool_calls"):
        out["tool_calls"] = [_tool_call_for_template(c) for c in out["tool_calls"]]
    reasoning = next((out[k] for k in _REASONING_KEYS if k in out), None)
    if reasoning is not None:
        out = {"thinking": reasoning, "reasoning": reasoning, **out, "reasoning_content": reasoning}
    return out


def _raise_exception(message: str):
    import jinja2
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Unlike Jinja's built-in tojson this does not HTML-escape, and keeps non-ASCII text readable.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_template(source: str):
    return _jinja_env().from_string(source)


@lru_cache(maxsize=1)
def _jinja_env():
    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks;
        for inference it only has to render its body."""
        tags: ClassVar[set[str]] = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class SafeNamespace(jinja2.utils.Namespace):
        """namespace() that refuses underscore names, so templates cannot reach dunder attributes."""

        def __init__(*args, **kwargs):
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for key in attrs:
                SafeNamespace._check(key)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, key, value):
            SafeNamespace._check(key)
            jinja2.utils.Namespace.__setitem__(self, key, value)

        @staticmethod
        def _check(key):
            if isinstance(key, str) and key.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates may not set underscore attribute {key!r} on a namespace")

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = SafeNamespace
    return env
