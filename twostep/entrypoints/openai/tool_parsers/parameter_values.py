"""The JSON value of a parameter written as raw text (qwen3_coder's ``<parameter=days>3</parameter>``).

Such formats write every value bare -- ``Paris``, ``3``, ``true``, ``{"a": 1}`` -- so its type
comes from the tool's parameter schema, as vLLM's qwen3_coder parser reads it:

- string: the text as written;
- integer, number, boolean, null: the text parsed (``3``, ``-1.5e3``, ``True``, ``null``);
- object, array: the text as JSON, or as a Python literal (``{'a': None}``), which models also write;
- several types (``["integer", "null"]``, anyOf, oneOf, an enum's values): the first one the text
  parses as, string last;
- no schema (an unknown tool or parameter), or no type in it: JSON if the text is JSON, else the
  string.

Text that parses as none of the schema's types stays a string: the client sees what the model wrote
(and its validation can refuse it) rather than losing it.
"""
from __future__ import annotations

import ast
import json
import re

_ALIASES = {"str": "string", "text": "string", "int": "integer", "float": "number", "double": "number",
            "bool": "boolean", "dict": "object", "list": "array", "none": "null"}
_INTEGER = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_NOT_PARSED = object()


def parameter_value(raw: str, schema: dict | None) -> object:
    """The JSON value (json.dumps can write it) of raw, a parameter's text, for its schema."""
    types = schema_types(schema)
    if not types:
        return _json_or_string(raw)
    for kind in sorted(types, key=lambda t: t == "string"):
        if kind == "string":
            return raw
        parse = _PARSERS.get(kind, _json_value)
        value = parse(raw.strip())
        if value is not _NOT_PARSED:
            return value
    return raw


def schema_types(schema: object) -> list[str]:
    """The JSON types a schema allows, in its order: its "type" (or the types of its enum or const
    values) and those of its anyOf and oneOf alternatives."""
    if not isinstance(schema, dict):
        return []
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    types = [_ALIASES.get(k.lower(), k.lower()) for k in kinds if isinstance(k, str)]
    if not types:
        values = schema.get("enum") if isinstance(schema.get("enum"), list) else []
        types = [_type_of(v) for v in values + ([schema["const"]] if "const" in schema else [])]
    for key in ("anyOf", "oneOf"):
        alternatives = schema.get(key)
        for alternative in alternatives if isinstance(alternatives, list) else []:
            types += schema_types(alternative)
    return list(dict.fromkeys(types))


def _type_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    return {float: "number", str: "string", dict: "object", list: "array"}.get(type(value), "string")


def _json_or_string(raw: str) -> object:
    value = _json_value(raw.strip())
    return raw if value is _NOT_PARSED else value


def _json_value(text: str) -> object:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return _NOT_PARSED
    return value if _writable(value) else _NOT_PARSED


def _writable(value: object) -> bool:
    """Whether the value is JSON (no NaN or infinity, no tuple keys, no sets)."""
    try:
        json.dumps(value, allow_nan=False)
    except (ValueError, TypeError, RecursionError):
        return False
    return True


def _integer(text: str) -> object:
    if _INTEGER.fullmatch(text):
        return int(text)
    number = _number(text)
    return int(number) if isinstance(number, float) and number.is_integer() else _NOT_PARSED


def _number(text: str) -> object:
    if not _NUMBER.fullmatch(text):
        return _NOT_PARSED
    if _INTEGER.fullmatch(text):
        return int(text)
    value = float(text)
    return value if _writable(value) else _NOT_PARSED   # 1e999 is infinity


def _boolean(text: str) -> object:
    return {"true": True, "false": False}.get(text.lower(), _NOT_PARSED)


def _null(text: str) -> object:
    return None if text.lower() in ("null", "none") else _NOT_PARSED


def _container(kind: type):
    def parse(text: str) -> object:
        value = _json_value(text)
        if value is _NOT_PARSED:
            try:
                value = ast.literal_eval(text)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return _NOT_PARSED
            if not _writable(value):
                return _NOT_PARSED
            value = json.loads(json.dumps(value))   # tuples become lists
        return value if isinstance(value, kind) else _NOT_PARSED
    return parse


_PARSERS = {"integer": _integer, "number": _number, "boolean": _boolean, "null": _null,
            "object": _container(dict), "array": _container(list)}
