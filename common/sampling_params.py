"""What a request asks of the sampler (and which LoRA adapter its model runs with): one
frozen type from the router to the engine.

The router builds it from the validated OpenAI body (with ``max_tokens`` already resolved
against the config's default and the context left), it rides nested in ``SubmitRequest``,
``ReserveBlocks`` and ``PrefillTask`` (the codec in common/ipc.py decodes and validates it),
and the workers hand it to the engine's sampler as is. No torch, no zmq: the router, the
conductor and the engine all import it.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Optional

MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat (completions: 5)
MAX_CHOICES = 16  # n (or best_of) sequences of one request, sharing its prompt's KV
MAX_PENALTY = 2.0  # OpenAI's bound for presence_penalty and frequency_penalty
MAX_BIAS = 100.0  # and for a logit_bias value


@dataclass(frozen=True)
class SamplingParams:
    # No default: whoever builds a request decides how long it may run. 0: the prompt only
    # (the completions API's ``echo`` with ``max_tokens: 0``): no token is returned.
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: Optional[int] = None  # None = no top-k
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False  # logprob (raw model distribution) of each chosen token
    ignore_eos: bool = False
    top_logprobs: int = 0  # and the k most likely tokens at each position, with theirs
    # OpenAI's response_format as canonical JSON text (json_object, json_schema or an
    # xgrammar structural_tag: tool calls), or
    # None: free text. Text keeps the type frozen and hashable; common/grammar.py
    # compiles it (once per distinct value) into the grammar that masks each token.
    response_format: Optional[str] = None
    # Sequences to sample from the one prompt (OpenAI's ``n``, or ``best_of``): one
    # prefill, n first tokens, n decode sequences sharing the prompt's KV blocks.
    n: int = 1
    # OpenAI's penalties over the tokens this sequence generated so far, and logit_bias
    # (token ids and the bias added to each one's logit before sampling).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias_ids: tuple[int, ...] = ()
    logit_bias_values: tuple[float, ...] = ()
    # The prompt's own tokens' logprobs (the completions API's ``echo`` with ``logprobs:
    # k``): None, none; k, each prompt token's logprob and the k most likely tokens at its
    # position, computed by the prefill over the whole prompt (no cached prefix reused).
    prompt_logprobs: Optional[int] = None
    # A continuation (services/router/resume.py): the stream lost its decode worker after
    # these tokens reached the client and goes on from them. They end the prompt, and
    # count as generated: against max_tokens, in the penalties, the grammar and the stop
    # strings; the first ``resumed_chars`` characters of their text were sent already.
    resumed: tuple[int, ...] = ()
    resumed_chars: int = 0
    # The LoRA adapter the request's ``model`` names (ClusterConfig.lora_modules), None:
    # the base model. Not sampling, but it rides where sampling does: to the prefill that
    # computes the prompt and the decode that continues it.
    adapter: Optional[str] = None

    def __post_init__(self) -> None:
        """Reject impossible values at construction (a ValueError; the codec turns it into
        a ProtocolError). Lists given for ``stop``/``stop_token_ids`` are kept as tuples."""
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias_ids", tuple(self.logit_bias_ids))
        object.__setattr__(self, "logit_bias_values", tuple(self.logit_bias_values))
        object.__setattr__(self, "resumed", tuple(self.resumed))
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be None or >= 1, got {self.top_k}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got "
                             f"{self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs")
        if self.prompt_logprobs is not None and \
                not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be None or in [0, {MAX_TOP_LOGPROBS}], "
                             f"got {self.prompt_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise ValueError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], "
                                 f"got {getattr(self, name)}")
        if len(self.logit_bias_ids) != len(self.logit_bias_values) or \
                any(t < 0 for t in self.logit_bias_ids) or \
                any(not -MAX_BIAS <= v <= MAX_BIAS for v in self.logit_bias_values):
            raise ValueError(f"logit_bias needs one value in [-{MAX_BIAS:g}, {MAX_BIAS:g}] "
                             "per token id >= 0")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise ValueError(f"adapter must be None or a name, got {self.adapter!r}")
        if not 1 <= self.n <= MAX_CHOICES:
            raise ValueError(f"n must be in [1, {MAX_CHOICES}], got {self.n}")
        if self.response_format is not None:
            _check_response_format(self.response_format)
        if self.resumed and not (self.n == 1 and len(self.resumed) < self.max_tokens and
                                 self.resumed_chars >= 0 and self.prompt_logprobs is None):
            raise ValueError("a continuation has one choice, no prompt logprobs, and fewer "
                             "resumed tokens than max_tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def new_tokens(self) -> int:
        """The most tokens a sequence of it still generates (a continuation's resumed
        ones are generated already): what its decode KV grows by."""
        return self.max_tokens - len(self.resumed)

    @property
    def penalized(self) -> bool:
        """Its logits depend on what the sequence generated so far."""
        return bool(self.presence_penalty or self.frequency_penalty)

    def choice(self, index: int) -> SamplingParams:
        """The parameters of sequence ``index`` of ``n``: one sequence, and a seed of its
        own (``seed + index``), so each choice of a seeded request is reproducible and
        choice 0 is what the same request with ``n = 1`` samples."""
        if not 0 <= index < self.n:
            raise ValueError(f"choice {index} of a request with n={self.n}")
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


def _check_response_format(text: str) -> None:
    """The shape common/grammar.py relies on (the router built it; a malformed
    frame is refused here rather than on the worker's sampling path)."""
    try:
        fmt = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"response_format is not JSON: {exc}") from exc
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_schema" and isinstance(fmt.get("json_schema"), dict) and \
            isinstance(fmt["json_schema"].get("schema", {}), (dict, bool)):
        return
    if kind == "structural_tag" and isinstance(fmt.get("format"), dict):
        return
    if kind != "json_object":
        raise ValueError("response_format must be a json_object, json_schema or "
                         "structural_tag object")


@dataclass(frozen=True)
class TopLogprobs:
    """What the sampler saw at one position: the ``top_logprobs`` most likely tokens, best
    first, with their logprobs in the raw model distribution (before temperature, top-k
    or top-p), computed on the worker that sampled the token. Rides in ``KVReady`` and
    ``TokenDelta`` to the router."""

    token_ids: list[int]
    logprobs: list[float]

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError(f"{len(self.token_ids)} token ids for {len(self.logprobs)} "
                             "logprobs")


@dataclass(frozen=True)
class SampledToken:
    """One sampled token: its id, its logprob where asked, and its top alternatives where
    asked. ``KVReady`` carries one per choice of the request (the first tokens)."""

    token: int
    logprob: Optional[float] = None
    top: Optional[TopLogprobs] = None


@dataclass(frozen=True)
class PromptLogprobs:
    """The prompt's own tokens under the model (``SamplingParams.prompt_logprobs``): for
    positions 1 to n - 1 of an n-token prompt, the logprob of the prompt's token there
    given the tokens before it, and (k > 0) the k most likely tokens at that position.
    Position 0 has none (nothing precedes it). The raw distribution, as ``TopLogprobs``.
    Computed by the prefill worker; rides in ``KVReady`` and the first ``TokenDelta``."""

    logprobs: list[float]
    top: list[TopLogprobs] = field(default_factory=list)  # empty, or one per position

    def __post_init__(self) -> None:
        if self.top and len(self.top) != len(self.logprobs):
            raise ValueError(f"{len(self.top)} top alternatives for {len(self.logprobs)} "
                             "prompt positions")
