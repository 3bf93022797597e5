"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) through the real
server with the official openai SDK: text and item inputs, instructions, text.format json_schema,
function tools round trips (previous_response_id and explicit items), streaming (the SDK's
accumulated response equals the one answered whole; the events' order), the store (GET, DELETE,
its bound), reasoning items, and bad input as 400s in OpenAI's shape.

Each request is checked against what the chat API answers for the same conversation (the prompt's
token count and the greedy text), since the Responses API is the chat core with other names.
"""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from conftest import MODEL, make_tiny_model, serving

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city", "strict": True,
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "minLength": 1, "maxLength": 8},
               "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
               "additionalProperties": False}}
TIME = {"type": "function", "name": "get_time", "description": "The local time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                       "required": ["zone"], "additionalProperties": False}}
TOOLS = [WEATHER, TIME]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}
STORE_BOUND = 4
# A Qwen3-like template: earlier reasoning back in the prompt, and the reasoning effort where given
THINK_TEMPLATE = (
    "{% if reasoning_effort is defined %}<s>system: effort {{ reasoning_effort }}\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}: "
    "{% if m['role'] == 'assistant' and m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}</think>"
    "{% endif %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
THINK_FORCED = r"<think>[a-z]{3,6}( [a-z]{3,6}){1,3}</think>\n\n[a-z]{3,6}( [a-z]{3,6}){1,2}"


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("responses-logs")


def _serve(folder, log_dir, *extra):
    yield from serving(folder, log_dir, "--max-model-len", "2048", "--enable-auto-tool-choice",
                       "--tool-call-parser", "hermes", *extra)


@pytest.fixture(scope="module")
def server(tmp_path_factory, log_dir):
    # a 2k context: the tools' preamble alone is some 800 tokens of this tiny tokenizer
    folder = make_tiny_model(tmp_path_factory.mktemp("responses-qwen2"), "qwen2", max_position_embeddings=2048)
    yield from _serve(folder, log_dir, "--max-stored-responses", str(STORE_BOUND))


@pytest.fixture(scope="module")
def client(server):
    import openai

    with openai.OpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0, timeout=120.0) as c:
        yield c


def _chat(client, messages: list[dict], **kw):
    """The chat API's answer for the same conversation, greedy."""
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


def _shape(output) -> list[dict]:
    """Output items without their ids (fresh in every response, as the calls' ids)."""
    return [{k: v for k, v in item.model_dump(exclude_none=True).items() if k not in ("id", "call_id")}
            for item in output]


def _counts(usage) -> dict:
    """Usage but the cached tokens (a repeated prompt hits the prefix cache)."""
    return {**usage.model_dump(), "input_tokens_details": None}


def _assert_matches_chat(response, chat) -> None:
    """A response equals the chat completion of the same conversation: text, calls, status, usage."""
    choice = chat.choices[0]
    assert response.output_text == (choice.message.content or "")
    calls = [(c.call_id, c.name, c.arguments) for c in response.output if c.type == "function_call"]
    assert calls == [(t.id, t.function.name, t.function.arguments) for t in choice.message.tool_calls or []]
    cut = choice.finish_reason == "length"
    assert response.status == ("incomplete" if cut else "completed")
    assert (response.incomplete_details.reason if cut else response.incomplete_details) == \
        ("max_output_tokens" if cut else None)
    assert response.output[-1].status == ("incomplete" if cut else "completed")
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0


# ---- inputs ------------------------------------------------------------------------------------

def test_text_input_is_a_user_message(client):
    r = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=12,
                                temperature=0, metadata={"case": "text"}, user="u1")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    (part,) = message.content
    assert part.type == "output_text" and part.annotations == [] and part.text == r.output_text
    _assert_matches_chat(r, _chat(client, [{"role": "user", "content": "What is the capital of France?"}],
                                  max_tokens=12))
    # the request's settings come back
    assert (r.max_output_tokens, r.temperature, r.metadata, r.user, r.store) == (12, 0, {"case": "text"}, "u1", True)
    assert r.tools == [] and r.tool_choice == "auto" and r.text.format.type == "text" and r.error is None


