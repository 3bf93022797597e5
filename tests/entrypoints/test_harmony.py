"""gpt-oss's harmony format: the prompt through the checkpoint's own template (the real one,
gpt_oss_chat_template.jinja beside this file: openai/gpt-oss-120b's chat_template.jinja as
llama.cpp keeps it in models/templates/openai-gpt-oss-120b.jinja; gpt-oss-20b has the same), and
the output read into the answer (final channel: content) and the chain of thought (analysis
channel: reasoning, never content).

The parser is tested on scripted texts split every way; the tiny gpt-oss model (random weights, a
tiny BPE with harmony's special tokens added) is forced through a harmony answer with a grammar
for LLM.chat and for the real server (the openai client, streamed and not), and its unforced output
is read by the server exactly as the parser reads the tokens it generated.
"""
from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import httpx
import jinja2
import pytest

from conftest import MODEL, Server, build_tokenizer, make_tiny_model, parse_sse
from twostep.entrypoints.harmony import (HarmonyChat, HarmonyParser, is_harmony_tokenizer, parse_chat_output,
                                         parse_header)
from twostep.tokenizer.tokenizer import Tokenizer

TEMPLATE = (Path(__file__).parent / "gpt_oss_chat_template.jinja").read_text(encoding="utf-8")
# o200k_harmony's special tokens that the format uses (real ids 199998..200012; here added to a tiny BPE)
HARMONY_TOKENS = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>",
                  "<|start|>", "<|end|>", "<|message|>", "<|call|>"]
MARKER = re.compile(r"<\|[a-z]+\|>")

ANALYSIS = "<|channel|>analysis<|message|>User says hi. Reply kindly.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?"
TOOL_CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
             '{"location": "Paris"}')


# ---- the parser, on scripted output ----------------------------------------------------------

def chat_split(pieces: list[str]) -> tuple[str, str, list]:
    """Content and reasoning streamed from these pieces (the last one final), and the deltas."""
    chat, deltas = HarmonyChat(), []
    for k, piece in enumerate(pieces):
        deltas.append(chat.feed(piece, final=k == len(pieces) - 1))
    content = "".join(d.content for d in deltas)
    reasoning = "".join(d.reasoning for d in deltas)
    assert (content, reasoning) == (chat.content, chat.reasoning)
    return content, reasoning, deltas


def splits(text: str, cuts: int):
    """Every way to cut text in `cuts` places (positions may repeat: empty pieces)."""
    for points in itertools.combinations_with_replacement(range(len(text) + 1), cuts):
        bounds = [0, *points, len(text)]
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


def test_the_answer_is_the_final_channel_and_the_analysis_is_reasoning():
    text = ANALYSIS + FINAL
    assert parse_chat_output(text) == ("Hello! How can I help?", "User says hi. Reply kindly.")
    parser = HarmonyParser()
    parser.feed(text)
    parser.finish()
    [analysis, final] = parser.messages
    assert (analysis.role, analysis.channel, analysis.end) == ("assistant", "analysis", "<|end|>")
    assert (final.channel, final.recipient, final.end) == ("final", None, None)   # <|return|> is not text


@pytest.mark.parametrize("text", [
    ANALYSIS + FINAL,
    ANALYSIS + "<|start|>assistant<|channel|>final<|message|>a <| b <|en d|> <3 <|",   # "<|" that are not markers
    "<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>analysis<|message|>y<|end|>" + FINAL,
])
def test_any_split_of_the_stream_gives_the_same_content_and_never_a_marker(text):
    whole = parse_chat_output(text)
    for pieces in itertools.chain(splits(text, 2), [list(text)]):
        content, reasoning, deltas = chat_split(pieces)
        assert (content, reasoning or None) == whole, pieces
        for d in deltas:        # what is streamed is never taken back, so no marker is ever in it
            assert not MARKER.search(d.content + d.reasoning), (pieces, d)


