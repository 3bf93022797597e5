"""Tool-call parsers (twostep.entrypoints.openai.tool_parsers): fixed outputs of each format, read
whole (extract_tool_calls) and streamed in many chunkings (ToolCallStreamer), and the parse
contract -- every prefix's parse is consistent with the longer texts' -- checked on every prefix."""
from __future__ import annotations

import itertools
import json
import random
import re
from dataclasses import dataclass

import pytest

from twostep.entrypoints.harmony import parse_chat_output
from twostep.entrypoints.openai.protocol import ChatCompletionRequest
from twostep.entrypoints.openai.tool_choice import plan_tools
from twostep.entrypoints.openai.tool_parsers import (TOOL_PARSERS, GptOssToolParser, HermesToolParser,
                                                     Llama3JsonToolParser, MistralToolParser, NamedToolParser,
                                                     ParsedOutput, PythonicToolParser, Qwen3CoderToolParser,
                                                     RequiredToolsParser, StreamDelta, ToolCallStreamer, ToolParser,
                                                     extract_tool_calls, get_tool_parser, new_call_id)
from twostep.entrypoints.openai.tool_parsers.content import cut_partial_marker, join_content
from twostep.entrypoints.openai.tool_parsers.json_scan import Scan, scan_group, scan_value, value_prefix
from twostep.entrypoints.openai.tool_parsers.parameter_values import parameter_value, schema_types


@dataclass
class Case:
    id: str
    text: str
    content: str | None  # extract_tool_calls's content
    calls: list[tuple[str, object]]  # extract_tool_calls's calls: (name, json.loads(arguments))
    # what streaming sends when it differs from extract_tool_calls (malformed calls): (name, raw arguments)
    streamed: list[tuple[str, str]] | None = None


def tc(name: str, **arguments) -> tuple[str, dict]:
    return name, arguments


WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
TRICKY = {"text": 'Ünïcødé "quoted" {braces} [brackets] \\ back\\slash <tool_call> [TOOL_CALLS] 😀 é',
          "other": "}]\"'"}
NESTED = {"filter": {"tags": ["a", "b"], "range": {"min": 1, "max": [2, [3, {"x": None}]]}}, "flag": True,
          "ratio": -1.5e3}

HERMES = [
    Case("one_call", f"<tool_call>\n{WEATHER}\n</tool_call>", None, [tc("get_weather", city="Paris")]),
    Case("two_calls_content_before",
         f'Let me check.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n'
         '{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
         "Let me check.", [tc("get_weather", city="Paris"), tc("get_time", tz="CET")]),
    Case("content_after", '<tool_call>{"name": "f", "arguments": {}}</tool_call>\nDone.',
         "Done.", [tc("f")]),
    Case("content_between", f"A\n<tool_call>{WEATHER}</tool_call>\nB\n<tool_call>{WEATHER}</tool_call> C ",
         "A\nB\nC ", [tc("get_weather", city="Paris")] * 2),
    Case("unicode_escapes",
         '<tool_call>\n{"name": "say", "arguments": ' + json.dumps(TRICKY) + "}\n</tool_call>",
         None, [("say", TRICKY)]),
    Case("unicode_raw",
         '<tool_call>{"name": "say", "arguments": ' + json.dumps(TRICKY, ensure_ascii=False) + "}</tool_call>",
         None, [("say", TRICKY)]),
    Case("nested", '<tool_call>{"name": "search", "arguments": ' + json.dumps(NESTED, indent=2) + "}</tool_call>",
         None, [("search", NESTED)]),
    Case("arguments_before_name", '<tool_call>{"arguments": {"x": [1, 2]}, "name": "f"}</tool_call>',
         None, [tc("f", x=[1, 2])]),
    Case("no_arguments_key", '<tool_call>{"name": "ping"}</tool_call>', None, [tc("ping")]),
    Case("escaped_name", '<tool_call>{"name": "get_\\u0077eather", "arguments": {}}</tool_call>',
         None, [tc("get_weather")]),
    Case("no_call", "Just text, with { braces } and [brackets].\n", "Just text, with { braces } and [brackets].\n", []),
    Case("looks_like_markup", "Use <tool to do it, or <tool_calls>", "Use <tool to do it, or <tool_calls>", []),
    Case("ends_like_markup", "I will <tool_cal", "I will <tool_cal", []),
    Case("unclosed_at_end", '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_c', None, [tc("f", a=1)]),
    Case("malformed_json", '<tool_call>{"name": "f", "arguments": {"a": }}</tool_call>', None, [],
         streamed=[("f", '{"a": }')]),
    Case("malformed_structure", '<tool_call>{"name": "f" "arguments": {"a": 1}}</tool_call>ok', "ok", [],
         streamed=[("f", "")]),
    Case("truncated", '<tool_call>{"name": "f", "arguments": {"a": "x', None, [], streamed=[("f", '{"a": "x')]),
    Case("not_an_object", "<tool_call>hello</tool_call>", None, [], streamed=[]),
]

