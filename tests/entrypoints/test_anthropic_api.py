"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) on a real server with an
API key, driven by the real anthropic SDK (which sends x-api-key), LangChain's ChatAnthropic and
httpx: content blocks, stop sequences, streaming that accumulates to the non-streamed message, a
tool_use round trip, token counting, errors in Anthropic's shape, and thinking blocks with a
reasoning parser."""
from __future__ import annotations

import json

import httpx
import pytest

from conftest import MODEL, build_tokenizer, make_tiny_model, serving

anthropic = pytest.importorskip("anthropic")

KEY = "sk-ant-test-5e1b"
HEADERS = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
# short: without a tool section in the tiny template, the tools go into the prompt as text
CITY = {"name": "get_weather", "description": "Weather", "strict": True,    # strict: no other keys
        "input_schema": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
MAX_BODY = 1 << 16
MAX_MODEL_LEN = 1024
# this SDK takes no sampling parameters of its own; the server still reads them (LangChain sends them so)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # room for the tools' text in the prompt (the tiny tokenizer spends a token on every few characters)
    return make_tiny_model(tmp_path_factory.mktemp("anthropic-model"), "qwen2", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    yield from serving(model_dir, tmp_path_factory.mktemp("anthropic-logs"), "--api-key", KEY,
                       "--max-model-len", str(MAX_MODEL_LEN), "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                       "--max-request-body-bytes", str(MAX_BODY))


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key=KEY, max_retries=0)


def _post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url(path), json=body, headers=HEADERS if headers is None else headers, timeout=60)


def _count(client, **request) -> int:
    fields = {k: v for k, v in request.items() if k in ("model", "messages", "system", "tools", "tool_choice",
                                                        "thinking")}
    return client.messages.count_tokens(**fields).input_tokens


def _prompt_tokens(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens


def test_create_reads_system_and_content_blocks_and_counts_the_prompt(client):
    request = dict(model=MODEL, max_tokens=12, extra_body=GREEDY, system=[{"type": "text", "text": "Be brief."}],
                   messages=[{"role": "user", "content": [{"type": "text", "text": "Once upon a time"},
                                                          {"type": "text", "text": "there was"}]}])
    first = client.messages.create(**request)
    assert first.type == "message" and first.role == "assistant" and first.model == MODEL
    assert first.id.startswith("msg_")
    (block,) = first.content
    assert block.type == "text" and block.text
    assert first.stop_reason in ("max_tokens", "end_turn") and first.stop_sequence is None
    assert 1 <= first.usage.output_tokens <= 12
    assert (first.stop_reason == "max_tokens") == (first.usage.output_tokens == 12)
    # the prompt as count_tokens sees it; the first time nothing of it is cached
    assert first.usage.cache_read_input_tokens == 0 and first.usage.cache_creation_input_tokens == 0
    assert _count(client, **request) == first.usage.input_tokens
    # the system prompt and both text blocks are in the prompt
    assert _count(client, **{**request, "system": "Be brief."}) == first.usage.input_tokens
    assert _count(client, **{**request, "system": "Be very brief."}) > first.usage.input_tokens
    shorter = [{"role": "user", "content": "Once upon a time"}]
    assert _count(client, **{**request, "messages": shorter}) < first.usage.input_tokens
    # the same prompt again: its full blocks come from the prefix cache, and the prompt still adds up
    again = client.messages.create(**request)
    assert again.content == first.content and again.usage.cache_read_input_tokens > 0
    assert _prompt_tokens(again.usage) == _count(client, **request)


def test_a_stop_sequence_ends_the_message_where_it_matches(client):
    request = dict(model=MODEL, max_tokens=16, extra_body=GREEDY, messages=ASK)
    text = client.messages.create(**request).content[0].text
    # two characters from inside the text, at their first occurrence
    stop = next(text[k:k + 2] for k in range(1, len(text) - 1)
                if text.find(text[k:k + 2]) == k and text[k:k + 2].strip())
    r = client.messages.create(**request, stop_sequences=["never-in-this-text", stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == text[:text.find(stop)]


def test_the_stream_accumulates_to_the_created_message(client, server):
    request = dict(model=MODEL, max_tokens=10, extra_body=GREEDY, system="Be brief.",
                   messages=[{"role": "user", "content": "Tell me a story"}])
    created = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        pieces = list(stream.text_stream)
        streamed = stream.get_final_message()
    assert len(pieces) > 1 and "".join(pieces) == created.content[0].text
    assert _blocks(streamed) == _blocks(created)
    assert (streamed.stop_reason, streamed.stop_sequence) == (created.stop_reason, created.stop_sequence)
    assert streamed.usage.output_tokens == created.usage.output_tokens
    assert _prompt_tokens(streamed.usage) == _prompt_tokens(created.usage) == _count(client, **request)
    # Anthropic's event order, each with its event: line
    body = {**{k: v for k, v in request.items() if k != "extra_body"}, **GREEDY, "stream": True}
    with httpx.stream("POST", server.url("/v1/messages"), json=body, headers=HEADERS, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.iter_lines())
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[2:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["input_tokens"] == _count(client, **request)
    assert events[-2][1]["delta"]["stop_reason"] == created.stop_reason


def _blocks(message) -> list[dict]:
    """The content blocks as dicts (the stream's blocks are the SDK's Parsed* kinds)."""
    return [{k: v for k, v in b.model_dump().items() if k != "parsed_output"} for b in message.content]


def _events(lines) -> list[tuple[str, dict]]:
    events, name = [], None
    for line in lines:
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            data = json.loads(line[len("data: "):])
            assert data["type"] == name, (name, data)
            events.append((name, data))
    return events


def test_a_forced_tool_call_and_its_result_round_trip(client, server):
    request = dict(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=ASK, tools=[CITY],
                   tool_choice={"type": "tool", "name": "get_weather"})
    first = client.messages.create(**request)
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_") and call.name == "get_weather" and call.input["city"] in ("Paris", "Rome")
    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    (streamed_call,) = [b for b in streamed.content if b.type == "tool_use"]
    assert (streamed_call.name, streamed_call.input, streamed.stop_reason) == (call.name, call.input, "tool_use")
    # the result goes back as a tool_result block; the next turn's prompt holds it
    result = "Sunny and 21 degrees"
    turn = ASK + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]}]
    second = client.messages.create(model=MODEL, max_tokens=8, extra_body=GREEDY, messages=turn, tools=[CITY])
    assert second.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert _prompt_tokens(second.usage) == _count(client, model=MODEL, messages=turn, tools=[CITY])
    # as the chat API renders the same conversation: the result is in the prompt text
    chat = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": json.dumps(call.input)}}]},
        {"role": "tool", "tool_call_id": call.id, "content": result}]
    tokens = _post(server, "/tokenize", {"model": MODEL, "messages": chat}).json()["tokens"]
    assert _count(client, model=MODEL, messages=turn) == len(tokens)
    assert result in _post(server, "/detokenize", {"model": MODEL, "tokens": tokens}).json()["prompt"]
    # the text blocks of a result, and is_error
    blocks = [{"type": "tool_result", "tool_use_id": call.id, "content": [{"type": "text", "text": result}]}]
    assert _count(client, model=MODEL, messages=turn[:-1] + [{"role": "user", "content": blocks}]) == len(tokens)
    failed = [{"type": "tool_result", "tool_use_id": call.id, "content": result, "is_error": True}]
    assert _count(client, model=MODEL, messages=turn[:-1] + [{"role": "user", "content": failed}]) > len(tokens)


def test_tool_choice_any_calls_a_tool_and_none_calls_none(client):
    r = client.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, messages=ASK, tools=[CITY],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True})
    calls = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(calls) == 1 and calls[0].input["city"] in ("Paris", "Rome")
    r = client.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=ASK, tools=[CITY],
                               tool_choice={"type": "none"})
    assert r.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in r.content)


def test_a_reply_may_run_to_the_end_of_the_context(client):
    """max_tokens past the context's end (Claude Code asks for 32,000): the reply stops there, with
    Anthropic's model_context_window_exceeded."""
    def ask(n: int) -> list[dict]:
        return [{"role": "user", "content": "x" * n}]

    room = 3
    n = 100 + MAX_MODEL_LEN - room - _count(client, model=MODEL, messages=ask(100))
    assert _count(client, model=MODEL, messages=ask(n)) == MAX_MODEL_LEN - room
    request = dict(model=MODEL, max_tokens=16000, extra_body=GREEDY, messages=ask(n))
    r = client.messages.create(**request)
    assert (r.stop_reason, r.usage.output_tokens) == ("model_context_window_exceeded", room)
    with client.messages.stream(**{**request, "max_tokens": 32000}) as stream:   # the SDK streams that many
        streamed = stream.get_final_message()
    assert _blocks(streamed) == _blocks(r) and streamed.stop_reason == r.stop_reason
    assert client.messages.create(**{**request, "max_tokens": 2}).stop_reason == "max_tokens"


