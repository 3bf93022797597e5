"""Assembling content from the text between tool-call markup, and holding back a marker's start.

A parser cuts the output into pieces: ``pieces[0]`` is the text before the first markup and
``pieces[i]`` the text after markup i (up to the next). :func:`join_content` applies the content
conventions to them; :func:`cut_partial_marker` removes the start of a marker that may still come
from the end of a streamed text.
"""
from __future__ import annotations


def cut_partial_marker(text: str, marker: str) -> str:
    """text without its longest suffix that is a proper prefix of marker ("x <tool" -> "x ")."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return text[:-size]
    return text


def join_content(pieces: list[str], final: bool) -> str:
    """The content of the pieces between markup.

    Whitespace touching markup is dropped: every piece but the first is left-stripped, every piece
    but the last right-stripped, and the last one too while streaming (final=False), since markup
    may still follow it. The non-empty pieces are joined with "\\n". One piece (no markup) is
    returned as it is when final.
    """
    last = len(pieces) - 1
    kept = []
    for i, piece in enumerate(pieces):
        if i > 0:
            piece = piece.lstrip()
        if i < last or not final:
            piece = piece.rstrip()
        if piece:
            kept.append(piece)
    return "\n".join(kept)
