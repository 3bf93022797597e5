"""Scanning JSON (and Python-literal) text that may be cut off at any point.

A scan starts at the first character of a value and ends in one of three states:

- complete: ``end`` is the index just past the value;
- open: the text ends inside the value (``end`` and ``error`` are both None);
- broken: ``error`` is the index of the first character that cannot continue the value.

Only the structure is checked -- strings with their escapes, and the nesting of brackets -- so a
complete scan does not promise valid JSON (``{"a": }`` is complete); callers confirm with
``json.loads`` (see :func:`is_json`). What the scanners do is what the tool parsers need to know
where a value ends in a text that is still being generated.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

WHITESPACE = " \t\n\r"
_STRINGS = {'"': re.compile(r'"(?:[^"\\]|\\.)*"', re.S), "'": re.compile(r"'(?:[^'\\]|\\.)*'", re.S)}
_SCALAR = re.compile(r"[A-Za-z0-9+\-.]*")
_JSON_BRACKETS = {"{": "}", "[": "]"}
_PYTHON_BRACKETS = {"{": "}", "[": "]", "(": ")"}
_JSON_SPECIAL = re.compile(r'["\[\]{}]')
_PYTHON_SPECIAL = re.compile(r'["\'\[\](){}]')


@dataclass(frozen=True)
class Scan:
    """Where a value ends: ``end`` if complete, ``error`` if broken, neither while open."""

    end: int | None = None
    error: int | None = None

    @property
    def is_open(self) -> bool:
        return self.end is None and self.error is None

    def resume(self, length: int) -> int:
        """Where reading goes on after the value: its end, its error, or the end of the text."""
        if self.end is not None:
            return self.end
        return self.error if self.error is not None else length


def skip_ws(text: str, pos: int) -> int:
    """The index of the first non-whitespace character at or after pos (len(text) if none)."""
    while pos < len(text) and text[pos] in WHITESPACE:
        pos += 1
    return pos


def scan_string(text: str, pos: int) -> Scan:
    """A string whose opening quote (" or ') is text[pos]; backslash escapes the next character."""
    match = _STRINGS[text[pos]].match(text, pos)
    return Scan(end=match.end()) if match else Scan()


def scan_group(text: str, pos: int, python: bool = False) -> Scan:
    """A bracketed group whose opening bracket is text[pos].

    JSON groups are {...} and [...] with "..." strings; with python=True also (...) and '...'
    strings. A closing bracket that does not match the innermost open one breaks the group.
    (Python's triple-quoted strings are not understood.)
    """
    special, pairs = (_PYTHON_SPECIAL, _PYTHON_BRACKETS) if python else (_JSON_SPECIAL, _JSON_BRACKETS)
    stack: list[str] = []
    i = pos
    while match := special.search(text, i):
        i, char = match.start(), match.group()
        if char in "\"'":
            string = scan_string(text, i)
            if string.end is None:
                return Scan()
            i = string.end
            continue
        if char in pairs:
            stack.append(pairs[char])
        elif not stack or char != stack[-1]:
            return Scan(error=i)
        else:
            stack.pop()
            if not stack:
                return Scan(end=i + 1)
        i += 1
    return Scan()


def scan_scalar(text: str, pos: int, final: bool = False) -> Scan:
    """A bare token (number, true, false, null) at pos: it ends at the first character that cannot
    be part of one; reaching the end of the text leaves it open unless the text is final."""
    end = _SCALAR.match(text, pos).end()
    if end == pos:
        return Scan(error=pos)
    if end == len(text) and not final:
        return Scan()
    return Scan(end=end)


def scan_value(text: str, pos: int, final: bool = False) -> Scan:
    """Any JSON value starting at text[pos] (pos < len(text), no leading whitespace)."""
    char = text[pos]
    if char in "{[":
        return scan_group(text, pos)
    if char == '"':
        return scan_string(text, pos)
    return scan_scalar(text, pos, final)


def value_prefix(text: str, start: int, scan: Scan) -> str:
    """The raw text of the value at start that is sure to begin its final text.

    Complete: the whole value. Broken: up to the error. Open: what there is of an object, array or
    string, but nothing of a bare token, whose end is not known yet (``1`` may become ``10``).
    """
    if scan.end is not None:
        return text[start:scan.end]
    if scan.error is not None:
        return text[start:scan.error]
    if start < len(text) and text[start] in '{["':
        return text[start:]
    return ""


def is_json(text: str) -> bool:
    """Whether text is one valid JSON value."""
    try:
        json.loads(text)
    except (ValueError, RecursionError):     # nested past Python's limit: not JSON it can hold
        return False
    return True


def decode_string(raw: str) -> str | None:
    """The value of a complete JSON string literal, None if it is not a valid one."""
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):     # nested past Python's limit: not JSON it can hold
        return None
    return value if isinstance(value, str) else None
