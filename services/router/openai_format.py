"""OpenAI response objects: SSE chunks, final responses, usage, logprobs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import orjson

from common.protocol import TokenDelta
from common.sampling_params import PromptLogprobs, TopLogprobs
from services.router.errors import ApiError
from services.router.reasoning import ThinkSplitter

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


Alternatives = list[tuple[str, float]]  # one position's top tokens (text, logprob), best first


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}


def chat_logprobs(tokens: list[str], logprobs: list[float],
                  tops: list[Alternatives]) -> dict:
    return {"content": [{**_entry(t, lp), "top_logprobs": [_entry(a, alp) for a, alp in top]}
                        for t, lp, top in zip(tokens, logprobs, tops)]}


def completion_logprobs(tokens: list[str], logprobs: list[Optional[float]],
                        tops: list[Optional[Alternatives]], offset: int,
                        want_top: bool) -> dict:
    """The legacy shape; ``top_logprobs`` (``logprobs: k`` > 0) maps each position's
    alternatives' texts to their logprobs (two ids with one text keep the likelier). An
    echoed prompt's first token has neither: ``null`` in both lists."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    top = [None if alternatives is None else dict(reversed(alternatives))
           for alternatives in tops] if want_top else None
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top,
            "text_offset": offsets}


@dataclass
class ResponseBuilder:
    """Accumulates one choice of a request (``index``) and renders it as chunks or as
    one response (choices.py puts a request's n together)."""

    kind: str  # "chat" | "completion"
    request_id: str
    model: str
    created: int
    token_text: Callable[[int], str]  # one token id → its text (for logprobs)
    want_logprobs: bool = False
    want_top: int = 0  # top alternatives per position (top_logprobs / logprobs: k)
    include_usage: bool = False
    tool_call: Optional[str] = None  # the named function the text is the arguments of
    index: int = 0  # the choice
    echo: Optional[str] = None  # completions' ``echo``: the prompt's text, before the answer
    prompt_ids: list[int] = field(default_factory=list)  # with echo: the prompt's tokens
    prompt_logprobs: Optional[PromptLogprobs] = None  # with echo and logprobs: the worker's
    reasoning: Optional[str] = None  # chat: the reasoning parser (reasoning.py), if any
    texts: list[str] = field(default_factory=list)
    token_strs: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tops: list[Alternatives] = field(default_factory=list)
    text_len: int = 0
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cumulative_logprob: float = 0.0  # of the tokens sampled, where the wire carried them
    think: Optional[ThinkSplitter] = None  # with ``reasoning``: the answer's split so far
    reasoning_texts: list[str] = field(default_factory=list)
    content_texts: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.reasoning is not None and self.kind == "chat" and self.tool_call is None:
            self.think = ThinkSplitter(self.reasoning)

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created,
                "model": self.model}

    def _chunk(self, choice: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = self._head(obj)
        out["choices"] = [choice]
        if self.include_usage:
            out["usage"] = None
        return out

    def _logprobs_of(self, token_ids: list[int], lps: Optional[list[float]],
                     tops: Optional[list[TopLogprobs]], offset: int) -> Optional[dict]:
        if not self.want_logprobs or lps is None:
            return None
        toks = [self.token_text(t) for t in token_ids]
        alternatives = [[(self.token_text(t), lp) for t, lp in zip(top.token_ids, top.logprobs)]
                        for top in tops] if tops else [[] for _ in toks]
        self.token_strs += toks
        self.logprobs += lps
        self.tops += alternatives
        return self._render_logprobs(toks, lps, alternatives, offset)

    def _render_logprobs(self, toks: list[str], lps: list[float],
                         tops: list[Alternatives], offset: int) -> dict:
        if self.kind == "chat":
            return chat_logprobs(toks, lps, tops)
        return completion_logprobs(toks, lps, tops, offset, self.want_top > 0)

    def absorb(self, delta: TokenDelta) -> Optional[dict]:
        """Take one delta (counts are cumulative); return its content chunk, if any."""
        self.prompt_tokens = delta.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, delta.completion_tokens)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        self.cached_tokens = delta.cached_tokens
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        self.cumulative_logprob += sum(delta.logprobs or ())
        has_logprobs = self.want_logprobs and bool(delta.logprobs)
        chunk = None
        if delta.text or has_logprobs:
            chunk = self.add(delta.text, delta.token_ids, delta.logprobs, delta.top_logprobs)
        if delta.finish_reason is not None:
            chunk = self._flush(chunk, self.closing_delta())
        if chunk is not None and chunk["choices"][0].get("delta") == {} and \
                chunk["choices"][0]["logprobs"] is None:
            return None  # all of its text held back (a tag's beginning)
        return chunk

    def closing_delta(self) -> dict:
        """What the answer's last delta adds: the text its parsers held back."""
        return self._split_delta(*self.think.finish()) if self.think is not None else {}

    def _flush(self, chunk: Optional[dict], tail: dict) -> Optional[dict]:
        """``chunk`` (a new one if None) with ``tail``'s texts appended to its delta's."""
        if not tail:
            return chunk
        if chunk is None:
            chunk = self._chunk({"index": self.index, "delta": {}, "logprobs": None,
                                 "finish_reason": None})
        self.append(chunk["choices"][0]["delta"], tail)
        return chunk

    @staticmethod
    def append(delta: dict, more: dict) -> dict:
        """``delta`` with each of ``more``'s texts (or lists) appended to its own."""
        for key, value in more.items():
            old = delta.get(key)
            delta[key] = value if old is None else old + value
        return delta

    def _content_delta(self, content: str) -> dict:
        """A chat delta's part for ``content`` (tool_response.py splits out the calls)."""
        if self.think is not None:
            self.content_texts.append(content)
        return {"content": content}

    def _split_delta(self, reasoning: str, content: str) -> dict:
        """A chat delta of a reasoning answer's two parts (each only if written)."""
        delta = self._content_delta(content) if content else {}
        if reasoning:
            self.reasoning_texts.append(reasoning)
            delta["reasoning_content"] = reasoning
        return delta

    def _call(self, arguments: str) -> dict:
        """OpenAI's ``tool_calls`` entry for the named function (one call per answer)."""
        return {"id": f"call_{self.request_id}", "type": "function",
                "function": {"name": self.tool_call, "arguments": arguments}}

    def role_chunk(self) -> dict:
        delta: dict = {"role": "assistant", "content": ""}
        if self.tool_call is not None:  # the call's id and name first, then its arguments
            delta = {"role": "assistant", "content": None,
                     "tool_calls": [{"index": 0, **self._call("")}]}
        return self._chunk({"index": self.index, "delta": delta, "logprobs": None,
                            "finish_reason": None})

    def add(self, text: str, token_ids: list[int], lps: Optional[list[float]],
            tops: Optional[list[TopLogprobs]] = None) -> dict:
        """Record a delta; return its chunk (content only, no finish reason)."""
        offset = self.text_len
        self.texts.append(text)
        self.text_len += len(text)
        lp = self._logprobs_of(token_ids, lps, tops, offset)
        if self.tool_call is not None:
            choice = {"index": self.index, "delta": {"tool_calls": [
                {"index": 0, "function": {"arguments": text}}]}}
        elif self.think is not None:
            choice = {"index": self.index, "delta": self._split_delta(*self.think.feed(text))}
        elif self.kind == "chat":
            choice = {"index": self.index, "delta": self._content_delta(text)}
        else:
            choice = {"index": self.index, "text": text}
        choice.update(logprobs=lp, finish_reason=None)
        return self._chunk(choice)

    def finish_chunk(self) -> dict:
        choice: dict = {"index": self.index, "logprobs": None,
                        "finish_reason": self.finish_reason}
        if self.kind == "chat":
            choice["delta"] = {}
        else:
            choice["text"] = ""
        return self._chunk(choice)

    def usage_chunk(self, usage: dict) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = self._head(obj)
        out.update(choices=[], usage=usage)
        return out

    def _echoed(self) -> tuple[list[str], list[Optional[float]],
                               list[Optional[Alternatives]]]:
        """The echoed prompt's tokens, logprobs and alternatives (the first has none)."""
        got = self.prompt_logprobs
        if got is None or len(got.logprobs) != len(self.prompt_ids) - 1:
            raise ApiError(500, "the prompt's logprobs did not come back from the prefill "
                           "worker", code="internal_error")
        tops: list[Optional[Alternatives]] = [None]
        tops += [[(self.token_text(t), lp) for t, lp in zip(top.token_ids, top.logprobs)]
                 for top in got.top] if got.top else [[] for _ in got.logprobs]
        return ([self.token_text(t) for t in self.prompt_ids], [None, *got.logprobs], tops)

    def choice(self, index: int) -> dict:
        """The choice of the non-streaming response, at ``index`` (best_of renumbers)."""
        text = "".join(self.texts)
        lp: Optional[dict] = None
        if self.echo is not None and self.kind != "chat":
            text = self.echo + text
            if self.want_logprobs:
                toks, lps, tops = self._echoed()
                lp = completion_logprobs(toks + self.token_strs, lps + self.logprobs,
                                         tops + self.tops, 0, self.want_top > 0)
        elif self.want_logprobs:
            lp = self._render_logprobs(self.token_strs, self.logprobs, self.tops, 0)
        if self.kind == "chat":
            message: dict = {"role": "assistant", "content": text}
            if self.tool_call is not None:
                message = {"role": "assistant", "content": None,
                           "tool_calls": [self._call(text)]}
            elif self.think is not None:
                message = self.with_reasoning(
                    {"role": "assistant", "content": "".join(self.content_texts)})
            return {"index": index, "message": message, "logprobs": lp,
                    "finish_reason": self.finish_reason}
        return {"index": index, "text": text, "logprobs": lp,
                "finish_reason": self.finish_reason}

    def with_reasoning(self, message: dict) -> dict:
        """``message`` with the answer's ``reasoning_content`` (null when it had none)."""
        reasoning = "".join(self.reasoning_texts)
        return {**message, "reasoning_content": reasoning or None}

    def response(self, choices: list[dict], usage: dict) -> dict:
        """The non-streaming response object."""
        out = self._head("chat.completion" if self.kind == "chat" else "text_completion")
        out.update(choices=choices, usage=usage)
        return out