def test_markers_split_across_deltas_are_held_until_whole():
    pieces = ["<|chan", "nel|>analysis<|mess", "age|>think<|", "end|><|start|>assi", "stant<|channel|>final<",
              "|message|>Hi", " there<", "|"]
    chat, got = HarmonyChat(), []
    for piece in pieces:
        d = chat.feed(piece)
        got.append((d.content, d.reasoning))
    assert got == [("", ""), ("", ""), ("", "think"), ("", ""), ("", ""), ("Hi", ""), (" there", ""), ("", "")]
    assert chat.feed("", final=True).content == "<|"      # not a marker after all: text at the end
    assert chat.content == "Hi there<|"


@pytest.mark.parametrize("text,content,reasoning", [
    ("<|channel|>analysis<|message|>The user asks about", "", "The user asks about"),   # max_tokens in analysis
    ("<|channel|>analysis<|message|>Fine.<|end|><|start|>assistant<|chan", "", "Fine."),  # in the next header
    ("<|channel|>analy", "", None),                                                    # in the first header
    ("<|channel|>analysis<|message|>Fine.<|end|><|start|>assistant<|channel|>final<|message|>Par",
     "Par", "Fine."),                                                                  # in the answer
    ("", "", None),
])
def test_a_cut_output_never_shows_markers(text, content, reasoning):
    assert parse_chat_output(text) == (content, reasoning)


def test_several_analysis_messages_join_with_a_newline():
    text = ("<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis<|message|>two<|end|>"
            "<|start|>assistant<|channel|>final<|message|>A<|end|><|start|>assistant<|channel|>final<|message|>B")
    assert parse_chat_output(text) == ("A\nB", "one\ntwo")


def test_tool_calls_are_neither_content_nor_reasoning_and_keep_their_header():
    for text in (ANALYSIS + TOOL_CALL,
                 ANALYSIS + '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>'
                            '{"location": "Paris"}'):
        assert parse_chat_output(text) == ("", "User says hi. Reply kindly.")
        parser = HarmonyParser()
        parser.feed(text)
        parser.finish()
        call = parser.messages[-1]
        assert (call.channel, call.recipient, call.content_type) == ("commentary", "functions.get_weather", "json")
        assert json.loads(call.content) == {"location": "Paris"}
    # the recipient can open the output (the prompt ended in "<|start|>assistant")
    parser = HarmonyParser()
    parser.feed(' to=functions.f<|channel|>commentary json<|message|>{}')
    parser.finish()
    assert [(m.recipient, m.channel, m.content) for m in parser.messages] == [("functions.f", "commentary", "{}")]


def test_headers():
    assert parse_header("assistant<|channel|>final") == parse_header("<|channel|>final", role="assistant")
    tool = parse_header("functions.get_weather to=assistant<|channel|>commentary")
    assert (tool.role, tool.recipient, tool.channel) == ("functions.get_weather", "assistant", "commentary")
    assert parse_header("assistant<|channel|>final <|constrain|>json").content_type == "json"
    assert parse_header("assistant").channel is None


def test_what_models_get_wrong_is_read_leniently():
    # <|end|> missing before the next <|start|>; <|start|> missing after <|end|>; junk between messages
    assert parse_chat_output("<|channel|>analysis<|message|>a" + FINAL) == ("Hello! How can I help?", "a")
    assert parse_chat_output("<|channel|>analysis<|message|>a<|end|><|channel|>final<|message|>b") == ("b", "a")
    assert parse_chat_output("<|channel|>analysis<|message|>a<|end|>junk<|start|>assistant<|channel|>final"
                             "<|message|>b") == ("b", "a")
    # a header ended by <|end|> before <|message|> is dropped, and what follows still parses
    assert parse_chat_output("<|channel|>analysis<|end|><|start|>assistant<|channel|>final<|message|>b") == ("b", None)


