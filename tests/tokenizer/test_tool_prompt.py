"""Tools through chat templates: a template with a tool section gets them as `tools`; one without
gets the documented fallback (tools in the system message, calls and results as Hermes text)."""
from __future__ import annotations

import json

import pytest

from conftest import build_tokenizer
from twostep.tokenizer.tokenizer import Tokenizer
from twostep.tokenizer.tool_prompt import template_reads_tools

PLAIN = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
WITH_TOOLS = ("{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}\n{% endif %}"
              "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
              "{% for c in m.get('tool_calls', []) %}CALL {{ c['function']['name'] }} "
              "{{ c['function']['arguments'] | tojson }}{% endfor %}\n{% endfor %}")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "clear"}'},
]


def _tokenizer(template: str) -> Tokenizer:
    return Tokenizer(build_tokenizer(), {"chat_template": template})


def test_which_templates_read_tools():
    assert template_reads_tools(WITH_TOOLS)
    assert not template_reads_tools(PLAIN)
    assert not template_reads_tools("{% set tools_note = 1 %}{{ messages }}")


def test_a_template_with_tools_renders_them_itself():
    text = _tokenizer(WITH_TOOLS).apply_chat_template(CONVERSATION, tools=[TOOL])
    assert text.startswith("TOOLS:get_weather;")
    assert 'CALL get_weather {"city": "Paris"}' in text
    assert "<tool_call>" not in text and "<tools>" not in text


def test_a_template_without_tools_gets_the_fallback():
    text = _tokenizer(PLAIN).apply_chat_template(CONVERSATION, tools=[TOOL])
    system, rest = text.split("<|user|>", 1)
    assert system.startswith("<|system|>") and "<tools>\n" + json.dumps(TOOL) + "\n</tools>" in system
    assert "<tool_call>" in system                       # the instruction names the format
    assert ('<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            in rest)
    assert '<|user|><tool_response>\n{"sky": "clear"}\n</tool_response>' in rest
    assert "<|tool|>" not in rest


def test_the_fallback_joins_an_existing_system_message():
    text = _tokenizer(PLAIN).apply_chat_template([{"role": "system", "content": "Be brief."}] + CONVERSATION[:1],
                                                 tools=[TOOL])
    assert text.count("<|system|>") == 1 and text.startswith("<|system|>Be brief.\n\nYou may call")


def test_without_tools_nothing_changes():
    tok = _tokenizer(PLAIN)
    assert tok.apply_chat_template(CONVERSATION[:1]) == tok.apply_chat_template(CONVERSATION[:1], tools=[])
    assert "<tools>" not in tok.apply_chat_template(CONVERSATION[:1])


def test_openai_shaped_messages_render_the_same_as_plain_ones():
    # As OpenAI clients send them: arguments as JSON text, content as a list of text parts.
    openai_shaped = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in "}, {"type": "text", "text": "Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        CONVERSATION[2]]
    for template in (PLAIN, WITH_TOOLS):
        tok = _tokenizer(template)
        assert tok.apply_chat_template(openai_shaped, tools=[TOOL]) == tok.apply_chat_template(CONVERSATION,
                                                                                              tools=[TOOL])
    bad = [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(ValueError, match="not valid JSON"):
        _tokenizer(PLAIN).apply_chat_template(bad, tools=[TOOL])