LLAMA3 = [
    Case("one_call", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None,
         [tc("get_weather", city="Paris")]),
    Case("python_tag", '<|python_tag|>{"name": "f", "arguments": {"a": 1}}', None, [tc("f", a=1)]),
    Case("two_calls", ' \n{"name": "f", "parameters": {"a": 1}}; {"name": "g", "parameters": {}}', None,
         [tc("f", a=1), tc("g")]),
    Case("three_calls_tight", '<|python_tag|>{"name":"f","parameters":{}};{"name":"g","parameters":{}};'
         '{"name":"h","parameters":{"z":"</"}}', None, [tc("f"), tc("g"), tc("h", z="</")]),
    Case("unicode_escapes", '{"name": "say", "parameters": ' + json.dumps(TRICKY) + "}", None, [("say", TRICKY)]),
    Case("nested", '{"name": "search", "parameters": ' + json.dumps(NESTED) + "}", None, [("search", NESTED)]),
    Case("content_after", '{"name": "f", "parameters": {}} Hope that helps.', "Hope that helps.", [tc("f")]),
    Case("no_call", "The weather in Paris is {sunny}.", "The weather in Paris is {sunny}.", []),
    Case("json_not_a_call", '{"answer": 42}', '{"answer": 42}', []),
    Case("looks_like_tag", "<|python is a language", "<|python is a language", []),
    Case("ends_like_tag", "<|python_ta", "<|python_ta", []),
    Case("malformed_structure", '{"name": "f", "parameters": {"a": 1]}', "]}", [], streamed=[("f", '{"a": 1')]),
    Case("malformed_json", '{"name": "f", "parameters": {"a": tru}}', None, [], streamed=[("f", '{"a": tru}')]),
]

MISTRAL = [
    Case("one_call", f"[TOOL_CALLS][{WEATHER}]", None, [tc("get_weather", city="Paris")]),
    Case("two_calls_content_before",
         f'Sure.\n\n[TOOL_CALLS] [{WEATHER}, {{"name": "f", "arguments": {{}}}}]', "Sure.",
         [tc("get_weather", city="Paris"), tc("f")]),
    Case("args_form", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [tc("get_weather", city="Paris")]),
    Case("args_form_repeated", '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g.v2[ARGS]{"b": [1, 2]}', None,
         [tc("f", a=1), tc("g.v2", b=[1, 2])]),
    Case("unicode_escapes", '[TOOL_CALLS][{"name": "say", "arguments": ' + json.dumps(TRICKY) + "}]", None,
         [("say", TRICKY)]),
    Case("markers_in_strings", '[TOOL_CALLS]say[ARGS]{"t": "[TOOL_CALLS]x[ARGS]{}", "u": "é"}', None,
         [tc("say", t="[TOOL_CALLS]x[ARGS]{}", u="é")]),
    Case("nested", '[TOOL_CALLS]search[ARGS]' + json.dumps(NESTED, indent=1), None, [("search", NESTED)]),
    Case("content_after", f"[TOOL_CALLS][{WEATHER}]\nAnything else?", "Anything else?",
         [tc("get_weather", city="Paris")]),
    Case("no_call", "No tools [needed] here.", "No tools [needed] here.", []),
    Case("looks_like_marker", "[TOOL something] [ not a call", "[TOOL something] [ not a call", []),
    Case("marker_then_text", "Hi [TOOL_CALLS]hello there", "Hi\nhello there", []),
    Case("malformed_array", f"[TOOL_CALLS][{WEATHER}, 42]", "42]", [tc("get_weather", city="Paris")]),
    Case("malformed_json", '[TOOL_CALLS]f[ARGS]{"a": tru}', None, [], streamed=[("f", '{"a": tru}')]),
]

