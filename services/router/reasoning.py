"""A thinking model's answer split into ``reasoning_content`` and ``content``, as vLLM's and
SGLang's reasoning parsers return it (``reasoning_parser`` in the cluster config; off by
default: the answer is all content, its tags included).

Two conventions, by who opens the ``<think>`` block:

- ``"qwen3"``: the answer opens it (Qwen 3, QwQ). The reasoning is the text of a
  ``<think>...</think>`` block at the answer's start (after any whitespace); an answer
  that does not start with one (``enable_thinking: false`` writes an empty block or none)
  is all content.
- ``"deepseek_r1"``: the chat template opened it in the prompt (DeepSeek-R1 and its
  distills), so the answer is reasoning from its first token until ``</think>`` (a
  ``<think>`` it writes again first is dropped); an answer cut off before ``</think>`` is
  all reasoning.

The text after ``</think>`` is content as written. Streamed, a tag split across deltas is
held back until it is whole or cannot be one, so each delta's two parts are exactly what
the whole answer splits into, cut where the deltas were (``finish`` gives what is held).
"""
from __future__ import annotations

from common.config import REASONING_PARSERS as PARSERS

OPEN, CLOSE = "<think>", "</think>"


def _partial(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that a ``tag`` begins with."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ThinkSplitter:
    """One answer's split, fed its text delta by delta."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {PARSERS}, not {parser!r}")
        self.reasoning_first = parser == "deepseek_r1"
        self.state = "start"  # "start" (the opening tag may still come) | "reasoning" | "content"
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) of ``text``, less what may be the start of a tag."""
        buf, self.held = self.held + text, ""
        reasoning = ""
        if self.state == "start":
            lead = buf.lstrip()
            if lead.startswith(OPEN):
                buf = lead[len(OPEN):]
                self.state = "reasoning"
            elif OPEN.startswith(lead):  # all whitespace, or the tag's beginning: wait
                self.held = buf
                return "", ""
            else:
                self.state = "reasoning" if self.reasoning_first else "content"
        if self.state == "reasoning":
            end = buf.find(CLOSE)
            if end < 0:
                keep = _partial(buf, CLOSE)
                self.held = buf[len(buf) - keep:]
                return buf[:len(buf) - keep], ""
            reasoning, buf = buf[:end], buf[end + len(CLOSE):]
            self.state = "content"
        return reasoning, buf

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) of what was held back, at the answer's end."""
        held, self.held = self.held, ""
        if self.state == "reasoning" or (self.state == "start" and self.reasoning_first):
            return held, ""
        return "", held
