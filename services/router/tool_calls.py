"""Tool calls as the model writes them: ``<tool_call>{"name": N, "arguments": A}</tool_call>``
blocks in its text (``tool_choice`` ``"auto"`` and ``"required"``; structured.py builds the
grammar that forces a block's JSON to name a tool and to follow its parameters, once the
model wrote ``<tool_call>``).

Three pure pieces: the system text that shows the tools to a model whose chat template
ignores them (``tools_prompt``), one call as the model writes it (``call_text``: the
grammar's shape, and the history's), and ``CallSplitter``, which turns the answer's text,
fed in any pieces, into events: content text, a call's start (its name), its arguments'
text. The same splitter serves streamed and whole answers, so both give the same content
and the same calls however the text was cut.

Content is the text outside the blocks with its leading and trailing whitespace dropped
(so a newline between two calls is not content); streamed, trailing whitespace is held
until more content follows, and a text end that may be the start of ``<tool_call>`` is
held until the next piece tells.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*'
                     r"(?=\S)")
_MAX_HEADER = 160  # characters; a longer text after <tool_call> is not a call's header
_TAIL = "}" + CALL_END  # the call object's own brace, then the end tag

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query. The functions, one JSON \
signature per line, within <tools></tools>:
<tools>
{signatures}
</tools>

To call a function, write its name and arguments as one JSON object within \
<tool_call></tool_call>:
<tool_call>{{"name": <function-name>, "arguments": <arguments-json-object>}}</tool_call>"""


def tools_prompt(functions: list[dict]) -> str:
    """The system text that lists ``functions`` (OpenAI's ``function`` objects) and the
    call format, for chat templates that do not render ``tools`` themselves."""
    lines = [json.dumps({"type": "function", "function": fn}) for fn in functions]
    return TOOLS_PROMPT.format(signatures="\n".join(lines))


def call_begin(name: str) -> str:
    """A call's text up to its arguments (the grammar's tag begin)."""
    return f'{CALL_BEGIN}{{"name": {json.dumps(name)}, "arguments": '


def call_text(name: str, arguments: str) -> str:
    """One call as the model writes it (``arguments``: JSON text)."""
    return call_begin(name) + arguments + _TAIL


@dataclass(frozen=True)
class Event:
    """``kind``: ``content`` (text), ``call`` (a call starts; text is its name) or
    ``arguments`` (more of call ``call``'s arguments)."""

    kind: str
    text: str
    call: int = -1


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


@dataclass
class CallSplitter:
    """The answer's text → events. States: ``text`` (content; watching for
    ``<tool_call>``), ``header`` (after it, until the name and ``"arguments":``),
    ``arguments`` (the arguments' JSON, until its value closes: a scan of strings and
    brackets, so ``</tool_call>`` inside a string does not end it) and ``tail`` (the
    closing ``}</tool_call>``). Text that turns out not to be a call is content."""

    state: str = "text"
    calls: int = 0  # calls started
    _buf: str = ""
    _started: bool = False  # content had a non-whitespace character
    _pending_ws: str = ""
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _out: list[Event] = field(default_factory=list)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        while self._buf and self._step():
            pass
        return self._take()

    def finish(self) -> list[Event]:
        """Events of the text held back, at the end of the answer: a possible start of
        ``<tool_call>``, or a header that never completed, is content."""
        if self.state == "header":
            self._content(CALL_BEGIN + self._buf)
        elif self.state == "text":
            self._content(self._buf)
        self._buf = ""
        return self._take()

    def _take(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def _content(self, text: str) -> None:
        if not self._started:
            text = text.lstrip()
            if not text:
                return
            self._started = True
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        if body:
            self._out.append(Event("content", body))

    def _step(self) -> bool:
        """Consume what the buffer allows in the current state; False: wait for more."""
        return {"text": self._text, "header": self._header, "arguments": self._arguments,
                "tail": self._tail}[self.state]()

    def _text(self) -> bool:
        i = self._buf.find(CALL_BEGIN)
        if i >= 0:
            self._content(self._buf[:i])
            self._buf, self.state = self._buf[i + len(CALL_BEGIN):], "header"
            return True
        keep = _partial_suffix(self._buf, CALL_BEGIN)
        self._content(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _header(self) -> bool:
        m = _HEADER.match(self._buf)
        if m is not None:
            self._out.append(Event("call", m.group(1), self.calls))
            self.calls += 1
            self._buf, self.state = self._buf[m.end():], "arguments"
            self._depth, self._in_string, self._escape = 0, False, False
            return True
        if len(self._buf) > _MAX_HEADER or CALL_END in self._buf:  # not a call after all
            self._content(CALL_BEGIN)
            self.state = "text"
            return True
        return False

    def _arguments(self) -> bool:
        end = self._scan(self._buf)
        if end is None:
            self._out.append(Event("arguments", self._buf, self.calls - 1))
            self._buf = ""
            return False
        if end:
            self._out.append(Event("arguments", self._buf[:end], self.calls - 1))
        self._buf, self.state = self._buf[end:], "tail"
        return True

    def _scan(self, text: str) -> Optional[int]:
        """Where the arguments' JSON value ends in ``text`` (at the call object's closing
        brace), or None if it goes on."""
        for i, c in enumerate(text):
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                continue
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c == "}" and self._depth == 0:
                return i
            elif c in "}]" and self._depth > 0:
                self._depth -= 1
        return None

    def _tail(self) -> bool:
        if self._buf.startswith(_TAIL):
            self._buf, self.state = self._buf[len(_TAIL):], "text"
            return True
        if _TAIL.startswith(self._buf):
            return False
        self._buf = self._buf.removeprefix("}")  # no end tag: what follows is content
        self.state = "text"
        return True


@dataclass
class SplitAnswer:
    """A whole answer split: its content (None when empty) and its calls (name,
    arguments)."""

    content: Optional[str]
    calls: list[tuple[str, str]]


def collect(events: list[Event], answer: SplitAnswer) -> None:
    """Add ``events`` to ``answer``."""
    for e in events:
        if e.kind == "content":
            answer.content = (answer.content or "") + e.text
        elif e.kind == "call":
            answer.calls.append((e.text, ""))
        else:
            name, args = answer.calls[e.call]
            answer.calls[e.call] = (name, args + e.text)


def split_answer(text: str) -> SplitAnswer:
    """The content and calls of a whole answer (what the streamed events add up to)."""
    splitter, answer = CallSplitter(), SplitAnswer(None, [])
    collect(splitter.feed(text) + splitter.finish(), answer)
    return answer