def test_items_and_instructions_are_the_chat_messages(client):
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello "},
                                                             {"type": "input_text", "text": "there"}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hi!"}]},
             {"role": "user", "content": "Capital of France?"}]
    r = client.responses.create(model=MODEL, input=items, instructions="Be brief.", max_output_tokens=10,
                                temperature=0)
    assert r.instructions == "Be brief."
    _assert_matches_chat(r, _chat(client, [{"role": "system", "content": "Be brief."},
                                           {"role": "system", "content": "Answer in French."},
                                           {"role": "user", "content": "Hello there"},
                                           {"role": "assistant", "content": "Hi!"},
                                           {"role": "user", "content": "Capital of France?"}], max_tokens=10))


def test_json_schema_output_validates(client):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    r = client.responses.create(model=MODEL, input="Alice is 30.", text={"format": fmt}, max_output_tokens=80,
                                temperature=0)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"
    # the SDK's parse() builds the format from a pydantic model and parses the output with it
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=99)

    parsed = client.responses.parse(model=MODEL, input="Alice is 30.", text_format=Person, max_output_tokens=80,
                                    temperature=0)
    assert isinstance(parsed.output_parsed, Person)
    r = client.responses.create(model=MODEL, input="Reply in JSON.", text={"format": {"type": "json_object"}},
                                max_output_tokens=80, temperature=0)
    assert r.status == "completed" and isinstance(json.loads(r.output_text), dict)


# ---- function tools ---------------------------------------------------------------------------------

def _call_items(response) -> list:
    calls = [item for item in response.output if item.type == "function_call"]
    for call in calls:
        spec = next(t for t in TOOLS if t["name"] == call.name)
        jsonschema.validate(json.loads(call.arguments), spec["parameters"])
        assert call.id.startswith("fc_") and call.call_id and call.status == "completed"
    return calls


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_time"}])
def test_forced_tool_calls_are_function_call_items(client, choice):
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, tool_choice=choice,
                                max_output_tokens=120, temperature=0, parallel_tool_calls=choice == "required")
    calls = _call_items(r)
    assert calls and r.status == "completed" and r.output_text == ""
    if isinstance(choice, dict):
        assert [c.name for c in calls] == ["get_time"] and r.tool_choice.name == "get_time"
    assert [t.name for t in r.tools] == ["get_weather", "get_time"] and r.tools[0].strict is True


def test_a_tool_result_continues_by_id_and_by_items_alike(client):
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=TOOLS, max_output_tokens=120,
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    (call,) = _call_items(first)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": json.dumps({"celsius": 18})}
    by_id = client.responses.create(model=MODEL, previous_response_id=first.id, input=[result], tools=TOOLS,
                                    tool_choice="none", max_output_tokens=8, temperature=0)
    # the same conversation sent whole: the earlier output items go back as input items
    by_items = client.responses.create(model=MODEL, input=[{"role": "user", "content": "Weather in Paris?"},
                                                           *first.output, result],
                                       tools=TOOLS, tool_choice="none", max_output_tokens=8, temperature=0)
    chat = _chat(client, [{"role": "user", "content": "Weather in Paris?"},
                          {"role": "assistant", "content": None, "tool_calls": [{
                              "id": call.call_id, "type": "function",
                              "function": {"name": call.name, "arguments": call.arguments}}]},
                          {"role": "tool", "tool_call_id": call.call_id, "content": result["output"]}],
                 tools=[{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS],
                 tool_choice="none", max_tokens=8)
    for r in (by_id, by_items):
        _assert_matches_chat(r, chat)
    assert by_id.previous_response_id == first.id and by_items.previous_response_id is None
    # the call and its result are in the prompt
    assert by_id.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


# ---- streaming ---------------------------------------------------------------------------------------

STREAMED = [dict(input="Tell me a story.", max_output_tokens=30,
                 extra_body={"structured_outputs": {"regex": "[a-z]{3,6}( [a-z]{3,6}){1,3}\\."}}),
            dict(input="Tell me a story.", max_output_tokens=6),
            dict(input="Weather in Paris?", tools=TOOLS, tool_choice="required", max_output_tokens=120),
            dict(input="Alice is 30.", max_output_tokens=80,
                 text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}})]