def test_output_that_is_not_harmony_is_all_content():
    """As when the prompt already opened the final message (continue_final_message) or structured
    outputs forced plain JSON."""
    for text in ("Paris is the capital.", '{"a": 1}', "<", " t", "to", "x <|end|> y"):
        expected = text.split("<|end|>")[0]
        assert parse_chat_output(text) == (expected, None)
        for pieces in splits(text, 1):
            assert chat_split(pieces)[:2] == (expected, "")
    # a continued answer that then closes and goes on in harmony
    assert parse_chat_output(" world.<|end|><|start|>assistant<|channel|>final<|message|>More") == (" world.\nMore",
                                                                                                    None)


def test_the_parser_refuses_text_after_finish():
    parser = HarmonyParser()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


# ---- a tiny gpt-oss checkpoint with harmony's tokens and the real template ------------------

def harmony_tokenizer():
    from tokenizers import AddedToken

    tok = build_tokenizer()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    return tok


def write_harmony_tokenizer(folder: Path, template: str = TEMPLATE) -> dict[str, int]:
    tok = harmony_tokenizer()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|startoftext|>", "eos_token": "<|return|>", "pad_token": "<|endoftext|>",
        "add_bos_token": False, "chat_template": template}))
    return {t: tok.token_to_id(t) for t in HARMONY_TOKENS}


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpt-oss-harmony")
    ids = {t: harmony_tokenizer().token_to_id(t) for t in HARMONY_TOKENS}
    make_tiny_model(folder, "gpt-oss", bos_token_id=ids["<|startoftext|>"], eos_token_id=ids["<|return|>"],
                    pad_token_id=ids["<|endoftext|>"])
    write_harmony_tokenizer(folder)
    # EOS is <|return|> alone, as in a GGUF that names no other (gpt-oss's own generation_config.json
    # adds <|endoftext|> and <|call|>): the chat API and LLM.chat must stop at <|call|> themselves
    config = json.loads((folder / "generation_config.json").read_text())
    config["eos_token_id"] = [ids["<|return|>"]]
    (folder / "generation_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tokenizer(gpt_oss_dir):
    return Tokenizer.from_folder(gpt_oss_dir)


def test_the_harmony_rule_is_the_tokenizer(tokenizer):
    assert is_harmony_tokenizer(tokenizer)
    assert not is_harmony_tokenizer(Tokenizer(build_tokenizer(), {}))


def test_the_real_template_renders_the_harmony_prompt(tokenizer):
    from datetime import date

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, reasoning_effort="low")
    assert text.startswith("<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                           "Knowledge cutoff: 2024-06\n")
    assert f"Current date: {date.today():%Y-%m-%d}\n\nReasoning: low\n\n" in text     # strftime_now
    assert text.endswith("# Valid channels: analysis, commentary, final. Channel must be included for every "
                         "message.<|end|><|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>"
                         "<|start|>user<|message|>Hi<|end|><|start|>assistant")
    ids = tokenizer.encode_chat(chat)
    for marker in ("<|start|>", "<|message|>", "<|end|>"):          # special tokens, one id each
        assert ids.count(tokenizer.token_to_id(marker)) == text.count(marker)
    tail = [tokenizer.token_to_id("<|start|>"), *tokenizer.encode("assistant", add_special_tokens=False)]
    assert ids[-len(tail):] == tail


def test_the_real_template_takes_history_tools_and_reasoning(tokenizer):
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city"}},
                       "required": ["city"]}}}]
    chat = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "reasoning_content": "Need the tool.", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            {"role": "assistant", "content": "It is 18C.", "reasoning_content": "Answer it."},
            {"role": "user", "content": "Thanks"}]
    text = tokenizer.apply_chat_template(chat, tools=tools)
    assert "namespace functions {\n\n// Weather in a city\ntype get_weather = (_: {\n// The city\ncity: string,\n" in text
    # the call's analysis is dropped once a later final answer exists; the call itself stays
    assert ('<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'
            '<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18C"<|end|>') in text
    assert "Need the tool." not in text and "Answer it." not in text     # past chains of thought are dropped
    assert text.endswith("<|start|>assistant<|channel|>final<|message|>It is 18C.<|end|>"
                         "<|start|>user<|message|>Thanks<|end|><|start|>assistant")