PYTHONIC = [
    Case("one_call", '[get_weather(city="Paris", days=3)]', None, [tc("get_weather", city="Paris", days=3)]),
    Case("two_calls", "[get_weather(city='Paris'), get_time()]", None, [tc("get_weather", city="Paris"),
                                                                        tc("get_time")]),
    Case("wrapped", '<|python_start|>[f(a=1), g(b="x")]<|python_end|>', None, [tc("f", a=1), tc("g", b="x")]),
    Case("constants", "[f(a=True, b=False, c=None)]", None, [tc("f", a=True, b=False, c=None)]),
    Case("unicode_escapes", "[say(text='Ünï \\'q\\' \"dq\" {b} [x] (p) 😀', other=\"it's ]\")]", None,
         [tc("say", text="Ünï 'q' \"dq\" {b} [x] (p) 😀", other="it's ]")]),
    Case("nested", '[search(filter={"tags": ["a", "b"], "r": (1, 2), "d": {"x": None}}, n=-1.5)]', None,
         [tc("search", filter={"tags": ["a", "b"], "r": [1, 2], "d": {"x": None}}, n=-1.5)]),
    Case("dotted_name_spaces", " [ math.sqrt( x = 2 ) ,  ]", None, [tc("math.sqrt", x=2)]),
    Case("content_after", "[f()] done", "done", [tc("f")]),
    Case("no_call", "Hello there (friend).", "Hello there (friend).", []),
    Case("not_a_call", "[ not a call", "[ not a call", []),
    Case("list_of_numbers", "[1, 2, 3]", "[1, 2, 3]", []),
    Case("empty_list", "[]", "[]", []),
    Case("ends_like_tag", "<|python_st", "<|python_st", []),
    Case("non_literal", "[f(x=foo)]", None, [], streamed=[("f", "")]),
    Case("positional", "[f(1), g(y=2)]", None, [tc("g", y=2)], streamed=[("f", ""), ("g", '{"y": 2}')]),
    Case("second_not_a_call", "[f(a=1), and more", "and more", [tc("f", a=1)]),
]

REQUIRED = [
    Case("one_call", '[{"name": "f", "parameters": {"a": 1}}]', None, [tc("f", a=1)]),
    Case("two_calls", '[\n  {"name": "f", "parameters": ' + json.dumps(NESTED) + '},\n  {"parameters": '
         + json.dumps(TRICKY) + ', "name": "g"}\n]', None, [("f", NESTED), ("g", TRICKY)]),
    Case("empty", "[]", None, []),
    Case("not_an_array", "nope", "nope", []),
    Case("malformed", '[{"name": "f", "parameters": {"a": 1}} {"name": "g"}]', '{"name": "g"}]', [tc("f", a=1)]),
]

NAMED = [
    Case("object", '{"city": "Paris"}', None, [tc("get_weather", city="Paris")]),
    Case("tricky", "\n " + json.dumps(TRICKY, ensure_ascii=False), None, [("get_weather", TRICKY)]),
    Case("nested", json.dumps(NESTED, indent=2), None, [("get_weather", NESTED)]),
    Case("truncated", '{"city": "Par', None, [], streamed=[("get_weather", '{"city": "Par')]),
]


def function(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": properties}}}


QWEN_TOOLS = [
    function("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"},
                             "unit": {"enum": ["celsius", "fahrenheit"]}}),
    function("search", {"query": {"type": "string"}, "filter": {"type": "object"}, "tags": {"type": "array"},
                        "limit": {"type": "number"}, "exact": {"type": "boolean"},
                        "cursor": {"type": ["string", "null"]}}),
]


def xml_call(name: str, *parameters: tuple[str, str], block: bool = True) -> str:
    """A call as Qwen3-Coder writes it: each value on lines of its own."""
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    function = f"<function={name}>\n{body}</function>"
    return f"<tool_call>\n{function}\n</tool_call>" if block else function


PARIS = xml_call("get_weather", ("city", "Paris"), ("days", "3"))
CODE = "def f(x):\n    return '<b>' + \"{x}\"\n"