@pytest.mark.parametrize("request_", STREAMED, ids=["text", "cut", "tools", "json_schema"])
def test_the_sdks_streamed_response_equals_the_whole_one(client, request_):
    whole = client.responses.create(model=MODEL, temperature=0, **request_)
    with client.responses.stream(model=MODEL, temperature=0, **request_) as stream:
        events = list(stream)
        # the SDK gives a final response for response.completed only; a cut one is the last event's
        final = stream.get_final_response() if whole.status == "completed" else events[-1].response
    assert whole.status == ("incomplete" if request_["max_output_tokens"] == 6 else "completed")
    assert _shape(final.output) == _shape(whole.output) and final.output_text == whole.output_text
    assert (final.status, _counts(final.usage), final.incomplete_details) == \
        (whole.status, _counts(whole.usage), whole.incomplete_details)
    assert events[-1].type == f"response.{whole.status}" and events[-1].response.id == final.id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert text == whole.output_text
    assert arguments == "".join(i.arguments for i in whole.output if i.type == "function_call")


ITEM_EVENTS = {      # "+": one or more
    "message": ["response.output_item.added", "response.content_part.added", "response.output_text.delta+",
                "response.output_text.done", "response.content_part.done", "response.output_item.done"],
    "function_call": ["response.output_item.added", "response.function_call_arguments.delta+",
                      "response.function_call_arguments.done", "response.output_item.done"],
    "reasoning": ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta+",
                  "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"],
}


def _assert_event_order(events: list[dict], kinds: list[str]) -> None:
    """The events in OpenAI's order, one output item after another, with rising sequence numbers
    and each item's events naming its index and id."""
    expected = ["response.created", "response.in_progress", *(t for k in kinds for t in ITEM_EVENTS[k])]
    pattern = "".join(f"(?:{re.escape(t[:-1])} )+" if t.endswith("+") else f"{re.escape(t)} " for t in expected)
    types = [e["type"] for e in events]
    assert re.fullmatch(pattern + r"response\.(completed|incomplete) ", " ".join(types) + " "), types
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["output_index"] for e in added] == list(range(len(kinds)))
    assert [e["item"]["type"] for e in added] == kinds
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == kinds
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]
    for e in events:
        if "item_id" in e:
            assert e["item_id"] == final["output"][e["output_index"]]["id"]


def _stream_events(server, body: dict) -> list[dict]:
    """The raw events: `event: <type>` and `data: <json>` pairs."""
    events = []
    with httpx.stream("POST", server.url("/v1/responses"), json={"model": MODEL, "stream": True, **body},
                      timeout=120.0) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.read()
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                event = json.loads(line[len("data: "):])
                assert event["type"] == name
                events.append(event)
    return events


def test_create_stream_sends_the_events_in_order(client, server):
    events = [e.model_dump() for e in client.responses.create(model=MODEL, input="Tell me a story.", stream=True,
                                                               max_output_tokens=6, temperature=0)]
    _assert_event_order(events, ["message"])
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    events = _stream_events(server, {"input": "Weather?", "tools": TOOLS, "tool_choice": "required",
                                     "max_output_tokens": 160, "temperature": 0})
    calls = sum(1 for e in events if e["type"] == "response.output_item.added")
    _assert_event_order(events, ["function_call"] * calls)
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    assert events[-1]["response"]["usage"]["output_tokens"] > 0


# ---- the store --------------------------------------------------------------------------------------

def test_stored_responses_can_be_read_and_deleted(client, server):
    import openai

    r = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0)
    assert client.responses.retrieve(r.id) == r
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(r.id)
    assert e.value.body["param"] == "response_id"
    assert httpx.delete(server.url(f"/v1/responses/{r.id}")).status_code == 404
    unstored = client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nope")
    assert e.value.status_code == 404 and e.value.body["param"] == "previous_response_id"
    streamed = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0,
                                            stream=True))[-1].response
    assert client.responses.retrieve(streamed.id) == streamed