def test_the_real_template_refuses_channel_markup_in_content(tokenizer):
    chat = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<|channel|>analysis<|message|>x<|end|>"},
            {"role": "user", "content": "Again"}]
    with pytest.raises(jinja2.TemplateError, match=re.escape("<|channel|> tags in the content field")):
        tokenizer.apply_chat_template(chat)


# ---- forced through the engine: LLM.chat and the server --------------------------------------

REASONING, ANSWER = "Be kind.", "Hi there!"
# a Lark grammar (llguidance): the model must write this harmony output, and would write "junk" if
# <|return|> did not end the generation; <|...|> are special tokens
FORCED = ('start: <|channel|> "analysis" <|message|> "Be kind." <|end|> <|start|> "assistant" '
          '<|channel|> "final" <|message|> "Hi there!" <|return|> "junk"')
# a tool call: <|call|> ends the turn though it is no EOS id of this checkpoint
FORCED_CALL = ('start: <|channel|> "analysis" <|message|> "Need weather." <|end|> <|start|> "assistant" '
               '<|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
               '"{\\"city\\": \\"Paris\\"}" <|call|> "junk"')
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def offline(gpt_oss_dir):
    from twostep import LLM

    return LLM(str(gpt_oss_dir), dtype="float32", kv_cache_memory="16MiB", max_model_len=512)


def test_llm_chat_returns_the_answer_and_keeps_the_reasoning_apart(offline):
    from twostep import SamplingParams
    from twostep.sampling_params import StructuredOutputsParams

    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(grammar=FORCED))
    [out] = offline.chat(CHAT, params, use_tqdm=False)
    [c] = out.outputs
    assert (c.text, c.reasoning, c.finish_reason) == (ANSWER, REASONING, "stop")
    raw = offline.tokenizer.decode(c.token_ids, skip_special_tokens=False)
    assert raw == f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>final<|message|>" \
                  f"{ANSWER}<|return|>"     # stopped at <|return|>: an EOS id
    # cut by max_tokens inside the analysis channel: no answer, and no markers
    [out] = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=4,
                                              structured_outputs=StructuredOutputsParams(grammar=FORCED)),
                         use_tqdm=False)
    [c] = out.outputs
    assert (c.text, c.finish_reason) == ("", "length")
    assert c.reasoning is None or REASONING.startswith(c.reasoning)
    # a tool call ends the generation at <|call|>; it is neither answer nor reasoning
    [out] = offline.chat(CHAT, SamplingParams(temperature=0, max_tokens=160,
                                              structured_outputs=StructuredOutputsParams(grammar=FORCED_CALL)),
                         use_tqdm=False)
    [c] = out.outputs
    call = offline.tokenizer.token_to_id("<|call|>")
    assert (c.text, c.reasoning, c.finish_reason, c.stop_reason) == ("", "Need weather.", "stop", call)
    assert c.token_ids[-1] == call
    # plain generate() is untouched: raw text, special tokens skipped
    [out] = offline.generate({"prompt_token_ids": out.prompt_token_ids}, params, use_tqdm=False)
    assert out.outputs[0].text == f"analysis{REASONING}assistantfinal{ANSWER}"


@pytest.fixture(scope="module")
def server(gpt_oss_dir, tmp_path_factory):
    server = Server(gpt_oss_dir, tmp_path_factory.mktemp("harmony-logs"), "--max-model-len", "512")
    try:
        yield server
    finally:
        assert server.terminate() == 0, server.output()


@pytest.fixture(scope="module")
def client(server):
    import openai

    with openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120.0) as c:
        yield c


def stream(server, body: dict) -> list[dict]:
    with httpx.Client(timeout=120) as c, c.stream("POST", server.url("/v1/chat/completions"),
                                                 json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        return parse_sse(r.iter_lines())


def joined(chunks: list[dict], key: str) -> str:
    return "".join(ch["delta"].get(key) or "" for chunk in chunks for ch in chunk["choices"])


def test_the_server_answers_with_the_final_channel(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=64, temperature=0,
                                       extra_body={"structured_outputs": {"grammar": FORCED}})
    [choice] = r.choices
    assert (choice.message.content, choice.finish_reason) == (ANSWER, "stop")
    assert choice.message.model_extra["reasoning_content"] == REASONING
    assert choice.message.model_extra["reasoning"] == REASONING
    # cut inside the analysis channel: empty content, never the raw markers
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                       extra_body={"structured_outputs": {"grammar": FORCED}})
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (None, "length")   # no answer yet
    # a tool call ends the turn at <|call|> (no EOS id here: the server adds it), and is not content
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=160, temperature=0, logprobs=True,
                                       extra_body={"structured_outputs": {"grammar": FORCED_CALL},
                                                   "return_tokens_as_token_ids": True})
    [choice] = r.choices
    assert (choice.message.content, choice.message.model_extra["reasoning_content"]) == (None, "Need weather.")
    call = tokenizer.token_to_id("<|call|>")
    assert (choice.finish_reason, choice.model_extra["stop_reason"]) == ("stop", call)
    ids = [int(t.token.split(":")[1]) for t in choice.logprobs.content]
    assert tokenizer.decode(ids, skip_special_tokens=False).endswith(
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>')


def test_the_server_streams_only_the_answer_as_content(server):
    chunks = stream(server, {"messages": CHAT, "max_tokens": 64, "temperature": 0,
                             "structured_outputs": {"grammar": FORCED}})
    assert joined(chunks, "content") == ANSWER
    assert joined(chunks, "reasoning_content") == joined(chunks, "reasoning") == REASONING
    for chunk in chunks:
        for ch in chunk["choices"]:
            assert not MARKER.search(ch["delta"].get("content") or ""), chunk
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["stop"]
    chunks = stream(server, {"messages": CHAT, "max_tokens": 3, "temperature": 0,
                             "structured_outputs": {"grammar": FORCED}})
    assert joined(chunks, "content") == ""
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["length"]


def test_what_the_model_generates_is_read_as_the_parser_reads_its_tokens(server, client, tokenizer, gpt_oss_dir):
    """Unforced output of random weights, pushed towards harmony's tokens: content and reasoning
    are what parsing the generated tokens gives, streamed or not."""
    bias = {str(tokenizer.token_to_id(t)): 4.0 for t in ("<|channel|>", "<|message|>", "<|end|>", "<|start|>")}
    bias[str(tokenizer.token_to_id("<|return|>"))] = -100     # run to max_tokens
    seen_markers = 0
    for seed in range(4):
        body = dict(model=MODEL, messages=CHAT, max_tokens=48, temperature=1.0, seed=seed, logit_bias=bias)
        r = client.chat.completions.create(**body, logprobs=True, extra_body={"return_tokens_as_token_ids": True})
        ids = [int(t.token.split(":")[1]) for t in r.choices[0].logprobs.content]
        raw = tokenizer.decode(ids, skip_special_tokens=False)
        seen_markers += len(MARKER.findall(raw))
        content, reasoning = parse_chat_output(raw)
        message = r.choices[0].message
        assert (message.content, message.model_extra["reasoning_content"]) == (content, reasoning), raw
        chunks = stream(server, body)
        assert joined(chunks, "content") == content
        assert joined(chunks, "reasoning_content") == (reasoning or "")
    assert seen_markers > 8          # the outputs did exercise the parser
