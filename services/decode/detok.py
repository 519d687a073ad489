"""Incremental detokenization with stop strings, as the decode worker streams tokens."""
from __future__ import annotations

from typing import Callable, Optional, Sequence


class IncrementalText:
    """Turns a growing list of token ids into text deltas.

    Text is re-decoded from a window that starts a few tokens back, so multi-byte
    characters split across tokens are emitted only once complete. Stop strings are
    searched in the whole text; text that could still become a stop string is held back.
    """

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]) -> None:
        self._decode = decode
        self.stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # all text so far (stop string excluded once found)
        self.sent = 0  # characters already emitted
        self._start = 0  # ids[_start:] is the window re-decoded on each token
        self._start_text = ""  # decode(ids[_start:_done]): the window's already-known text
        self._done = 0  # ids[:_done] are in self.text

    @classmethod
    def resuming(cls, decode: Callable[[list[int]], str], stop: list[str],
                 ids: Sequence[int] = (), sent_chars: int = 0) -> IncrementalText:
        """Text that goes on after ``ids``, whose first ``sent_chars`` characters were
        emitted (by the decode worker a continuation replaces): replayed, so what was held
        back (a possible stop string's start, an incomplete character) comes out next."""
        text = cls(decode, stop)
        for token in ids:
            text.add(token)
        text.sent = min(sent_chars, len(text.text))
        return text

    def add(self, token_id: int) -> tuple[str, bool]:
        """Append one token; return (new text to emit, whether a stop string matched)."""
        self.ids.append(token_id)
        window = self._decode(self.ids[self._start:])
        if window.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more
            return "", False
        hit = self._take(window)
        # The next window starts where this one's new tokens began, so a token's text is
        # always decoded with its predecessor (merges, leading spaces) and cost stays flat.
        self._start, self._done = self._done, len(self.ids)
        self._start_text = self._decode(self.ids[self._start:self._done])
        if hit:
            return self._flush(), True
        limit = len(self.text) - self._hold if self.stop else len(self.text)
        if limit <= self.sent:
            return "", False
        delta = self.text[self.sent:limit]
        self.sent = limit
        return delta, False

    def _find_stop(self) -> Optional[int]:
        start = max(0, self.sent - self._hold)
        found = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        return min(found) if found else None

    def finish(self) -> str:
        """Everything not yet emitted (at the end of generation): text held back for a
        stop string that can no longer come, and the last tokens' incomplete character,
        as the tokenizer decodes it (U+FFFD), as the whole answer's decode would end."""
        if self._done < len(self.ids):
            self._take(self._decode(self.ids[self._start:]))
            self._done = len(self.ids)
        return self._flush()

    def _take(self, window: str) -> bool:
        """Append the new text of ``window`` (the decode of ids[_start:]); cut the text at
        a stop string, if one is now in it (True)."""
        self.text += window[len(self._start_text):]
        hit = self._find_stop()
        if hit is not None:
            self.text = self.text[:hit]
        return hit is not None

    def _flush(self) -> str:
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta
