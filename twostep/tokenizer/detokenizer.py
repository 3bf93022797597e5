"""Incremental detokenisation for streaming: ids in, safe text deltas out, stop strings cut.

One IncrementalDetokenizer per generated sequence. The engine feeds each step's new ids to
update(), hands get_delta() to the client, and calls flush() when the sequence finishes.

Two things are held back from the client until they are settled:
  * bytes of a character not yet complete (the decode stream does not hand them out), and
  * the last (longest stop string - 1) characters, which might be the start of a stop string
    that the next tokens complete; a stop string is never partly streamed and then retracted.
"""
from __future__ import annotations

from twostep.tokenizer.tokenizer import Tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False, skip_special_tokens: bool = True):
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        self._stream = tokenizer.new_decode_stream(skip_special_tokens=skip_special_tokens)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.output_text: str = ""
        self.stop_reason: str | None = None  # the stop string that ended the text, if any
        self._sent = 0                       # chars of output_text already handed out
        self._flushed = False

    @property
    def finished(self) -> bool:
        """True once a stop string matched or flush() ran; further ids are ignored."""
        return self.stop_reason is not None or self._flushed

    def update(self, new_token_ids: list[int], check_stop: bool = True) -> str | None:
        """Feed newly generated ids. Returns the stop string if one now appears in the text (the text
        is cut before it, or after it with include_stop_str_in_output), else None.

        check_stop=False appends without looking for stop strings (for tokens generated before
        min_tokens is reached, where a stop string must not end the sequence)."""
        if self.finished:
            return None
        piece = self._stream.step(new_token_ids)
        return self._append(piece, check_stop)

    def get_delta(self) -> str:
        """Text not handed out yet, minus what must still be held back."""
        end = len(self.output_text)
        if not self.finished:
            end = max(self._sent, end - self._hold)
        delta = self.output_text[self._sent:end]
        self._sent = end
        return delta

    def flush(self) -> str:
        """At finish: decode any ids still held (a trailing partial character), release everything
        held back, and return what the client has not seen yet."""
        if not self.finished:
            self._append(self._stream.flush())
            self._flushed = True
        return self.get_delta()

    def _append(self, piece: str, check_stop: bool = True) -> str | None:
        if not piece:
            return None
        old_len = len(self.output_text)
        self.output_text += piece
        if not self.stop or not check_stop:
            return None
        hit = self._find_stop(old_len)
        if hit is None:
            return None
        start, stop = hit
        cut = start + len(stop) if self.include_stop_str_in_output else start
        self.output_text = self.output_text[:cut]
        self.stop_reason = stop
        return stop

    def _find_stop(self, old_len: int) -> tuple[int, str] | None:
        """The stop string occurrence that ends first in the text (ties: the one starting first,
        i.e. the longer one), looking only where a new match can be: the new text plus, for each
        stop string s, the len(s) - 1 characters before it. Choosing by end position makes the
        result independent of how the text was split into updates."""
        text = self.output_text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stop:
            start = text.find(s, max(0, old_len - len(s) + 1))
            if start < 0:
                continue
            key = (start + len(s), start, s)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])
