"""Reasoning parsers (--reasoning-parser): the chain of thought split from the answer, as parsers
(any chunking of a stream gives the split of the whole text), through the real server with the openai
SDK and LangChain (message.reasoning and reasoning_content, streamed deltas, usage's reasoning tokens,
enable_thinking false, a constraint that starts at the answer) and through LLM.chat.

A tiny random model cannot think, so its output is forced with a regex (the server runs with
--structured-outputs-in-reasoning: the grammar covers the thinking too), or pushed to close its
thinking at once with a logit bias on ``</think>``."""
from __future__ import annotations

import json
import random
import re
from pathlib import Path

import httpx
import jsonschema
import pytest
from tokenizers import AddedToken, Tokenizer as HFTokenizer

from conftest import MODEL, VOCAB, make_tiny_model, serving
from twostep.entrypoints.reasoning import (REASONING_PARSERS, count_reasoning_tokens, get_reasoning_parser,
                                           prompt_opens_thinking, thinking_disabled)
from twostep.sampling_params import SamplingParams, StructuredOutputsParams

# A Qwen3-like template: earlier reasoning goes back into the prompt, enable_thinking false writes an
# empty thinking block after the generation prompt.
QWEN3_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: "
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% endif %}{% endif %}")
# DeepSeek-R1's distills open the thinking block in the prompt.
R1_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
               "{% if add_generation_prompt %}assistant:<think>\n{% endif %}")
FORCED = r"<think>[a-z]{3,6}( [a-z]{3,6}){1,3}</think>\n\n[a-z]{3,6}( [a-z]{3,6}){1,2}"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


# ---- the parsers ------------------------------------------------------------------------------

OUTPUTS = [
    "<think>\nthe user asks about France\n</think>\n\nParis is the capital.",
    "<think>abc</think>answer",
    "  <think> spaced </think>  tail  ",
    "no thinking at all",
    "<think>never closed",
    "<thi",
    "<think></think>",
    "a < b and c </ d </think> after",
    "",
]


def _chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1", "think"])
@pytest.mark.parametrize("opened", [False, True])
def test_any_chunking_streams_the_split_of_the_whole_text(name, opened):
    rng = random.Random(0)
    for text in OUTPUTS:
        whole = get_reasoning_parser(name, opened).split(text, final=True)
        for _ in range(20):
            stream = get_reasoning_parser(name, opened).stream()
            pieces = _chunks(text, rng) or [""]
            deltas = [stream.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
            assert "".join(d.reasoning for d in deltas) == whole.reasoning, (text, pieces)
            assert "".join(d.content for d in deltas) == whole.content, (text, pieces)


def test_split_rules():
    qwen3, r1 = get_reasoning_parser("qwen3"), get_reasoning_parser("deepseek_r1")
    split = qwen3.split(OUTPUTS[0], final=True)
    assert (split.reasoning, split.content) == ("the user asks about France", "Paris is the capital.")
    assert qwen3.split("no thinking at all", final=True).content == "no thinking at all"
    assert qwen3.split("no thinking at all", final=True).reasoning == ""
    # R1 starts in its thinking: everything up to </think> is reasoning, even without <think>
    split = r1.split("first I think</think>then answer", final=True)
    assert (split.reasoning, split.content) == ("first I think", "then answer")
    assert r1.split("cut off while thinking", final=True).content == ""
    # a prompt that opens the block makes qwen3 start inside it too
    split = get_reasoning_parser("qwen3", opened=True).split("thinking</think>answer", final=True)
    assert (split.reasoning, split.content) == ("thinking", "answer")
    # a marker split across pieces is held back, not sent as text
    stream = get_reasoning_parser("qwen3").stream()
    assert stream.feed("<think>abc</thi").reasoning == "abc"
    d = stream.feed("nk>xyz")
    assert (d.reasoning, d.content) == ("", "xyz")


def test_prompt_and_kwargs_rules():
    assert prompt_opens_thinking("assistant:<think>\n")
    assert not prompt_opens_thinking("assistant:<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("assistant:")
    assert thinking_disabled({"enable_thinking": False}) and thinking_disabled({"thinking": False})
    assert not thinking_disabled({"enable_thinking": True}) and not thinking_disabled(None)
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "think", "gpt_oss"}


def test_reasoning_tokens_end_with_the_closing_marker():
    pieces = ["<think>", "ab", "c", "</th", "ink>", "\n", "answer"]
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    text = "".join(pieces)
    parser = get_reasoning_parser("qwen3")
    assert count_reasoning_tokens(parser, text, list(range(len(pieces))), decode) == 5
    assert count_reasoning_tokens(parser, "answer", [6], decode) == 0
    assert count_reasoning_tokens(parser, "<think>abc", [0, 1, 2], decode) == 3


# ---- the deferred grammar -----------------------------------------------------------------------

def test_a_deferred_grammar_starts_after_the_marker(tiny_model_dir):
    from twostep.structured_output.compiler import GrammarCompiler
    from twostep.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(tiny_model_dir("llama"))
    compiler = GrammarCompiler(tok, VOCAB, {2})
    marker = tok.encode("</think>", add_special_tokens=False)
    plain = compiler.grammar(StructuredOutputsParams(regex="[0-9]+"))
    deferred = compiler.grammar(StructuredOutputsParams(regex="[0-9]+", starts_after="</think>"))
    letters = tok.encode("abc", add_special_tokens=False)
    assert (plain.bitmask() != -1).any()                        # digits only
    assert (deferred.bitmask() == -1).all()                     # free before the marker
    for t in letters:
        assert deferred.accept(t) and not deferred.is_terminated
    # a verification step whose drafts pass the marker: free rows up to it, the grammar's after
    rows = deferred.bitmask(marker)
    assert (rows[:len(marker)] == -1).all() and torch_equal(rows[len(marker)], plain.bitmask()[0])
    assert deferred.drafts_to_verify(marker + letters) == len(marker) + 1   # the first letter is refused
    for t in marker:
        deferred.accept(t)
    assert torch_equal(deferred.bitmask()[0], plain.bitmask()[0])
    assert deferred.accept(tok.encode("7", add_special_tokens=False)[0])


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


# ---- through the server ------------------------------------------------------------------------

def _with_think_tokens(folder: Path) -> dict[str, int]:
    """<think> and </think> as added tokens (not special), as Qwen3's tokenizer has them."""
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(folder / "tokenizer.json"))
    return {t: tok.token_to_id(t) for t in ("<think>", "</think>")}