QWEN3_CODER = [
    Case("one_call", PARIS, None, [tc("get_weather", city="Paris", days=3)]),
    Case("two_calls_content_before", f"Let me check.\n\n{PARIS}\n{xml_call('search', ('query', 'rain'))}",
         "Let me check.", [tc("get_weather", city="Paris", days=3), tc("search", query="rain")]),
    Case("types_by_schema",
         xml_call("search", ("query", "42"), ("filter", json.dumps(NESTED)), ("tags", "['a', \"b\"]"),
                  ("limit", "-1.5e3"), ("exact", "True"), ("cursor", "null")),
         None, [tc("search", query="42", filter=NESTED, tags=["a", "b"], limit=-1500.0, exact=True, cursor=None)]),
    Case("raw_strings_keep_their_text",
         xml_call("search", ("query", "\n" + CODE), ("cursor", json.dumps(TRICKY, ensure_ascii=False))),
         None, [tc("search", query="\n" + CODE, cursor=json.dumps(TRICKY, ensure_ascii=False))]),
    Case("unknown_tool_and_parameter_try_json",
         xml_call("other", ("n", "42"), ("s", "hello"), ("o", '{"a": [1]}')) + xml_call("get_weather", ("note", "[1]")),
         None, [tc("other", n=42, s="hello", o={"a": [1]}), tc("get_weather", note=[1])]),
    Case("two_functions_in_one_block",
         "<tool_call>\n" + xml_call("get_weather", ("city", "Oslo"), block=False) + "\n"
         + xml_call("search", ("exact", "false"), block=False) + "\n</tool_call>",
         None, [tc("get_weather", city="Oslo"), tc("search", exact=False)]),
    Case("no_arguments", xml_call("ping"), None, [tc("ping")]),
    Case("content_after", PARIS + "\nHope that helps.", "Hope that helps.", [tc("get_weather", city="Paris", days=3)]),
    Case("without_tool_call_tags",
         "Sure.\n" + xml_call("get_weather", ("days", "2"), block=False) + "\n</tool_call>\nok",
         "Sure.\nok", [tc("get_weather", days=2)]),
    Case("without_closing_tool_call", PARIS[:-len("\n</tool_call>")], None, [tc("get_weather", city="Paris", days=3)]),
    Case("without_closing_parameter",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n3\n</function>\n</tool_call>",
         None, [tc("get_weather", city="Paris", days=3)]),
    Case("cut_in_a_value", "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n"
         "<parameter=city>\nPar", None, [tc("get_weather", days=3, city="Par")]),
    Case("cut_in_a_closing_tag", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</para",
         None, [tc("get_weather", city="Paris")]),
    Case("cut_in_the_name", "Hm.\n<tool_call>\n<function=get_wea", "Hm.", [], streamed=[]),
    Case("no_call", "Just text, with <b>tags</b> and x > 1.\n", "Just text, with <b>tags</b> and x > 1.\n", []),
    Case("looks_like_markup", "Use <tool or <function to do it", "Use <tool or <function to do it", []),
    Case("ends_like_markup", "I will <tool_cal", "I will <tool_cal", []),
    Case("not_a_name", "<tool_call>\n<function=<parameter=x>\n1\n</parameter>\n</function>\n</tool_call>ok", "ok", [],
         streamed=[]),
]

ANALYSIS = "<|channel|>analysis<|message|>Need the weather.<|end|>"
HARMONY_CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
                '{"city": "Paris"}')
HARMONY_ANSWER = "<|start|>assistant<|channel|>final<|message|>It is sunny."

GPT_OSS = [
    Case("one_call", ANALYSIS + HARMONY_CALL, None, [tc("get_weather", city="Paris")]),   # stopped at <|call|>
    Case("one_call_with_call_token", ANALYSIS + HARMONY_CALL + "<|call|>", None, [tc("get_weather", city="Paris")]),
    Case("recipient_before_channel", '<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.get_time'
         '<|channel|>commentary json<|message|>{"tz": "CET"}<|call|>', None, [tc("get_time", tz="CET")]),
    Case("call_first", ' to=functions.f<|channel|>commentary<|message|>{"a": [1, 2]}', None, [tc("f", a=[1, 2])]),
    Case("two_calls_after_a_preamble", "<|channel|>commentary<|message|>Let me check.<|end|>" + HARMONY_CALL
         + '<|call|><|start|>assistant<|channel|>commentary to=functions.search<|message|>' + json.dumps(NESTED),
         None, [tc("get_weather", city="Paris"), ("search", NESTED)]),
    Case("tricky_arguments",
         "<|channel|>commentary to=functions.say<|message|>" + json.dumps(TRICKY, ensure_ascii=False),
         None, [("say", TRICKY)]),
    Case("answer", ANALYSIS + HARMONY_ANSWER + "<|return|>", "It is sunny.", []),
    Case("call_and_answer", HARMONY_CALL + "<|call|>" + HARMONY_ANSWER, "It is sunny.",
         [tc("get_weather", city="Paris")]),
    Case("plain_text", "Just text {not: json}", "Just text {not: json}", []),
    Case("builtin_tool", '<|channel|>analysis to=browser.search<|message|>{"q": "x"}<|call|>', None, []),
    Case("malformed_json", "<|channel|>commentary to=functions.f<|message|>{\"a\": tru}<|call|>", None, [],
         streamed=[("f", '{"a": tru}')]),
    Case("truncated", '<|channel|>commentary to=functions.f<|message|>{"a": "x', None, [],
         streamed=[("f", '{"a": "x')]),
    Case("cut_in_the_header", ANALYSIS + "<|start|>assistant<|channel|>commentary to=functions.get_wea", None, []),
]
HARMONY_MARKUP = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"]