def test_a_final_assistant_message_is_continued(client, server):
    """Anthropic's prefill: the reply continues the last (assistant) message, as the chat API's
    continue_final_message does, and holds only the new text."""
    prefilled = ASK + [{"role": "assistant", "content": "It is"}]
    r = client.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, messages=prefilled)
    chat = _post(server, "/v1/chat/completions", {
        "model": MODEL, "messages": prefilled, "max_tokens": 6, "temperature": 0, "continue_final_message": True,
        "add_generation_prompt": False}).json()
    assert r.content[0].text == chat["choices"][0]["message"]["content"]
    assert _prompt_tokens(r.usage) == chat["usage"]["prompt_tokens"] == _count(client, model=MODEL, messages=prefilled)


def _error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


@pytest.mark.parametrize("body,where,says", [
    ({"messages": ASK}, "max_tokens", "Field required"),
    ({"max_tokens": 5, "messages": []}, "messages", "at least 1"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "messages.0.content.0", "'image'"),
    ({"max_tokens": 5, "messages": ASK, "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools.0", "server tools"),
    ({"max_tokens": 5, "messages": ASK, "tools": [CITY], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice", "nope"),
    ({"max_tokens": 5, "messages": ASK, "tool_choice": {"type": "tool"}}, "tool_choice", "name"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                                   "input": {}}]}]},
     "messages.0.content.0", "only the assistant's"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": "x" * 3000}]}, "messages", "max_model_len"),
    ({"max_tokens": "5", "messages": ASK}, "max_tokens", "integer"),
])
def test_bad_requests_get_anthropic_400s(server, body, where, says):
    message = _error(_post(server, "/v1/messages", {"model": MODEL, **body}), 400, "invalid_request_error")
    assert where in message and says in message, message


