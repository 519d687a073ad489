"""A request's choices: OpenAI's ``n`` and the completions API's ``best_of``.

The cluster samples ``best_of`` sequences (``n`` when it is not given) from one prefill:
the decode worker runs them side by side over the prompt's shared KV blocks, and each
streams its tokens tagged with its choice (``TokenDelta.index``). Here each choice has its
own ``ResponseBuilder``; a streamed answer interleaves their chunks as the tokens come
and ends each choice with its own finish chunk; a whole one lists the choices in order.
With ``best_of`` > ``n`` the ``n`` of highest cumulative logprob (the sum over its sampled
tokens) are returned, renumbered from 0, as OpenAI does; ``usage.completion_tokens``
counts every token sampled, the discarded choices' too (they were computed).
"""
from __future__ import annotations

from typing import Optional

from common.protocol import TokenDelta
from services.router.openai_format import ResponseBuilder, usage


class Choices:
    def __init__(self, builders: list[ResponseBuilder], returned: int) -> None:
        if not 1 <= returned <= len(builders):
            raise ValueError(f"{returned} choices returned of {len(builders)} sampled")
        self.builders = builders
        self.returned = returned

    @property
    def first(self) -> ResponseBuilder:
        return self.builders[0]

    @property
    def prompt_tokens(self) -> int:
        return self.first.prompt_tokens

    @property
    def cached_tokens(self) -> int:
        return self.first.cached_tokens

    def of(self, delta: TokenDelta) -> ResponseBuilder:
        return self.builders[delta.index]

    def role_chunks(self) -> list[dict]:
        return [b.role_chunk() for b in self.builders]

    def take(self, delta: TokenDelta) -> None:
        """Take one choice's delta (a whole answer); the prompt's logprobs, which come in
        choice 0's first delta, go to every choice (each echoes the prompt)."""
        if delta.prompt_logprobs is not None:
            for b in self.builders:
                b.prompt_logprobs = delta.prompt_logprobs
        self.of(delta).absorb(delta)

    def absorb(self, delta: TokenDelta) -> list[dict]:
        """Take one choice's delta; its chunks to stream: content, then its finish."""
        builder = self.of(delta)
        chunk = builder.absorb(delta)
        chunks = [chunk] if chunk is not None else []
        if delta.finish_reason is not None:
            chunks.append(builder.finish_chunk())
        return chunks

    def usage(self) -> dict:
        return usage(self.prompt_tokens, sum(b.completion_tokens for b in self.builders),
                     self.cached_tokens)

    def usage_chunk(self) -> Optional[dict]:
        return self.first.usage_chunk(self.usage()) if self.first.include_usage else None

    def best(self) -> list[ResponseBuilder]:
        """The choices to return: all of them in order, or the ``returned`` likeliest."""
        if self.returned == len(self.builders):
            return self.builders
        ranked = sorted(self.builders, key=lambda b: (-b.cumulative_logprob, b.index))
        return ranked[:self.returned]

    def choices(self, base: int = 0) -> list[dict]:
        """The returned choices, numbered from ``base`` (a batch of prompts: prompt i's
        from i × n, as OpenAI numbers them)."""
        return [b.choice(base + i) for i, b in enumerate(self.best())]

    def response(self) -> dict:
        """The non-streaming response object."""
        return self.first.response(self.choices(), self.usage())
