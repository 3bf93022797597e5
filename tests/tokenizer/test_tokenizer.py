"""Tokenizer wrapper: encode/decode, BOS policy, EOS ids, folder loading, chat templates.

Tokenizers are trained in memory with the `tokenizers` library (no hub access); transformers'
PreTrainedTokenizerFast serves as the oracle for chat template rendering.
"""
from __future__ import annotations

import json
from datetime import datetime, timedelta

import jinja2
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from twostep.tokenizer.tokenizer import Tokenizer

CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "Streaming text one token at a time needs care with spaces and bytes.",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "日本語のテキストも少しあります。東京は大きい都市です。",
    "Emoji time: 😀 🎉 🚀 👍🏽 ❤️ 🇫🇷 and a robot 🤖!",
    "Accents: café naïve résumé, Greek Ωμέγα, dashes — and “quotes” …",
] * 10

CHAT_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
]

TEXTS = [
    "Hello world!",
    "  leading and  double  spaces, trailing ",
    "你好，世界！今天天气很好。",
    "Emoji 😀🎉👍🏽🇫🇷 mixed with café and 東京",
    "line one\nline two\n\n\ttabbed",
]


def byte_level_backend() -> Backend:
    """GPT-2 style byte-level BPE; a small vocab leaves CJK and emoji split over byte tokens."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=CHAT_SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def metaspace_backend() -> Backend:
    """SentencePiece-style: Metaspace pre-tokenizer/decoder and a post-processor that adds <s>."""
    tok = Backend(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def clone(backend: Backend) -> Backend:
    return Backend.from_str(backend.to_str())


@pytest.fixture(scope="module")
def bl_backend() -> Backend:
    return byte_level_backend()


@pytest.fixture(scope="module")
def ms_backend() -> Backend:
    return metaspace_backend()


def hf_oracle(backend: Backend, chat_template: str, **special_tokens):
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast(tokenizer_object=clone(backend), chat_template=chat_template,
                                   **special_tokens)


# ---------------------------------------------------------------- encode / decode


def test_byte_level_round_trip_and_byte_splits(bl_backend):
    tok = Tokenizer(clone(bl_backend), {"eos_token": "<|endoftext|>"})
    for text in TEXTS:
        ids = tok.encode(text)
        assert tok.decode(ids) == text
        assert tok.backend.decode(ids) == text
    # The streaming tests rely on characters being split over several tokens: check that here.
    ids = tok.encode("你好，世界！東京は大きい都市です。 😀 🎉 🚀 👍🏽 🇫🇷 🤖")
    assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_metaspace_round_trip_single_bos(ms_backend):
    tok = Tokenizer(clone(ms_backend), {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True})
    bos = tok.bos_token_id
    assert bos == ms_backend.token_to_id("<s>")
    for text in ["Hello world!", "café 東京 😀", "the  lazy dog"]:
        ids = tok.encode(text)
        assert ids[0] == bos and ids.count(bos) == 1   # post-processor added it; we did not add another
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False).startswith("<s>")
        plain = tok.encode(text, add_special_tokens=False)
        assert plain == ids[1:]


def test_metaspace_matches_transformers_encode(ms_backend):
    tok = Tokenizer(clone(ms_backend), {"bos_token": "<s>", "eos_token": "</s>"})
    hf = hf_oracle(ms_backend, None, bos_token="<s>", eos_token="</s>")
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text)
        assert tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        assert tok.decode(tok.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)


def test_bos_prepended_when_post_processor_does_not(bl_backend):
    bos_text = "<|begin_of_text|>"
    tok = Tokenizer(clone(bl_backend), {"bos_token": bos_text, "add_bos_token": True})
    bos = tok.bos_token_id
    ids = tok.encode("Hello world!")
    assert ids[0] == bos and ids[1:] == tok.encode("Hello world!", add_special_tokens=False)
    # text that already starts with the BOS token gets no second one
    ids = tok.encode(bos_text + "Hello")
    assert ids.count(bos) == 1 and ids[0] == bos
    assert tok.encode("") == [bos]
    # without add_bos_token nothing is added
    plain = Tokenizer(clone(bl_backend), {"bos_token": bos_text})
    assert bos not in plain.encode("Hello world!")


def test_bos_not_doubled_when_post_processor_adds_it(bl_backend):
    backend = clone(bl_backend)
    bos_text = "<|begin_of_text|>"
    backend.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos_text} $A", pair=f"{bos_text} $A {bos_text} $B",
                                      special_tokens=[(bos_text, backend.token_to_id(bos_text))]),
    ])
    tok = Tokenizer(backend, {"bos_token": {"content": bos_text, "special": True}, "add_bos_token": True})
    ids = tok.encode("Hi there")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_special_tokens_as_dicts_and_eos_union(bl_backend):
    cfg = {
        "bos_token": {"__type": "AddedToken", "content": "<|begin_of_text|>", "lstrip": False},
        "eos_token": {"content": "<|im_end|>"},
        "pad_token": "<|endoftext|>",
        "unk_token": None,
    }
    ids = {t: bl_backend.token_to_id(t) for t in CHAT_SPECIALS}
    tok = Tokenizer(clone(bl_backend), cfg, {"eos_token_id": [ids["<|endoftext|>"], ids["<|eot_id|>"]]})
    assert tok.bos_token == "<|begin_of_text|>" and tok.bos_token_id == ids["<|begin_of_text|>"]
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == ids["<|im_end|>"]
    assert tok.pad_token_id == ids["<|endoftext|>"]
    assert tok.eos_token_ids == {ids["<|im_end|>"], ids["<|endoftext|>"], ids["<|eot_id|>"]}
    assert "unk_token" not in tok.special_tokens_map

    single = Tokenizer(clone(bl_backend), cfg, {"eos_token_id": ids["<|eot_id|>"]})
    assert single.eos_token_ids == {ids["<|im_end|>"], ids["<|eot_id|>"]}
    assert Tokenizer(clone(bl_backend), cfg).eos_token_ids == {ids["<|im_end|>"]}

    # no eos in the tokenizer config: generation_config supplies it
    gen_only = Tokenizer(clone(bl_backend), {}, {"eos_token_id": [ids["<|eot_id|>"]]})
    assert gen_only.eos_token_id == ids["<|eot_id|>"] and gen_only.eos_token_ids == {ids["<|eot_id|>"]}
    assert Tokenizer(clone(bl_backend), {}).eos_token_ids == set()
    assert Tokenizer(clone(bl_backend), {}).bos_token_id is None


def test_vocab_and_token_lookups(bl_backend):
    tok = Tokenizer(clone(bl_backend), {})
    assert tok.vocab_size == bl_backend.get_vocab_size(with_added_tokens=True)
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.id_to_token(im_end) == "<|im_end|>"
    ids = tok.encode("Hello<|im_end|>")
    assert tok.convert_ids_to_tokens(ids)[-1] == "<|im_end|>"
    assert im_end in tok.all_special_ids
    assert tok.decode(ids) == "Hello"
    assert tok.decode(ids, skip_special_tokens=False) == "Hello<|im_end|>"


def test_decode_accepts_tensors(bl_backend):
    torch = pytest.importorskip("torch")
    tok = Tokenizer(clone(bl_backend), {})
    ids = tok.encode("你好 world")
    assert tok.decode(torch.tensor(ids)) == "你好 world"


# ---------------------------------------------------------------- chat templates

CHATML = """{% for message in messages %}
{% if loop.first and message['role'] != 'system' %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

LLAMA3_STYLE = """{{- bos_token }}
{%- set ns = namespace(system='You are a bot.', turns=0) %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{{- 'Today Date: ' + date_string + '\\n\\n' }}
{%- if tools is not none %}
    {{- 'You may call these tools:\\n' }}
    {%- for tool in tools %}
        {{- tool | tojson(indent=4) + '\\n\\n' }}
    {%- endfor %}
{%- endif %}
{{- ns.system + '<|eot_id|>' }}
{%- for message in messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('Unsupported role: ' + message['role']) }}
    {%- endif %}
    {%- if ns.turns >= max_turns | default(100) %}{% break %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}
    {%- if message['role'] == 'assistant' %}
        {%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}
    {%- else %}
        {{- message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city, e.g. Zürich or 東京 <b>",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be terse."},
     {"role": "user", "content": "你好，世界 😀"},
     {"role": "assistant", "content": "Hi there. "},
     {"role": "user", "content": "  And café?\nTwo lines.  "}],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_matches_transformers(bl_backend, messages, add_generation_prompt):
    cfg = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}
    tok = Tokenizer(clone(bl_backend), cfg)
    hf = hf_oracle(bl_backend, CHATML, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == expected
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    hf_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    hf_ids = hf_ids["input_ids"] if not isinstance(hf_ids, list) else hf_ids
    assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt) == hf_ids


@pytest.mark.parametrize("with_tools", [False, True])
def test_llama3_style_template_matches_transformers(bl_backend, with_tools):
    bos_text = "<|begin_of_text|>"
    backend = clone(bl_backend)
    # Like Llama 3: the post-processor adds BOS and the template writes it too.
    backend.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos_text} $A", pair=f"{bos_text} $A {bos_text} $B",
                                      special_tokens=[(bos_text, backend.token_to_id(bos_text))]),
    ])
    cfg = {"bos_token": bos_text, "eos_token": "<|eot_id|>", "chat_template": LLAMA3_STYLE}
    tok = Tokenizer(backend, cfg)
    hf = hf_oracle(backend, LLAMA3_STYLE, bos_token=bos_text, eos_token="<|eot_id|>")
    messages = CONVERSATIONS[1]
    tools = [TOOL] if with_tools else None
    text = tok.apply_chat_template(messages, tools=tools, date_string="26 Jul 2024")
    expected = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                      date_string="26 Jul 2024")
    assert text == expected
    assert text.startswith(bos_text + "<|start_header_id|>system")
    assert ("Zürich or 東京 <b>" in text) == with_tools   # tojson keeps non-ASCII, no HTML escaping
    assert text.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")

    ids = tok.encode_chat(messages, tools=tools, date_string="26 Jul 2024")
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    hf_ids = hf.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                    date_string="26 Jul 2024")
    hf_ids = hf_ids["input_ids"] if not isinstance(hf_ids, list) else hf_ids
    assert ids == hf_ids

    # loopcontrols ({% break %}) and kwargs reaching the template
    short = tok.apply_chat_template(messages, date_string="x", max_turns=1)
    assert short.count("<|start_header_id|>user") == 1 and "assistant<|end_header_id|>\n\nHi" not in short


def test_template_raise_exception(bl_backend):
    tok = Tokenizer(clone(bl_backend), {"bos_token": "<|begin_of_text|>", "chat_template": LLAMA3_STYLE})
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unsupported role: robot"):
        tok.apply_chat_template([{"role": "robot", "content": "beep"}], date_string="x")


def test_none_values_dropped_like_transformers(bl_backend):
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.content is defined %}{{ m.content }}{% endif %}"
        "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
        "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}"
        "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    messages = [
        {"role": "user", "content": "Weather in Zürich?"},
        {"role": "assistant", "content": None, "reasoning": "need a tool",
         "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "content": "sunny"},
    ]
    tok = Tokenizer(clone(bl_backend), {"chat_template": template})
    hf = hf_oracle(bl_backend, template)
    text = tok.apply_chat_template(messages)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert "None" not in text and "<think>need a tool</think>" in text


def test_strftime_now_and_special_token_variables(bl_backend):
    template = "{{ strftime_now('%Y-%m-%d') }}#{{ bos_token }}#{{ eos_token }}#{{ pad_token is defined }}"
    tok = Tokenizer(clone(bl_backend), {"bos_token": "<|begin_of_text|>", "eos_token": {"content": "<|eot_id|>"},
                                        "chat_template": template})
    before = datetime.now()
    text = tok.apply_chat_template([{"role": "user", "content": "x"}])
    after = datetime.now() + timedelta(seconds=1)
    date, bos, eos, pad = text.split("#")
    assert date in {before.strftime("%Y-%m-%d"), after.strftime("%Y-%m-%d")}
    assert (bos, eos, pad) == ("<|begin_of_text|>", "<|eot_id|>", "False")
    # kwargs override the special-token variables
    assert tok.apply_chat_template([{"role": "user", "content": "x"}], bos_token="B").split("#")[1] == "B"


def test_missing_template_raises(bl_backend):
    tok = Tokenizer(clone(bl_backend), {"eos_token": "<|im_end|>"})
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="no chat template"):
        tok.encode_chat([{"role": "user", "content": "hi"}])
    # an explicit template still works
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=CHATML).endswith(
        "<|im_start|>assistant\n")


def test_named_templates(bl_backend):
    cfg = {"chat_template": [{"name": "default", "template": "plain"},
                             {"name": "tool_use", "template": "tools:{{ tools | length }}"}]}
    tok = Tokenizer(clone(bl_backend), cfg)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == "plain"
    assert tok.apply_chat_template(msgs, tools=[TOOL]) == "tools:1"
    assert tok.apply_chat_template(msgs, tools=[]) == "tools:0"   # like transformers: tools given at all
    assert tok.apply_chat_template(msgs, chat_template="tool_use", tools=[TOOL]) == "tools:1"
    assert tok.apply_chat_template(msgs, chat_template="raw {{ messages | length }}") == "raw 1"


def test_sandbox_blocks_attribute_escape(bl_backend):
    tok = Tokenizer(clone(bl_backend), {"chat_template": "{{ messages.__class__.__mro__ }}"})
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok = Tokenizer(clone(bl_backend), {"chat_template": "{% set ns = namespace(_x=1) %}"})
    with pytest.raises(jinja2.exceptions.SecurityError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------- from_folder


def write_folder(path, backend, config=None, generation=None, files=None):
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation), encoding="utf-8")
    for name, text in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text, encoding="utf-8")
    return path


def test_from_folder_reads_everything(tmp_path, bl_backend):
    eot = bl_backend.token_to_id("<|eot_id|>")
    folder = write_folder(
        tmp_path / "m", bl_backend,
        config={"bos_token": {"content": "<|begin_of_text|>"}, "eos_token": "<|im_end|>",
                "add_bos_token": True, "chat_template": "from-config"},
        generation={"eos_token_id": [eot], "bos_token_id": 0},
        files={"chat_template.jinja": CHATML})
    tok = Tokenizer.from_folder(folder)
    assert tok.vocab_size == bl_backend.get_vocab_size(with_added_tokens=True)
    assert tok.eos_token_ids == {bl_backend.token_to_id("<|im_end|>"), eot}
    assert tok.encode("Hi")[0] == bl_backend.token_to_id("<|begin_of_text|>")
    assert tok.decode(tok.encode("你好 😀")) == "你好 😀"
    # chat_template.jinja wins over tokenizer_config's entry
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).startswith("<|im_start|>system")


def test_from_folder_template_sources(tmp_path, bl_backend):
    msgs = [{"role": "user", "content": "hi"}]
    in_config = Tokenizer.from_folder(write_folder(tmp_path / "a", bl_backend, config={"chat_template": "cfg"}))
    assert in_config.apply_chat_template(msgs) == "cfg"
    in_json = Tokenizer.from_folder(write_folder(
        tmp_path / "b", bl_backend, config={"chat_template": "cfg"},
        files={"chat_template.json": json.dumps({"chat_template": "json {{ messages[0].content }}"})}))
    assert in_json.apply_chat_template(msgs) == "json hi"
    extra = Tokenizer.from_folder(write_folder(
        tmp_path / "c", bl_backend,
        files={"chat_template.jinja": "main", "additional_chat_templates/tool_use.jinja": "tool"}))
    assert extra.apply_chat_template(msgs) == "main"
    assert extra.apply_chat_template(msgs, tools=[TOOL]) == "tool"
    bare = Tokenizer.from_folder(write_folder(tmp_path / "d", bl_backend))
    assert bare.eos_token_id is None and not bare.has_chat_template
    with pytest.raises(ValueError):
        bare.apply_chat_template(msgs)


def test_from_folder_legacy_special_tokens_map(tmp_path, ms_backend):
    folder = write_folder(tmp_path / "sp", ms_backend, config={"add_bos_token": True},
                          files={"special_tokens_map.json": json.dumps(
                              {"bos_token": {"content": "<s>"}, "eos_token": "</s>"})})
    tok = Tokenizer.from_folder(folder)
    assert tok.bos_token_id == ms_backend.token_to_id("<s>")
    assert tok.eos_token_ids == {ms_backend.token_to_id("</s>")}
    ids = tok.encode("Hello world")
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


def test_from_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_folder(tmp_path)