PARSERS = {  # name -> (factory, cases, markup that content never contains)
    "hermes": (HermesToolParser, HERMES, ["<tool_call>", "</tool_call>"]),
    "llama3_json": (Llama3JsonToolParser, LLAMA3, ["<|python_tag|>"]),
    "mistral": (MistralToolParser, MISTRAL, ["[TOOL_CALLS]", "[ARGS]"]),
    "pythonic": (PythonicToolParser, PYTHONIC, ["<|python_start|>", "<|python_end|>"]),
    "required": (RequiredToolsParser, REQUIRED, []),
    "named": (lambda: NamedToolParser("get_weather"), NAMED, []),
    "qwen3_coder": (lambda: Qwen3CoderToolParser(QWEN_TOOLS), QWEN3_CODER,
                    ["<tool_call>", "</tool_call>", "<function=", "<parameter="]),
    "gpt_oss": (GptOssToolParser, GPT_OSS, HARMONY_MARKUP),
}
ALL = [pytest.param(name, case, id=f"{name}-{case.id}") for name, (_, cases, _) in PARSERS.items() for case in cases]


def make(name: str) -> ToolParser:
    return PARSERS[name][0]()


def stream(parser: ToolParser, chunks: list[str], markup: list[str], max_calls: int | None = None):
    """Feeds chunks (the last with final=True), checks each delta's shape; returns the content and the
    (name, arguments) of each call, as a client would assemble them, and the streamer."""
    streamer = ToolCallStreamer(parser, max_calls)
    content, calls, ids = "", [], set()
    for i, chunk in enumerate(chunks):
        delta = streamer.feed(chunk, final=i == len(chunks) - 1)
        assert not any(marker in delta.content for marker in markup), delta.content
        content += delta.content
        for entry in delta.tool_calls:
            index = entry["index"]
            if "id" in entry:  # announcement: once per call, in order, before any fragment
                assert index == len(calls)
                assert re.fullmatch(r"call_[0-9a-f]{24}", entry["id"]) and entry["id"] not in ids
                assert entry["type"] == "function" and entry["function"]["arguments"] == ""
                assert set(entry) == {"index", "id", "type", "function"}
                ids.add(entry["id"])
                calls.append([entry["function"]["name"], ""])
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                assert index < len(calls)
                assert entry["function"]["arguments"] != ""
                calls[index][1] += entry["function"]["arguments"]
    assert [(c.name, c.arguments) for c in streamer.calls] == [tuple(c) for c in calls]
    assert streamer.has_calls == bool(calls)
    return content, [tuple(c) for c in calls], streamer