def test_a_follow_up_continues_the_stored_conversation(client):
    first = client.responses.create(model=MODEL, input="Hi", instructions="Be brief.", max_output_tokens=6,
                                    temperature=0)
    second = client.responses.create(model=MODEL, input="And then?", previous_response_id=first.id,
                                     max_output_tokens=6, temperature=0)
    # the instructions are not carried over (as OpenAI); the earlier input and output are
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And then?"}]
    _assert_matches_chat(second, _chat(client, history, max_tokens=6))
    # each stored response keeps its whole conversation: the chain survives the first's deletion
    client.responses.delete(first.id)
    third = client.responses.create(model=MODEL, input="Go on.", previous_response_id=second.id,
                                    max_output_tokens=6, temperature=0)
    history += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Go on."}]
    _assert_matches_chat(third, _chat(client, history, max_tokens=6))


def test_the_store_keeps_the_most_recently_used(client):
    import openai

    ids = [client.responses.create(model=MODEL, input=f"n{i}", max_output_tokens=2, temperature=0).id
           for i in range(STORE_BOUND)]
    client.responses.retrieve(ids[0])           # a read is a use: ids[1] is now the least recent
    newer = client.responses.create(model=MODEL, input="one more", max_output_tokens=2, temperature=0).id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])
    for kept in (ids[0], *ids[2:], newer):
        assert client.responses.retrieve(kept).id == kept


# ---- bad input ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("body,param,needle", [
    ({"tools": [{"type": "web_search"}]}, "tools", "web_search"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]},
     "input", "input_image"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
    ({"background": True}, "background", "background"),
    ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"include": ["file_search_call.results"]}, "include", "file_search_call.results"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", "web_search_preview"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.json_schema.schema", "Field required"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}}, "structured_outputs",
     "strin"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"max_output_tokens": 100000}, "max_output_tokens", "max_model_len"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "16 pairs"),
    ({"input": []}, "input", "input is empty"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role: Input should be 'user'"),
    ({"input": ["Hi"]}, "input", "input[0]: Input should be a valid dictionary"),
])
def test_bad_requests_are_400s_in_openais_shape(server, body, param, needle):
    r = httpx.post(server.url("/v1/responses"), json={"model": MODEL, "input": "Hi", **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    assert error["param"] == param and needle in error["message"], error


def test_unknown_model_is_404_and_unknown_fields_are_named(client, server):
    import openai

    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="nope", input="Hi")
    assert e.value.body["param"] == "model"
    r = httpx.post(server.url("/v1/responses"), json={"model": MODEL, "input": "Hi", "max_output_tokens": 2,
                                                      "service_tier": "auto", "safety_identifier": "s"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-ignored-fields"] == "safety_identifier, service_tier"
    assert httpx.get(server.url("/v1/responses/resp_x?stream=true")).status_code == 400


# ---- reasoning -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def think_server(tmp_path_factory, log_dir):
    """A tiny model forced to think by a regex over its whole output (--structured-outputs-in-reasoning),
    read by the qwen3 reasoning parser."""
    folder = make_tiny_model(tmp_path_factory.mktemp("responses-think"), "qwen3", max_position_embeddings=2048)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINK_TEMPLATE}))
    yield from _serve(folder, log_dir, "--reasoning-parser", "qwen3", "--structured-outputs-in-reasoning")


@pytest.fixture(scope="module")
def think_client(think_server):
    import openai

    with openai.OpenAI(base_url=think_server.url("/v1"), api_key="x", max_retries=0, timeout=120.0) as c:
        yield c


def _forced_think(**kw) -> dict:
    return dict(model=MODEL, temperature=0, max_output_tokens=60,
                extra_body={"structured_outputs": {"regex": THINK_FORCED}}, **kw)