def test_errors_take_anthropic_shape_and_sdk_classes(server, client):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=0, messages=ASK)
    assert bad.value.status_code == 400 and bad.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-nope", max_tokens=5, messages=ASK)
    assert "claude-nope" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nope", messages=ASK)
    wrong = anthropic.Anthropic(base_url=server.base, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        wrong.messages.create(model=MODEL, max_tokens=5, messages=ASK)
    assert denied.value.body["error"]["type"] == "authentication_error"
    _error(_post(server, "/v1/messages/count_tokens", {"model": MODEL, "messages": ASK}, headers={}),
           401, "authentication_error")
    _error(httpx.get(server.url("/v1/messages/nope"), headers=HEADERS, timeout=10), 404, "not_found_error")
    huge = [{"role": "user", "content": "x" * MAX_BODY}]
    _error(_post(server, "/v1/messages", {"model": MODEL, "max_tokens": 5, "messages": huge}), 413,
           "request_too_large")
    chunks = (b'{"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "' if i == 0
              else b"x" * MAX_BODY for i in range(3))      # no content-length: refused as it grows
    _error(httpx.post(server.url("/v1/messages"), content=chunks, timeout=30,
                      headers={**HEADERS, "Content-Type": "application/json"}), 413, "request_too_large")
    # the OpenAI routes keep OpenAI's shape, and take the key either way
    r = httpx.get(server.url("/v1/models"), headers={"x-api-key": "sk-wrong"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(server.url("/v1/models"), headers={"x-api-key": KEY}, timeout=10).status_code == 200
    bearer = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(server.url("/v1/models"), headers=bearer, timeout=10).status_code == 200


def test_unknown_top_level_fields_are_ignored_and_named(server):
    r = _post(server, "/v1/messages", {"model": MODEL, "max_tokens": 3, "messages": ASK, "service_tier": "auto",
                                       "metadata": {"user_id": "u-1"}})
    assert r.status_code == 200, r.text
    assert r.headers["x-ignored-fields"] == "service_tier"


def test_langchain_chat_anthropic_invokes_and_streams(server, client):
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    chat = langchain_anthropic.ChatAnthropic(base_url=server.base, api_key=KEY, model=MODEL, max_tokens=8,
                                             temperature=0, max_retries=0)
    reply = chat.invoke("Once upon a time")
    assert isinstance(reply.content, str) and reply.content
    assert reply.response_metadata["stop_reason"] in ("end_turn", "max_tokens")
    ask = [{"role": "user", "content": "Once upon a time"}]
    assert reply.usage_metadata["input_tokens"] == _count(client, model=MODEL, messages=ask)
    assert reply.usage_metadata["output_tokens"] >= 1
    chunks = list(chat.stream("Once upon a time"))
    full = chunks[0]
    for chunk in chunks[1:]:
        full = full + chunk
    assert len(chunks) > 1
    text = full.content if isinstance(full.content, str) else "".join(
        p.get("text", "") for p in full.content if isinstance(p, dict))
    assert text == reply.content


# ---- thinking blocks from a reasoning parser -------------------------------------------------------

# the tiny template as a Qwen3-style thinking template: the generation prompt opens <think> unless
# enable_thinking is false, and an assistant turn's reasoning is written back
THINKING_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {% if m.get('reasoning_content') %}<think>{{ m['reasoning_content'] }}"
    "</think>{% endif %}{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:"
    "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def thinking_server(model_dir, tmp_path_factory):
    from tokenizers import AddedToken

    from twostep.entrypoints.openai.state import ServerConfig

    if "reasoning_parser" not in ServerConfig.__dataclass_fields__:
        pytest.skip("the server has no --reasoning-parser yet")
    folder = tmp_path_factory.mktemp("thinking-model")
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        if (model_dir / name).exists():
            (folder / name).write_bytes((model_dir / name).read_bytes())
    tok = build_tokenizer()
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "add_bos_token": False,
        "chat_template": THINKING_TEMPLATE}))
    yield from serving(folder, tmp_path_factory.mktemp("thinking-logs"), "--max-model-len", "256",
                       "--reasoning-parser", "qwen3")


