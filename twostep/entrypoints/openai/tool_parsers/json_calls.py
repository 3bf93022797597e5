"""Reading calls written as JSON objects, ``{"name": "f", "arguments": {...}}``, from partial text.

The arguments value may be under "arguments" or "parameters" (the first such key counts) and the
keys may come in any order. The name is known once its string is closed; the arguments are the raw
JSON text of their value as the model wrote it, as far as it is sure (see json_scan.value_prefix).
A call is complete when its object is closed and valid JSON with a string name; a complete call
without an arguments key gets "{}".
"""
from __future__ import annotations

import json
from dataclasses import dataclass

from twostep.entrypoints.openai.tool_parsers.base import ToolCallDraft
from twostep.entrypoints.openai.tool_parsers.json_scan import (Scan, decode_string, scan_string, scan_value,
                                                               skip_ws, value_prefix)

ARGUMENT_KEYS = ("arguments", "parameters")


@dataclass
class ObjectScan:
    draft: ToolCallDraft
    scan: Scan  # where the object ends


@dataclass
class ArrayScan:
    drafts: list[ToolCallDraft]  # one per object started
    scan: Scan  # where the array ends


@dataclass
class _Member:
    key: str | None  # None if the key is not a valid string
    start: int  # where the value starts
    scan: Scan  # where it ends


def _scan_members(text: str, pos: int) -> tuple[list[_Member], Scan]:
    """The members read so far of the object whose "{" is text[pos], and where the object ends."""
    members: list[_Member] = []
    i = skip_ws(text, pos + 1)
    if i < len(text) and text[i] == "}":
        return members, Scan(end=i + 1)
    while True:
        if i >= len(text):
            return members, Scan()
        if text[i] != '"':
            return members, Scan(error=i)
        key = scan_string(text, i)
        if key.end is None:
            return members, Scan()
        colon = skip_ws(text, key.end)
        if colon >= len(text) or text[colon] != ":":
            return members, Scan(error=colon if colon < len(text) else None)
        start = skip_ws(text, colon + 1)
        if start >= len(text):
            return members, Scan()
        value = scan_value(text, start)
        members.append(_Member(decode_string(text[i:key.end]), start, value))
        if value.end is None:
            return members, Scan(error=value.error)
        i = skip_ws(text, value.end)
        if i >= len(text):
            return members, Scan()
        if text[i] == "}":
            return members, Scan(end=i + 1)
        if text[i] != ",":
            return members, Scan(error=i)
        i = skip_ws(text, i + 1)


def _name(text: str, members: list[_Member]) -> str | None:
    for member in members:
        if member.key == "name":
            if member.scan.end is None or text[member.start] != '"':
                return None
            return decode_string(text[member.start:member.scan.end])
    return None


def _arguments(text: str, members: list[_Member]) -> str | None:
    for member in members:
        if member.key in ARGUMENT_KEYS:
            return value_prefix(text, member.start, member.scan)
    return None


def scan_call_object(text: str, pos: int) -> ObjectScan:
    """The call whose object starts with the "{" at text[pos]."""
    members, scan = _scan_members(text, pos)
    name, arguments = _name(text, members), _arguments(text, members)
    complete = False
    if scan.end is not None and name is not None:
        try:
            whole = json.loads(text[pos:scan.end])
        except (ValueError, RecursionError):     # nested past Python's limit: not JSON it can hold
            whole = None
        complete = isinstance(whole, dict) and whole.get("name") == name
        if complete and arguments is None:
            arguments = "{}"
    return ObjectScan(ToolCallDraft(name, arguments or "", complete), scan)


def scan_call_array(text: str, pos: int) -> ArrayScan:
    """The calls of the array ``[{...}, {...}]`` whose "[" is text[pos]."""
    drafts: list[ToolCallDraft] = []
    i = skip_ws(text, pos + 1)
    if i < len(text) and text[i] == "]":
        return ArrayScan(drafts, Scan(end=i + 1))
    while True:
        if i >= len(text):
            return ArrayScan(drafts, Scan())
        if text[i] != "{":
            return ArrayScan(drafts, Scan(error=i))
        obj = scan_call_object(text, i)
        drafts.append(obj.draft)
        if obj.scan.end is None:
            return ArrayScan(drafts, obj.scan)
        i = skip_ws(text, obj.scan.end)
        if i >= len(text):
            return ArrayScan(drafts, Scan())
        if text[i] == "]":
            return ArrayScan(drafts, Scan(end=i + 1))
        if text[i] != ",":
            return ArrayScan(drafts, Scan(error=i))
        i = skip_ws(text, i + 1)