def _set_template(folder: Path, template: str) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """The plain tiny BPE: the markers are several tokens each, so streams split them."""
    folder = make_tiny_model(tmp_path_factory.mktemp("reasoning-qwen3"), "qwen3", max_position_embeddings=1024)
    _set_template(folder, QWEN3_TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def r1_dir(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("reasoning-r1"), "qwen3", max_position_embeddings=1024)
    _set_template(folder, R1_TEMPLATE)
    (folder / "think_ids.json").write_text(json.dumps(_with_think_tokens(folder)))
    return folder


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("reasoning-logs")


def _serve(folder, log_dir, *extra):
    yield from serving(folder, log_dir, "--max-model-len", "1024", *extra)


@pytest.fixture(scope="module")
def qwen3_server(qwen3_dir, log_dir):
    yield from _serve(qwen3_dir, log_dir, "--reasoning-parser", "qwen3", "--structured-outputs-in-reasoning",
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def r1_server(r1_dir, log_dir):
    yield from _serve(r1_dir, log_dir, "--reasoning-parser", "deepseek_r1")


def _client(server):
    import openai

    return openai.OpenAI(base_url=server.url("/v1"), api_key="none")


def _forced(extra: dict | None = None, regex: str = FORCED) -> dict:
    return {"messages": ASK, "model": MODEL, "temperature": 0.0, "max_tokens": 60,
            "extra_body": {"structured_outputs": {"regex": regex}, **(extra or {})}}


def test_chat_returns_reasoning_and_answer_apart(qwen3_server):
    client = _client(qwen3_server)
    raw = client.completions.create(model=MODEL, prompt=_prompt_ids(qwen3_server, ASK), max_tokens=60,
                                    temperature=0.0, logprobs=0,
                                    extra_body={"structured_outputs": {"regex": FORCED},
                                                "return_tokens_as_token_ids": True})
    thinking, answer = re.fullmatch(r"<think>(.*)</think>\n\n(.*)", raw.choices[0].text, re.S).groups()
    r = client.chat.completions.create(**_forced())
    message = r.choices[0].message
    assert message.content == answer
    assert message.reasoning == message.reasoning_content == thinking
    # the reasoning tokens are those up to and including the closing marker
    n = r.usage.completion_tokens_details.reasoning_tokens
    assert 0 < n < r.usage.completion_tokens
    generated = [int(t.removeprefix("token_id:")) for t in raw.choices[0].logprobs.tokens]
    text_of = lambda ids: _post(qwen3_server, "/detokenize", {"tokens": ids})["prompt"]  # noqa: E731
    marker_end = len(f"<think>{thinking}</think>")
    assert len(text_of(generated[:n])) >= marker_end > len(text_of(generated[:n - 1]))


def _post(server, path: str, body: dict) -> dict:
    r = httpx.post(server.url(path), json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _prompt_ids(server, messages, **extra) -> list[int]:
    return _post(server, "/tokenize", {"messages": messages, **extra})["tokens"]


def test_streamed_deltas_split_the_same_way(qwen3_server):
    client = _client(qwen3_server)
    whole = client.chat.completions.create(**_forced()).choices[0].message
    chunks = list(client.chat.completions.create(**_forced(), stream=True,
                                                 stream_options={"include_usage": True}))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == (whole.reasoning, whole.content)
    # no marker text leaks, and every reasoning piece comes before the answer's first piece
    assert "think>" not in reasoning + content
    kinds = [("r" if getattr(d, "reasoning", None) else "") + ("c" if d.content else "") for d in deltas]
    kinds = [k for k in kinds if k]
    assert kinds == sorted(kinds, key=lambda k: k != "r")
    assert all(getattr(d, "reasoning_content", None) == getattr(d, "reasoning", None) for d in deltas)
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens > 0


def test_enable_thinking_false_turns_the_parser_off(qwen3_server):
    client = _client(qwen3_server)
    r = client.chat.completions.create(**_forced({"chat_template_kwargs": {"enable_thinking": False}},
                                                 regex="[a-z]{3,6}( [a-z]{3,6}){1,2}"))
    message = r.choices[0].message
    assert message.content and message.reasoning is None
    # the template closed the thinking block in the prompt
    closed = _prompt_ids(qwen3_server, ASK, chat_template_kwargs={"enable_thinking": False})
    assert len(closed) > len(_prompt_ids(qwen3_server, ASK))


def test_tool_calls_are_read_from_the_answer_only(qwen3_server):
    """A call inside the thinking is not a call; the one in the answer is."""
    client = _client(qwen3_server)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string"}}}}}
    regex = re.escape(f"<think>maybe {call}</think>\n\n") + "[a-z]{3,6}"
    r = client.chat.completions.create(**_forced(regex=regex), tools=[tool])
    assert r.choices[0].message.tool_calls is None and "tool_call" in r.choices[0].message.reasoning
    regex = re.escape("<think>call it</think>\n\n" + call)
    r = client.chat.completions.create(**{**_forced(regex=regex), "max_tokens": 150}, tools=[tool])
    calls = r.choices[0].message.tool_calls
    assert calls, (r.choices[0].message, r.choices[0].finish_reason)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_time", {"zone": "utc"})]
    assert r.choices[0].message.reasoning == "call it" and r.choices[0].finish_reason == "tool_calls"


def test_reasoning_in_input_messages_reaches_the_template(qwen3_server):
    for name in ("reasoning", "reasoning_content"):
        turn = [*ASK, {"role": "assistant", "content": "Paris.", name: "easy one"},
                {"role": "user", "content": "And Spain?"}]
        text = _post(qwen3_server, "/detokenize", {"tokens": _prompt_ids(qwen3_server, turn)})["prompt"]
        assert "<think>easy one</think>Paris." in text


def test_langchain_chat_openai_reads_the_answer(qwen3_server):
    """LangChain's ChatOpenAI against the server: the answer is the content, the chain of thought
    is kept out of it (and reaches additional_kwargs where langchain-openai keeps it)."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=qwen3_server.url("/v1"), api_key="none", model=MODEL, temperature=0.0,
                      max_tokens=60, extra_body={"structured_outputs": {"regex": FORCED}})
    whole = _client(qwen3_server).chat.completions.create(**_forced()).choices[0].message
    reply = chat.invoke("What is the capital of France?")
    assert reply.content == whole.content and "think>" not in reply.content
    streamed = "".join(chunk.content for chunk in chat.stream("What is the capital of France?"))
    assert streamed == whole.content


def test_a_constraint_applies_to_the_answer_after_the_thinking(r1_server, r1_dir):
    """deepseek_r1 (the template opens <think>): a JSON schema waits for </think>. A logit bias makes
    </think> the first token; the grammar starts after it and the answer is the schema's JSON."""
    close = json.loads((r1_dir / "think_ids.json").read_text())["</think>"]
    client = _client(r1_server)
    r = client.chat.completions.create(
        messages=ASK, model=MODEL, temperature=0.0, max_tokens=40, logit_bias={str(close): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    message = r.choices[0].message
    assert message.reasoning is None
    jsonschema.validate(json.loads(message.content), PERSON)
    assert r.usage.completion_tokens_details.reasoning_tokens == 1
    # the same request without the parser's deferral cannot write </think> at all: the grammar
    # holds from the first token (here: the thinking is off, so the parser is too)
    r = client.chat.completions.create(
        messages=ASK, model=MODEL, temperature=0.0, max_tokens=40, logit_bias={str(close): 100},
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.usage.completion_tokens_details is None


def test_r1_output_that_never_closes_is_all_reasoning(r1_server):
    r = _client(r1_server).chat.completions.create(
        **_forced(regex="[a-z]{3,6}( [a-z]{3,6}){3}"))
    message = r.choices[0].message
    assert message.content is None and message.reasoning
    assert r.usage.completion_tokens_details.reasoning_tokens == r.usage.completion_tokens


def test_llm_chat_returns_the_split(qwen3_dir):
    from twostep import LLM

    llm = LLM(str(qwen3_dir), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(regex=FORCED))
    plain = llm.chat(ASK, params, use_tqdm=False)[0].outputs[0]
    split = llm.chat(ASK, params, use_tqdm=False, reasoning_parser="qwen3",
                     structured_outputs_in_reasoning=True)[0].outputs[0]
    thinking, answer = re.fullmatch(r"<think>(.*)</think>\n\n(.*)", plain.text, re.S).groups()
    assert (split.reasoning, split.text) == (thinking, answer)
    assert split.token_ids == plain.token_ids
    # the constraint waits for the answer: the thinking is free (the regex below does not allow
    # "<think>"), the answer matches it
    params = SamplingParams(temperature=0.0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(regex="[a-z]{3,6}( [a-z]{3,6}){1,2}"))
    out = llm.chat(ASK, params, use_tqdm=False, reasoning_parser="qwen3")[0].outputs[0]
    assert not re.fullmatch("[a-z]{3,6}( [a-z]{3,6}){1,2}", out.text)   # the grammar never started
    # thinking off: no split, and the constraint holds from the first token
    out = llm.chat(ASK, params, use_tqdm=False, reasoning_parser="qwen3",
                   chat_template_kwargs={"enable_thinking": False})[0].outputs[0]
    assert re.fullmatch("[a-z]{3,6}( [a-z]{3,6}){1,2}", out.text) and out.reasoning is None
    llm.shutdown()


def test_unknown_parser_fails_at_start(qwen3_dir, tmp_path):
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run([sys.executable, "-m", "twostep.cli", "serve", "--model", str(qwen3_dir),
                        "--reasoning-parser", "nope"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "reasoning-parser" in r.stderr


def test_a_grammar_forces_plain_added_tokens(r1_dir):
    """<think> and </think> are added tokens that are text (special=False, as Qwen's tokenizers have
    them): a grammar literal matches them, so a regex can force a thinking block (llguidance alone
    reads every added token as a control token no literal matches)."""
    from twostep import LLM

    ids = json.loads((r1_dir / "think_ids.json").read_text())
    llm = LLM(str(r1_dir), dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
    params = SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(regex=FORCED))
    out = llm.generate(["Once upon a time"], params, use_tqdm=False)[0].outputs[0]
    llm.shutdown()
    assert out.finish_reason == "stop" and re.fullmatch(FORCED, out.text)
    assert ids["<think>"] in out.token_ids and ids["</think>"] in out.token_ids   # as the tokens, whole