def test_reasoning_comes_back_as_a_thinking_block(thinking_server):
    client = anthropic.Anthropic(base_url=thinking_server.base, api_key="none", max_retries=0)
    request = dict(model=MODEL, max_tokens=12, extra_body=GREEDY, messages=ASK,
                   thinking={"type": "enabled", "budget_tokens": 1024})
    r = client.messages.create(**request)
    # the prompt opened <think> and the output never closed it: all of it is reasoning
    (block,) = r.content
    assert block.type == "thinking" and block.thinking and block.signature == ""
    assert r.stop_reason == "max_tokens"
    assert 0 < r.usage.output_tokens_details.thinking_tokens <= r.usage.output_tokens == 12
    with client.messages.stream(**request) as stream:
        streamed = stream.get_final_message()
    assert _blocks(streamed) == _blocks(r) and streamed.stop_reason == r.stop_reason
    assert streamed.usage.output_tokens_details == r.usage.output_tokens_details
    # disabled: no <think> in the prompt, and no parser splits the answer
    plain = client.messages.create(**{**request, "thinking": {"type": "disabled"}})
    assert [b.type for b in plain.content] == ["text"]
    assert _count(client, **request) > _count(client, **{**request, "thinking": {"type": "disabled"}})
    # a thinking block sent back is the assistant turn's reasoning in the template
    turn = ASK + [{"role": "assistant", "content": [{"type": "thinking", "thinking": "Weather: look it up.",
                                                     "signature": ""}, {"type": "text", "text": "Sunny."}]},
                  {"role": "user", "content": "Thanks"}]
    without = ASK + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]
    assert _count(client, model=MODEL, messages=turn) > _count(client, model=MODEL, messages=without)