def chunkings(text: str):
    yield "one_per_char", list(text) or [""]
    for cut in range(len(text) + 1):
        yield f"split_{cut}", [text[:cut], text[cut:]]
    rng = random.Random(1234)
    for seed in range(5):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8)))) if len(text) > 1 else []
        bounds = [0, *cuts, len(text)]
        yield f"random_{seed}", [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("name,case", ALL)
def test_extract_tool_calls(name, case):
    content, calls = extract_tool_calls(make(name), case.text)
    assert content == case.content
    assert [(call.name, json.loads(call.arguments)) for call in calls] == case.calls
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", call.id) for call in calls)
    assert len({call.id for call in calls}) == len(calls)


@pytest.mark.parametrize("name,case", ALL)
def test_streaming_matches_extract_in_every_chunking(name, case):
    parser, markup = make(name), PARSERS[name][2]
    content, calls = extract_tool_calls(parser, case.text)
    expected = case.streamed if case.streamed is not None else [(call.name, call.arguments) for call in calls]
    for label, chunks in chunkings(case.text):
        got_content, got_calls, _ = stream(parser, chunks, markup)
        assert (got_content, got_calls) == (content or "", expected), label


def assert_consistent(small: ParsedOutput, big: ParsedOutput):
    assert big.content.startswith(small.content), (small.content, big.content)
    assert len(small.calls) <= len(big.calls)
    for a, b in zip(small.calls, big.calls):
        assert a.name is None or a.name == b.name
        assert b.arguments.startswith(a.arguments), (a.arguments, b.arguments)


def assert_well_formed(parsed: ParsedOutput):
    for call in parsed.calls:
        if call.complete:
            assert call.name is not None
            json.loads(call.arguments)


@pytest.mark.parametrize("name,case", ALL)
def test_every_prefix_is_consistent_with_longer_text(name, case):
    assert_contract(make(name), case.text)


def assert_contract(parser: ToolParser, text: str):
    # consecutive prefixes (consistency is transitive) and each prefix with the whole text, final or not
    whole, final = parser.parse(text, final=False), parser.parse(text, final=True)
    assert_consistent(whole, final)
    previous = parser.parse("", final=False)
    for end in range(1, len(text) + 1):
        parsed = parser.parse(text[:end], final=False)
        assert_well_formed(parsed)
        assert_well_formed(parser.parse(text[:end], final=True))
        assert_consistent(previous, parsed)
        assert_consistent(parsed, final)
        previous = parsed


def test_hermes_holds_back_what_may_be_markup():
    parser = HermesToolParser()
    assert parser.parse("Hello <tool", final=False) == ParsedOutput("Hello", [])
    assert parser.parse("Hello <tool", final=True) == ParsedOutput("Hello <tool", [])
    assert parser.parse("Hello <tool_call>", final=False).content == "Hello"
    assert len(parser.parse("Hello <tool_call>", final=False).calls) == 1
    parsed = parser.parse('<tool_call>{"name": "f", "arguments": {"a": 1', final=False)
    assert (parsed.calls[0].name, parsed.calls[0].arguments, parsed.calls[0].complete) == ("f", '{"a": 1', False)
    closed = parser.parse('<tool_call>{"name": "f", "arguments": {"a": 1}}</tool', final=False)
    assert (closed.calls[0].arguments, closed.calls[0].complete) == ('{"a": 1}', False)


def test_bare_tokens_stream_only_once_complete():
    parser = NamedToolParser("f")
    assert parser.parse("12", final=False).calls[0].arguments == ""
    assert parser.parse("12", final=True).calls[0] == parser.parse("12 ", final=False).calls[0]
    assert parser.parse("12", final=True).calls[0].arguments == "12"
    hermes = HermesToolParser()
    assert hermes.parse('<tool_call>{"name": "f", "arguments": 12', final=False).calls[0].arguments == ""
    assert hermes.parse('<tool_call>{"name": "f", "arguments": 12}', final=False).calls[0].arguments == "12"


def test_streamed_arguments_arrive_before_the_name_when_the_model_writes_them_first():
    parser = HermesToolParser()
    streamer = ToolCallStreamer(parser)
    assert streamer.feed('<tool_call>{"arguments": {"x": 1}, ').tool_calls == []
    deltas = streamer.feed('"name": "f"}').tool_calls
    assert [d["function"] for d in deltas] == [{"name": "f", "arguments": ""}, {"arguments": '{"x": 1}'}]
    assert streamer.feed("</tool_call>", final=True) == StreamDelta("", [])


@pytest.mark.parametrize("max_calls", [0, 1, 2, None])
def test_max_calls_drops_the_calls_past_the_first(max_calls):
    text = "".join(f'<tool_call>{{"name": "f{i}", "arguments": {{"i": {i}}}}}</tool_call>' for i in range(3))
    parser = HermesToolParser()
    expected = [(f"f{i}", f'{{"i": {i}}}') for i in range(3)][:max_calls]
    for label, chunks in chunkings(text):
        content, calls, streamer = stream(parser, chunks, ["<tool_call>"], max_calls)
        assert (content, calls) == ("", expected), label
        assert streamer.has_calls == (max_calls != 0)


def test_content_deltas_in_order():
    parser = HermesToolParser()
    streamer = ToolCallStreamer(parser)
    assert streamer.feed("Hi ").content == "Hi"
    assert streamer.feed("there <to").content == " there"
    assert streamer.feed("ol_call>").content == ""
    assert streamer.feed('{"name": "f"}</tool_call>\n').tool_calls[1]["function"] == {"arguments": "{}"}
    assert streamer.feed("bye", final=True).content == "\nbye"
    assert streamer.has_calls and [c.name for c in streamer.calls] == ["f"]


def test_get_tool_parser():
    assert sorted(TOOL_PARSERS) == ["gpt_oss", "hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder"]
    for name, cls in TOOL_PARSERS.items():
        for tools in (None, QWEN_TOOLS):
            parser = get_tool_parser(name, tools)
            assert type(parser) is cls and parser.name == name
        assert cls.reads_harmony == (name == "gpt_oss")
    with pytest.raises(ValueError, match="known: gpt_oss, hermes, llama3_json, mistral, pythonic, qwen3_coder"):
        get_tool_parser("nope")
    assert (HermesToolParser.needs_special_tokens, PythonicToolParser.needs_special_tokens) == (False, False)
    assert (Llama3JsonToolParser.needs_special_tokens, MistralToolParser.needs_special_tokens) == (True, True)
    # Qwen3-Coder's <tool_call> is an added token that is not special; harmony's markers are special
    assert (Qwen3CoderToolParser.needs_special_tokens, GptOssToolParser.needs_special_tokens) == (False, True)
    assert (RequiredToolsParser.name, NamedToolParser.name) == ("required", "named")


def test_new_call_id():
    ids = {new_call_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_json_scan():
    assert scan_value('{"a": "}", "b": [1, {"c": "\\""}]} tail', 0) == Scan(end=33)
    assert scan_value('{"a": [1}', 0) == Scan(error=8)
    assert scan_value('{"a": "x', 0).is_open
    assert scan_value("true,", 0) == Scan(end=4)
    assert scan_value("true", 0).is_open and scan_value("true", 0, final=True) == Scan(end=4)
    assert scan_value("}", 0) == Scan(error=0)
    assert scan_group("(a=')', b=[1, (2)])x", 0, python=True) == Scan(end=19)
    assert scan_group('(a="\\"", b=[)', 0, python=True) == Scan(error=12)
    assert value_prefix('{"a": 1', 0, Scan()) == '{"a": 1'
    assert value_prefix("12", 0, Scan()) == ""
    assert value_prefix('[1, 2}', 0, Scan(error=5)) == "[1, 2"


def test_content_helpers():
    assert cut_partial_marker("x <tool_c", "<tool_call>") == "x "
    assert cut_partial_marker("x <<tool_c", "<tool_call>") == "x <"
    assert cut_partial_marker("x <tool_call>", "<tool_call>") == "x <tool_call>"
    assert join_content([" a \n"], final=True) == " a \n"
    assert join_content([" a \n"], final=False) == " a"
    assert join_content(["a \n", "  ", " b ", "c "], final=True) == "a\nb\nc "


# ---- qwen3_coder: raw values typed by the request's tools -------------------------------------

@pytest.mark.parametrize("schema,raw,value", [
    ({"type": "string"}, "3", "3"),
    ({"type": "string"}, "null", "null"),
    ({"type": "string"}, "  spaced\n", "  spaced\n"),
    ({"type": ["string", "null"]}, "null", None),
    ({"type": "integer"}, " 42 ", 42),
    ({"type": "integer"}, "-7", -7),
    ({"type": "integer"}, "3.0", 3),
    ({"type": "integer"}, "three", "three"),
    ({"type": "integer"}, "3.5", "3.5"),
    ({"type": "number"}, "2.5", 2.5),
    ({"type": "number"}, "1e3", 1000.0),
    ({"type": "number"}, "7", 7),
    ({"type": "number"}, "inf", "inf"),
    ({"type": "number"}, "1e999", "1e999"),
    ({"type": "boolean"}, "True", True),
    ({"type": "boolean"}, "false", False),
    ({"type": "boolean"}, "yes", "yes"),
    ({"type": "null"}, "None", None),
    ({"type": "object"}, '{"a": [1, {"b": null}]}', {"a": [1, {"b": None}]}),
    ({"type": "object"}, "{'a': (1, 2), 'b': None, 'c': True}", {"a": [1, 2], "b": None, "c": True}),
    ({"type": "object"}, "{1, 2}", "{1, 2}"),
    ({"type": "object"}, "[1]", "[1]"),
    ({"type": "object"}, '{"a": NaN}', '{"a": NaN}'),
    ({"type": "array"}, "[1, 'x']", [1, "x"]),
    ({"type": "array"}, "[" * 100000, "[" * 100000),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}]}, "5", 5),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "5", 5),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "five", "five"),
    ({"enum": ["c", "f"]}, "c", "c"),
    ({"enum": [1, 2]}, "2", 2),
    ({"const": True}, "true", True),
    ({"type": "int"}, "5", 5),
    ({}, "true", True),
    (None, "42", 42),
    (None, "hello", "hello"),
    (None, ' {"a": 1} ', {"a": 1}),
    (None, "NaN", "NaN"),
])
def test_parameter_values_take_their_schemas_type(schema, raw, value):
    got = parameter_value(raw, schema)
    assert got == value and type(got) is type(value)
    json.dumps(got, allow_nan=False)


