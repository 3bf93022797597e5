"""Structured outputs, the mask family and tool calling through the real server on the default
model (SmolLM2-135M-Instruct GGUF), with the official openai client and httpx."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from conftest import Server, parse_sse, smollm_path

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def _serve(log_dir, *extra):
    server = Server(smollm_path(), log_dir, "--kv-cache-memory", "256MiB", "--max-model-len", "2048", *extra)
    try:
        yield server
    finally:
        assert server.terminate() == 0, server.output()


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("structured-logs")


@pytest.fixture(scope="module")
def server(log_dir):
    yield from _serve(log_dir, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@pytest.fixture(scope="module")
def plain_server(log_dir):
    yield from _serve(log_dir)


@pytest.fixture(scope="module")
def client(server):
    import openai

    with openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120.0) as c:
        yield c


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": "tiny", **body}, timeout=120.0)


def _stream(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.url("/v1/chat/completions"), json={"model": "tiny", "stream": True, **body},
                      timeout=120.0) as r:
        assert r.status_code == 200, r.read()
        return parse_sse(r.iter_lines())


# ---- structured outputs --------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema(client, temperature):
    r = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Give a person as JSON."}], temperature=temperature,
        seed=4, max_tokens=80, n=1 if temperature == 0 else 3,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_response_format_json_object(client):
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}],
                                       temperature=0, max_tokens=200, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("extra,check", [
    ({"structured_outputs": {"choice": ["red", "green", "blue"]}}, lambda t: t in ("red", "green", "blue")),
    ({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ({"guided_regex": "[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch("[0-9]{3}-[0-9]{4}", t)),
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_grammar": 'start: "A" | "B" "C"'}, lambda t: t in ("A", "BC")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
     lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
])
def test_completions_take_every_constraint_name(client, extra, check):
    r = client.completions.create(model="tiny", prompt="Answer:", max_tokens=60, temperature=0.8, seed=1, n=2,
                                  extra_body=extra)
    for c in r.choices:
        assert c.finish_reason == "stop" and check(c.text), c.text


def test_streamed_json_schema_concatenates_to_valid_json(server):
    chunks = _stream(server, {"messages": [{"role": "user", "content": "A person."}], "max_tokens": 80,
                              "temperature": 0, "response_format": {
                                  "type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    jsonschema.validate(json.loads(text), PERSON)


# ---- the mask family -------------------------------------------------------------------------

def _token_id(server, text: str) -> int:
    ids = _post(server, "/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def test_logit_bias_bans_and_forces_tokens(client, server):
    prompt = "The capital of France is"
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    assert "Paris" in plain
    paris = _token_id(server, " Paris")
    banned = client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                       logit_bias={str(paris): -100}).choices[0].text
    assert "Paris" not in banned
    forced = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0.9, seed=3,
                                       logit_bias={str(paris): 100}).choices[0].text
    assert forced == " Paris" * 3


def test_allowed_token_ids_and_bad_words(client, server):
    ids = [_token_id(server, w) for w in (" yes", " no")]
    r = client.completions.create(model="tiny", prompt="Say something:", max_tokens=6, temperature=1.0, seed=2,
                                  extra_body={"allowed_token_ids": ids})
    assert set(r.choices[0].text.split()) <= {"yes", "no"}
    r = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=12, temperature=0,
                                  extra_body={"bad_words": ["Paris"]})
    assert "Paris" not in r.choices[0].text


# ---- tools -----------------------------------------------------------------------------------

def _valid_call(call, tools=TOOLS) -> dict:
    spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, spec["parameters"])
    assert call.id.startswith("call_") and call.type == "function"
    return args


@pytest.mark.parametrize("parallel", [True, False])
def test_tool_choice_required_gives_valid_calls(client, parallel):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=parallel, temperature=0.7, seed=5, max_tokens=150, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        calls = choice.message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        for call in calls:
            _valid_call(call)


def test_named_function_gives_its_arguments(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.content   # a forced function: "stop"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _valid_call(call)


@pytest.mark.parametrize("strict", [False, True])
def test_strict_closes_open_schemas(client, strict):
    open_tool = {"type": "function", "function": {"name": "get_weather", "strict": strict, "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
    keys = set()
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=[open_tool], temperature=1.0, seed=seed,
                                           max_tokens=120, tool_choice={"type": "function",
                                                                        "function": {"name": "get_weather"}})
        if r.choices[0].finish_reason == "stop":
            keys |= set(json.loads(r.choices[0].message.tool_calls[0].function.arguments))
    if strict:
        assert keys == {"city"}
    else:
        assert "city" in keys     # open: extra keys are allowed (this model adds some)


def test_auto_with_hermes_reads_a_tool_call_block(client):
    # The model's output is forced to a <tool_call> block (a choice constraint): the parser must read it.
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="auto", temperature=0,
                                       max_tokens=60, extra_body={"structured_outputs": {"choice": [CALL_TEXT]}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and _valid_call(call) == {"city": "Paris", "unit": "celsius"}


def test_auto_without_a_call_is_content(client):
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=20,
                                       extra_body={"structured_outputs": {"choice": ["It is sunny."]}})
    assert r.choices[0].message.content == "It is sunny." and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("choice,extra", [("auto", {"structured_outputs": {"choice": ["Let me check. " + CALL_TEXT]}}),
                                          ("required", {}),
                                          ({"type": "function", "function": {"name": "get_time"}}, {})])
def test_streamed_tool_calls_follow_openai_deltas(server, choice, extra):
    chunks = _stream(server, {"messages": ASK, "tools": TOOLS, "tool_choice": choice, "temperature": 0,
                              "max_tokens": 120, **extra})
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for c in chunk["choices"]:
            delta = c["delta"]
            content += delta.get("content") or ""
            for tc in delta.get("tool_calls", []):
                if tc["index"] not in calls:           # the first delta of a call: id, type and name
                    assert tc["id"].startswith("call_") and tc["type"] == "function" and tc["function"]["name"]
                    calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
                else:
                    assert "id" not in tc and tc["function"]["arguments"]
                calls[tc["index"]]["arguments"] += tc["function"].get("arguments", "")
            finish = c["finish_reason"] or finish
    assert calls and finish == ("stop" if isinstance(choice, dict) else "tool_calls")   # a forced function: stop
    assert "<tool_call>" not in content and "</tool_call>" not in content
    if choice == "auto":
        assert content == "Let me check."
    for call in calls.values():
        spec = next(t["function"] for t in TOOLS if t["function"]["name"] == call["name"])
        jsonschema.validate(json.loads(call["arguments"]), spec["parameters"])


def test_a_tool_result_goes_back_through_the_template(client):
    first = client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=80,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "clear"})}]
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=30,
                                       extra_body={"structured_outputs": {"regex": "It is [0-9]+ degrees\\."}})
    assert re.fullmatch("It is [0-9]+ degrees\\.", r.choices[0].message.content)
    tokens = _post_tokens(client, messages)
    assert tokens > _post_tokens(client, ASK) + 20     # the call and the result are in the prompt


def _post_tokens(client, messages) -> int:
    r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, temperature=0, max_tokens=1,
                                       tool_choice="none")
    return r.usage.prompt_tokens


# ---- bad input: clear 400s -----------------------------------------------------------------------

@pytest.mark.parametrize("body,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
     "strin"),
    ({"structured_outputs": {"regex": "(?<=a)b"}}, "look-around"),
    ({"guided_grammar": "start: undefined_rule"}, "undefined_rule"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "one structured-output constraint"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "outside the vocabulary"),
    ({"allowed_token_ids": [99999999]}, "outside the vocabulary"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "name"),
])
def test_bad_constraints_are_400s(server, body, needle):
    r = _post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 5, **body})
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"], r.json()


def test_auto_tools_without_a_parser_are_a_400(plain_server):
    for choice in (None, "auto"):
        body = {"messages": ASK, "tools": TOOLS, "max_tokens": 5, **({"tool_choice": choice} if choice else {})}
        r = _post(plain_server, "/v1/chat/completions", body)
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"], r.text
    # required / named / none need no parser
    r = _post(plain_server, "/v1/chat/completions", {"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                                     "max_tokens": 120, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["tool_calls"]


def test_the_server_still_serves_after_bad_constraints(client, server):
    _post(server, "/v1/chat/completions", {"messages": ASK, "structured_outputs": {"regex": "(?=x)"}})
    r = client.chat.completions.create(model="tiny", messages=ASK, temperature=0, max_tokens=5)
    assert r.choices[0].message.content


def test_required_keeps_each_tools_definitions(client):
    # pydantic writes nested models as $defs + $ref (LangChain's bind_tools does): they must still
    # resolve once the tool's schema sits inside the array of calls.
    point = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9},
                                              "y": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["x", "y"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "move", "parameters": {
        "$defs": {"Point": point}, "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}},
        "required": ["to"], "additionalProperties": False}}},
             {"type": "function", "function": {"name": "draw", "parameters": {
                 "definitions": {"Point": point}, "type": "object",
                 "properties": {"at": {"$ref": "#/definitions/Point"}}, "required": ["at"],
                 "additionalProperties": False}}}]
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Move to 3, 4."}],
                                       tools=tools, tool_choice="required", parallel_tool_calls=False,
                                       temperature=0, max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0].message
    for call in r.choices[0].message.tool_calls:
        spec = next(t["function"] for t in tools if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), spec["parameters"])
