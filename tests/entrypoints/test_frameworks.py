"""What the structured-output issue tried as a new user: LangChain's ChatOpenAI with_structured_output
(every method) and bind_tools, and LiteLLM's JSON mode and tools, against the real server on the
default model."""
from __future__ import annotations

import json
import os

import pytest

from conftest import Server, smollm_path

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = Server(smollm_path(), tmp_path_factory.mktemp("framework-logs"), "--kv-cache-memory", "256MiB",
                    "--max-model-len", "2048", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                    served_name=MODEL)
    try:
        yield server
    finally:
        assert server.terminate() == 0, server.output()


@pytest.fixture(scope="module")
def chat(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    return langchain_openai.ChatOpenAI(base_url=server.url("/v1"), api_key="x", model=MODEL, temperature=0,
                                       max_tokens=100, max_retries=0)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(chat, method):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """A person."""
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    ask = "Tell me about Alice, 30 years old." + (" Reply in JSON with keys name and age." if method == "json_mode" else "")
    person = chat.with_structured_output(Person, method=method).invoke(ask)
    assert isinstance(person, Person) and 0 <= person.age <= 120 and person.name


def test_langchain_bind_tools(chat):
    from langchain_core.tools import tool

    @tool
    def multiply(a: int, b: int) -> int:
        """Multiply two integers."""
        return a * b

    for choice in ("multiply", "any"):
        message = chat.bind_tools([multiply], tool_choice=choice).invoke("What is 6 times 7?")
        assert message.tool_calls, message
        for call in message.tool_calls:
            assert call["name"] == "multiply" and set(call["args"]) == {"a", "b"}
            assert all(isinstance(v, int) for v in call["args"].values())
    auto = chat.bind_tools([multiply]).invoke("What is 6 times 7?")     # auto: the model may answer in text
    assert auto.content or auto.tool_calls
    chunks = list(chat.bind_tools([multiply], tool_choice="multiply").stream("What is 6 times 7?"))
    full = chunks[0]
    for c in chunks[1:]:
        full = full + c
    (call,) = full.tool_calls
    assert call["name"] == "multiply" and set(call["args"]) == {"a", "b"}


def test_litellm_json_mode_and_tools(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")   # no download of its price list
    litellm = pytest.importorskip("litellm")
    base = dict(model=f"openai/{MODEL}", api_base=server.url("/v1"), api_key="x", temperature=0, max_tokens=100)
    r = litellm.completion(messages=[{"role": "user", "content": 'Reply with the JSON object {"ok": true}.'}],
                           response_format={"type": "json_object"}, **base)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                               "parameters": {"type": "object", "properties": {
                                                   "city": {"type": "string", "maxLength": 20}},
                                                   "required": ["city"], "additionalProperties": False}}}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    r = litellm.completion(messages=ask, tools=tools, tool_choice="required", **base)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls[:1]
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    stream = litellm.completion(messages=ask, tools=tools, stream=True,
                                tool_choice={"type": "function", "function": {"name": "get_weather"}}, **base)
    message = litellm.stream_chunk_builder(list(stream)).choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
