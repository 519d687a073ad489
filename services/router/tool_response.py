"""The response of ``tool_choice`` ``"auto"``/``"required"``: the answer's text split
into content and OpenAI ``tool_calls`` (tool_calls.py's ``CallSplitter``).

``TaggedCallsBuilder`` is a ``ResponseBuilder`` (openai_format.py) that reshapes what the
plain one renders: each text chunk's ``delta.content`` becomes the splitter's events
(content, and ``tool_calls`` entries: a call's first entry carries its ``id``, ``type``
and ``function.name``, then ``function.arguments`` deltas, each with the call's
``index``), the last delta flushes what the splitter held back, and the whole response's
message is ``{"role": "assistant", "content": <text or null>, "tool_calls": [...]}``.
``finish_reason`` is ``"tool_calls"`` when the answer made a call and ended by itself
(``"length"`` stays ``"length"``). Call ids are ``call_`` + 24 random hex digits, unique
per call.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from services.router.openai_format import ResponseBuilder
from services.router.tool_calls import CallSplitter, Event, SplitAnswer, collect


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def delta_of(events: list[Event], ids: list[str]) -> dict:
    """A chat chunk's ``delta`` for ``events`` (``ids``: each call's id, by index):
    content joined, one ``tool_calls`` entry per call the events touch."""
    delta: dict = {}
    entries: dict[int, dict] = {}
    for e in events:
        if e.kind == "content":
            delta["content"] = delta.get("content", "") + e.text
        elif e.kind == "call":
            entries[e.call] = {"index": e.call, "id": ids[e.call], "type": "function",
                               "function": {"name": e.text, "arguments": ""}}
        else:
            entry = entries.setdefault(e.call, {"index": e.call,
                                                "function": {"arguments": ""}})
            entry["function"]["arguments"] += e.text
    if entries:
        delta["tool_calls"] = list(entries.values())
    return delta


@dataclass
class TaggedCallsBuilder(ResponseBuilder):
    """A chat answer with ``<tool_call>`` blocks, as content and tool calls."""

    splitter: CallSplitter = field(default_factory=CallSplitter)
    answer: SplitAnswer = field(default_factory=lambda: SplitAnswer(None, []))
    call_ids: list[str] = field(default_factory=list)

    def _events(self, events: list[Event]) -> dict:
        collect(events, self.answer)
        self.call_ids += [new_call_id() for e in events if e.kind == "call"]
        return delta_of(events, self.call_ids)

    def role_chunk(self) -> dict:
        chunk = super().role_chunk()
        chunk["choices"][0]["delta"]["content"] = None  # content comes only if written
        return chunk

    def _content_delta(self, content: str) -> dict:
        return self._events(self.splitter.feed(content))

    def closing_delta(self) -> dict:
        """What the reasoning split and then the call splitter held back; a call made
        turns a ``"stop"`` into ``"tool_calls"``."""
        tail = self.append(super().closing_delta(), self._events(self.splitter.finish()))
        if self.answer.calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"
        return tail

    def choice(self, index: int) -> dict:
        out = super().choice(index)
        message: dict = {"role": "assistant", "content": self.answer.content}
        if self.answer.calls:
            message["tool_calls"] = [
                {"id": call_id, "type": "function",
                 "function": {"name": name, "arguments": arguments}}
                for call_id, (name, arguments) in zip(self.call_ids, self.answer.calls)]
        out["message"] = self.with_reasoning(message) if self.think is not None else message
        return out