def test_schema_types():
    assert schema_types({"type": ["integer", "null"]}) == ["integer", "null"]
    assert schema_types({"anyOf": [{"type": "string"}, {"enum": [1, None]}]}) == ["string", "integer", "null"]
    assert schema_types({"$ref": "#/$defs/x"}) == [] and schema_types("string") == []


def test_qwen3_coder_types_values_by_the_requests_tools():
    text = xml_call("get_weather", ("city", "3"), ("days", "3"))
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                 "tools": QWEN_TOOLS})
    parser = plan_tools(body, "qwen3_coder").parser
    assert [json.loads(c.arguments) for c in extract_tool_calls(parser, text)[1]] == [{"city": "3", "days": 3}]
    # without the tools every value that is JSON is JSON
    untyped = get_tool_parser("qwen3_coder")
    assert [json.loads(c.arguments) for c in extract_tool_calls(untyped, text)[1]] == [{"city": 3, "days": 3}]


def test_qwen3_coder_streams_a_parameter_at_a_time():
    streamer = ToolCallStreamer(Qwen3CoderToolParser(QWEN_TOOLS))
    assert streamer.feed("Sure. <tool_call>\n<function=get_wea") == StreamDelta("Sure.", [])
    [announce] = streamer.feed("ther>\n<parameter=city>\nPar").tool_calls
    assert announce["function"] == {"name": "get_weather", "arguments": ""}
    assert streamer.feed("is\n</parameter").tool_calls == []
    deltas = streamer.feed(">\n<parameter=days>\n1").tool_calls
    assert [d["function"] for d in deltas] == [{"arguments": '{"city": "Paris"'}]
    # the last parameter and the function close in one delta
    assert [d["function"] for d in streamer.feed("2\n</parameter>\n</function>").tool_calls] == [
        {"arguments": ', "days": 12}'}]
    assert streamer.calls[0].arguments == '{"city": "Paris", "days": 12}'
    assert streamer.feed("\n</tool_call>", final=True) == StreamDelta("", [])


