"""OpenAI response objects: SSE chunks, final responses, usage, logprobs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import orjson

from common.protocol import TokenDelta

DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def chat_logprobs(tokens: list[str], logprobs: list[float]) -> dict:
    return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                         "top_logprobs": []} for t, lp in zip(tokens, logprobs)]}


def completion_logprobs(tokens: list[str], logprobs: list[float], offset: int) -> dict:
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": None,
            "text_offset": offsets}


@dataclass
class ResponseBuilder:
    """Accumulates one request's output and renders it as chunks or as one response."""

    kind: str  # "chat" | "completion"
    request_id: str
    model: str
    created: int
    token_text: Callable[[int], str]  # one token id → its text (for logprobs)
    want_logprobs: bool = False
    include_usage: bool = False
    texts: list[str] = field(default_factory=list)
    token_strs: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text_len: int = 0
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

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
                     offset: int) -> Optional[dict]:
        if not self.want_logprobs or lps is None:
            return None
        toks = [self.token_text(t) for t in token_ids]
        self.token_strs += toks
        self.logprobs += lps
        if self.kind == "chat":
            return chat_logprobs(toks, lps)
        return completion_logprobs(toks, lps, offset)

    def absorb(self, delta: TokenDelta) -> Optional[dict]:
        """Take one delta (counts are cumulative); return its content chunk, if any."""
        self.prompt_tokens = delta.prompt_tokens
        self.completion_tokens = max(self.completion_tokens, delta.completion_tokens)
        self.cached_tokens = delta.cached_tokens
        if delta.finish_reason is not None:
            self.finish_reason = delta.finish_reason
        has_logprobs = self.want_logprobs and bool(delta.logprobs)
        if not delta.text and not has_logprobs:
            return None
        return self.add(delta.text, delta.token_ids, delta.logprobs)

    def role_chunk(self) -> dict:
        return self._chunk({"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None})

    def add(self, text: str, token_ids: list[int], lps: Optional[list[float]]) -> dict:
        """Record a delta; return its chunk (content only, no finish reason)."""
        offset = self.text_len
        self.texts.append(text)
        self.text_len += len(text)
        lp = self._logprobs_of(token_ids, lps, offset)
        if self.kind == "chat":
            choice = {"index": 0, "delta": {"content": text}}
        else:
            choice = {"index": 0, "text": text}
        choice.update(logprobs=lp, finish_reason=None)
        return self._chunk(choice)

    def finish_chunk(self) -> dict:
        choice: dict = {"index": 0, "logprobs": None, "finish_reason": self.finish_reason}
        if self.kind == "chat":
            choice["delta"] = {}
        else:
            choice["text"] = ""
        return self._chunk(choice)

    def usage(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def usage_chunk(self) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = self._head(obj)
        out.update(choices=[], usage=self.usage())
        return out

    def response(self) -> dict:
        """The non-streaming response object."""
        text = "".join(self.texts)
        lp: Optional[dict] = None
        if self.want_logprobs:
            lp = (chat_logprobs(self.token_strs, self.logprobs) if self.kind == "chat"
                  else completion_logprobs(self.token_strs, self.logprobs, 0))
        if self.kind == "chat":
            out = self._head("chat.completion")
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": lp, "finish_reason": self.finish_reason}
        else:
            out = self._head("text_completion")
            choice = {"index": 0, "text": text, "logprobs": lp,
                      "finish_reason": self.finish_reason}
        out.update(choices=[choice], usage=self.usage())
        return out
