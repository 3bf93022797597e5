"""--tool-call-parser qwen3_coder through the real server with the openai SDK: a tiny model forced (by a
structured-outputs regex) to write Qwen3-Coder's XML tool calls, read back as OpenAI tool calls with
their raw values typed by the request's tools, streamed and not.

Qwen3-Coder's tokenizer has <tool_call> and </tool_call> as added tokens that are not special
(<function=...> and <parameter=...> are plain text), so the parser reads the output detokenized as
usual, special tokens skipped. The tiny tokenizer writes the markers as several plain tokens: a
structured-outputs grammar cannot force text through an added token (llguidance takes every added
token for a special one), and several tokens per marker also split the markers across deltas."""
from __future__ import annotations

import json
import re

import pytest

from conftest import MODEL, make_tiny_model, serving

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                    "metric": {"type": "boolean"}},
                   "required": ["city", "days", "metric"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a zone", "strict": True,
    "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"],
                   "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "Weather in Paris, and the time there?"}]
# What the model must write (Rust regex syntax; the newlines are literal): some content, then two
# calls whose values the random model picks within the pattern. "3" as a city stays a string.
FORCED = ("Checking[.]\n<tool_call>\n<function=get_weather>\n<parameter=city>\n([A-Z][a-z]{2,5}|3)\n</parameter>\n"
          "<parameter=days>\n([1-9])\n</parameter>\n<parameter=metric>\n(true|false)\n</parameter>\n</function>\n"
          "</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=zone>\n([A-Z]{3})\n</parameter>\n"
          "</function>\n</tool_call>")


# A template that reads the tools (briefly, as Qwen3-Coder's names them in its system prompt), so that
# the server sends them to it rather than adding its generic tools prompt.
TEMPLATE = ("{% if tools %}<s>system: you may call {% for t in tools %}<function={{ t.function.name }}> {% endfor %}\n"
            "{% endif %}{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = make_tiny_model(tmp_path_factory.mktemp("qwen3-coder"), "qwen3")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return folder


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from serving(model_dir, tmp_path_factory.mktemp("qwen3-coder-logs"), "--max-model-len", "512",
                       "--enable-auto-tool-choice", "--tool-call-parser", "qwen3_coder")


@pytest.fixture(scope="module")
def client(server):
    import openai

    with openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120.0) as c:
        yield c


def request(**extra) -> dict:
    return {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 400,
            "extra_body": {"structured_outputs": {"regex": FORCED}}, **extra}


@pytest.fixture(scope="module")
def expected(client):
    """The calls in the model's raw output: tool_choice "none" gives the same output (same prompt, greedy)
    as plain content."""
    r = client.chat.completions.create(**request(tool_choice="none"))
    text = r.choices[0].message.content
    city, days, metric, zone = re.fullmatch(FORCED, text).groups()
    assert "<tool_call>" in text and not r.choices[0].message.tool_calls
    return [("get_weather", json.dumps({"city": city, "days": int(days), "metric": metric == "true"})),
            ("get_time", json.dumps({"zone": zone}))]


def test_the_calls_come_back_with_typed_arguments(client, expected):
    r = client.chat.completions.create(**request())
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert [(c.function.name, c.function.arguments) for c in calls] == expected
    assert all(c.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in calls)
    assert len({c.id for c in calls}) == 2
    weather = json.loads(calls[0].function.arguments)
    assert isinstance(weather["city"], str) and isinstance(weather["days"], int)
    assert isinstance(weather["metric"], bool)


def test_parallel_tool_calls_false_keeps_the_first(client, expected):
    r = client.chat.completions.create(**request(parallel_tool_calls=False))
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == expected[:1]


def test_the_stream_accumulates_to_the_same_calls(client, expected):
    with client.chat.completions.stream(**request()) as stream:
        fragments = 0
        for event in stream:
            if event.type == "content.delta":
                assert "<" not in event.delta, event.delta       # no markup ever reaches the content
            elif event.type == "tool_calls.function.arguments.delta":
                fragments += 1
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == expected
    # the SDK parsed each call's arguments (strict tools) as the JSON they are
    assert [c.function.parsed_arguments for c in choice.message.tool_calls] == [json.loads(a) for _, a in expected]
    # each call's arguments arrived as they grew, not in the announcement (test_tool_parsers checks
    # that they grow a parameter at a time)
    assert fragments >= 2