def test_qwen3_coder_holds_back_what_may_be_markup():
    parser = Qwen3CoderToolParser(QWEN_TOOLS)
    for tail in ("<tool_c", "<func", "<"):
        assert parser.parse("Hello " + tail, final=False) == ParsedOutput("Hello", [])
        assert parser.parse("Hello " + tail, final=True) == ParsedOutput("Hello " + tail, [])
    after = xml_call("ping", block=False) + "\n</tool"
    assert parser.parse(after, final=False).content == ""
    assert parser.parse(after, final=True).content == "</tool"


# ---- gpt_oss: calls are harmony messages to functions.NAME ------------------------------------

def test_gpt_oss_names_a_call_once_its_header_is_read():
    parser = GptOssToolParser()
    header = "<|channel|>commentary to=functions.get_weather <|constrain|>json"
    assert parser.parse(header, final=False).calls == []
    [call] = parser.parse(header + "<|message|>", final=False).calls
    assert (call.name, call.arguments, call.complete) == ("get_weather", "", False)
    [call] = parser.parse(header + '<|message|>{"city": "Paris"}<|ca', final=False).calls
    assert (call.arguments, call.complete) == ('{"city": "Paris"}', False)   # the message may go on
    [call] = parser.parse(header + '<|message|>{"city": "Paris"}<|call|>', final=False).calls
    assert call.complete


@pytest.mark.parametrize("case", GPT_OSS, ids=lambda c: c.id)
def test_gpt_oss_content_is_the_answer_the_chat_route_reads(case):
    assert GptOssToolParser().parse(case.text, final=True).content == parse_chat_output(case.text)[0]


# ---- any output, however malformed: no exception, and the contract holds -----------------------

FRAGMENTS = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>", ">", "\n",
             " ", "f", "x", "1", "{", "}", "[", "'", '"', "<", "</", "<|start|>", "<|channel|>", "<|message|>",
             "<|end|>", "<|call|>", "<|return|>", "<|constrain|>", "assistant", "commentary", "final", "analysis",
             " to=functions.f", " to=", "functions.", "json", "null", "true", "[TOOL_CALLS]", "[ARGS]", "(", ")",
             "<|python_tag|>", "<|python_start|>", ";", ",", ":", "="]


def mutated(text: str, rng: random.Random) -> str:
    """text with a few random cuts, insertions of markup fragments and repeats."""
    for _ in range(rng.randint(1, 3)):
        at = rng.randint(0, len(text))
        kind = rng.randrange(3)
        if kind == 0:
            text = text[:at] + text[at + rng.randint(1, 8):]
        elif kind == 1:
            text = text[:at] + rng.choice(FRAGMENTS) + text[at:]
        else:
            text = text[:at] + text[max(0, at - rng.randint(1, 12)):]
    return text


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_malformed_output_never_raises_and_keeps_the_contract(name):
    rng = random.Random(name)
    parser, cases = make(name), PARSERS[name][1]
    for k in range(150):
        if k % 2:   # a well-formed output of the format, damaged
            text = mutated(rng.choice(cases).text, rng)
        else:       # a soup of every format's markup
            text = "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 14)))
        assert_contract(parser, text)
        for call in extract_tool_calls(parser, text)[1]:
            assert call.name
            json.loads(call.arguments)
        for _, chunks in itertools.islice(chunkings(text), 3):
            stream(parser, chunks, [])


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_json_nested_past_pythons_limit_is_not_a_call_and_does_not_raise(name):
    """A model can write brackets deeper than json.loads can hold (RecursionError): such arguments
    are not valid JSON here, never an exception in the server."""
    deep = "[" * 50_000 + "]" * 50_000
    for text in (f'<tool_call>\n{{"name": "f", "arguments": {deep}}}\n</tool_call>',
                 f'[TOOL_CALLS][{{"name": "f", "arguments": {deep}}}]', f'{{"name": "f", "parameters": {deep}}}'):
        parser = TOOL_PARSERS[name]()
        extract_tool_calls(parser, text)
        ToolCallStreamer(parser).feed(text, final=True)