def test_reasoning_is_an_item_before_the_message(think_client):
    r = think_client.responses.create(input="Capital of France?", **_forced_think())
    ask = [{"role": "user", "content": "Capital of France?"}]
    chat = think_client.chat.completions.create(model=MODEL, messages=ask, temperature=0, max_tokens=60,
                                                extra_body={"structured_outputs": {"regex": THINK_FORCED}})
    reasoning, message = r.output
    assert reasoning.type == "reasoning" and reasoning.id.startswith("rs_") and reasoning.summary == []
    assert [c.text for c in reasoning.content] == [chat.choices[0].message.reasoning]
    assert message.type == "message" and r.output_text == chat.choices[0].message.content
    assert r.usage.output_tokens_details.reasoning_tokens == chat.usage.completion_tokens_details.reasoning_tokens > 0
    with think_client.responses.stream(input="Capital of France?", **_forced_think()) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert _shape(final.output) == _shape(r.output) and _counts(final.usage) == _counts(r.usage)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == reasoning.content[0].text
    raw = think_client.responses.create(input="Capital of France?", stream=True, **_forced_think())
    _assert_event_order([e.model_dump() for e in raw], ["reasoning", "message"])


def test_reasoning_goes_back_to_the_template(think_client):
    first = think_client.responses.create(input="Capital of France?", **_forced_think())
    thinking, answer = first.output[0].content[0].text, first.output_text
    follow = think_client.responses.create(model=MODEL, input="And Spain?", previous_response_id=first.id,
                                           max_output_tokens=4, temperature=0)
    whole = [{"role": "user", "content": "Capital of France?"}, *first.output,
             {"role": "user", "content": "And Spain?"}]
    by_items = think_client.responses.create(model=MODEL, input=whole, max_output_tokens=4, temperature=0)
    chat = think_client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=4,
        messages=[{"role": "user", "content": "Capital of France?"},
                  {"role": "assistant", "content": answer, "reasoning": thinking},
                  {"role": "user", "content": "And Spain?"}])
    assert follow.usage.input_tokens == by_items.usage.input_tokens == chat.usage.prompt_tokens
    without = think_client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=1, messages=[{"role": "user", "content": "Capital of France?"},
                                                            {"role": "assistant", "content": answer},
                                                            {"role": "user", "content": "And Spain?"}])
    assert chat.usage.prompt_tokens > without.usage.prompt_tokens      # the thinking is in the prompt


def test_reasoning_effort_reaches_the_template(think_client):
    r = think_client.responses.create(model=MODEL, input="Hi", reasoning={"effort": "high"}, max_output_tokens=1)
    chat = think_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=1, extra_body={"chat_template_kwargs":
                                                                          {"reasoning_effort": "high"}})
    plain = think_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=1)
    assert r.usage.input_tokens == chat.usage.prompt_tokens > plain.usage.prompt_tokens
    assert r.reasoning.effort == "high"


def test_langchain_chat_openai_reads_the_reasoning(think_server, think_client):
    """LangChain's ChatOpenAI on the Responses API (use_responses_api) gets the chain of thought as a
    reasoning content block and the answer as text, invoked and streamed."""
    from langchain_openai import ChatOpenAI

    chat = ChatOpenAI(base_url=think_server.url("/v1"), api_key="x", model=MODEL, temperature=0,
                      max_tokens=60, use_responses_api=True, output_version="v1",
                      extra_body={"structured_outputs": {"regex": THINK_FORCED}})
    whole = think_client.responses.create(input="Capital of France?", **_forced_think())
    reply = chat.invoke("Capital of France?")
    blocks = {b["type"]: b for b in reply.content_blocks}
    # langchain-openai keeps a reasoning item's reasoning_text parts (no summary was asked for) in extras
    assert blocks["reasoning"]["extras"]["content"] == [{"type": "reasoning_text",
                                                        "text": whole.output[0].content[0].text}]
    assert reply.text == whole.output_text
    streamed = None
    for chunk in chat.stream("Capital of France?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.text == whole.output_text
    assert [b for b in streamed.content_blocks if b["type"] == "reasoning"]
