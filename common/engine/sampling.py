"""Sampling: greedy, temperature, top-k, top-p, per-request seeded generators, logprobs
and top alternatives, and a grammar's token bitmask (common/grammar.py).

The parameters are common/sampling_params.py's ``SamplingParams``, the very object the
router validated and the wire carried."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from common.grammar import Grammars, apply_bitmask
from common.sampling_params import SampledToken, SamplingParams, TopLogprobs


def _filter(logits: torch.Tensor, top_k: Optional[int], top_p: float) -> torch.Tensor:
    """Row logits with everything outside top-k / top-p set to -inf."""
    if top_k is not None and 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


@dataclass
class Sampled:
    """One step's choices: a token per row, and where asked its logprob and the top
    alternatives (``TopLogprobs``)."""

    tokens: list[int]
    logprobs: list[Optional[float]]
    top: list[Optional[TopLogprobs]]

    def __iter__(self) -> Iterator[tuple[int, Optional[float], Optional[TopLogprobs]]]:
        return iter(zip(self.tokens, self.logprobs, self.top))


def _adjust(logits: torch.Tensor, params: Sequence[SamplingParams],
            outputs: Optional[Sequence[Sequence[int]]]) -> torch.Tensor:
    """The logits to choose from: each row's ``logit_bias`` added, then OpenAI's penalties
    over the tokens the row's sequence generated so far (``outputs``): ``logit −
    frequency_penalty × count − presence_penalty × (count > 0)``. ``logits`` itself is
    left alone (the logprobs stay the model's)."""
    vocab = logits.shape[-1]
    rows = [i for i, p in enumerate(params) if p.logit_bias_ids or
            (p.penalized and outputs is not None and outputs[i])]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        p = params[i]
        if p.logit_bias_ids:  # ids the router checked against the vocabulary
            ids = [t for t in p.logit_bias_ids if t < vocab]
            out[i, ids] += torch.tensor(p.logit_bias_values[:len(ids)], dtype=out.dtype,
                                        device=out.device)
        if p.penalized and outputs is not None and outputs[i]:
            seen = torch.as_tensor([t for t in outputs[i] if t < vocab], device=out.device)
            counts = torch.bincount(seen, minlength=vocab).to(out.dtype)
            out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    return out


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[Optional[torch.Generator]],
           bitmask: Optional[torch.Tensor] = None,
           outputs: Optional[Sequence[Sequence[int]]] = None) -> Sampled:
    """Choose one token per row of logits [B, V] among those ``bitmask`` allows (a
    grammar's; None allows all), after each row's logit_bias and penalties over its
    ``outputs`` so far (``_adjust``); also its logprob and the top alternatives where
    asked. Logprobs are the model's, as OpenAI reports them: the raw distribution
    (log_softmax of the unmasked, unbiased logits), so a forbidden token can appear among
    the alternatives."""
    logits = logits.float()
    choose = _adjust(logits, params, outputs)
    choose = choose if bitmask is None else apply_bitmask(choose, bitmask)
    tokens = _choose(choose, params, generators)
    out = Sampled(tokens, [None] * len(params), [None] * len(params))
    want = [i for i, p in enumerate(params) if p.logprobs]
    if want:  # one copy to the host for the chosen tokens' logprobs, one for the tops
        lp = torch.log_softmax(logits[want], dim=-1)
        picked = torch.tensor([tokens[i] for i in want], device=lp.device)
        out.logprobs = [None] * len(params)
        for i, v in zip(want, lp.gather(1, picked[:, None])[:, 0].tolist()):
            out.logprobs[i] = v
        k = max(params[i].top_logprobs or 0 for i in want)
        if k:
            best = torch.topk(lp, k)
            for j, (ids, values) in enumerate(zip(best.indices.tolist(), best.values.tolist())):
                n = params[want[j]].top_logprobs
                if n:
                    out.top[want[j]] = TopLogprobs(ids[:n], values[:n])
    return out


def _choose(choose: torch.Tensor, params: Sequence[SamplingParams],
            generators: Sequence[Optional[torch.Generator]]) -> list[int]:
    """A token per row, all copied to the host at once (a GPU worker's step waits on one
    copy, not one per row): greedy rows by argmax, the others by ``draw``, the unseeded
    rows together, a seeded row with a uniform from its own generator (drawn where that
    generator lives: the same token on any device)."""
    if all(p.greedy for p in params):
        return choose.argmax(-1).tolist()
    chosen = torch.empty(len(params), dtype=torch.long, device=choose.device)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    if greedy_rows:
        chosen[greedy_rows] = choose[greedy_rows].argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    probs = torch.stack([_filter(choose[i] / params[i].temperature, params[i].top_k,
                                 params[i].top_p).softmax(-1) for i in rows])
    uniforms = torch.empty(len(rows), dtype=torch.float64, device=choose.device)
    free = [j for j, i in enumerate(rows) if generators[i] is None]
    if free:
        uniforms[free] = torch.rand(len(free), dtype=torch.float64, device=choose.device)
    for j, i in enumerate(rows):
        gen = generators[i]
        if gen is not None:
            uniforms[j] = torch.rand(1, dtype=torch.float64, generator=gen,
                                     device=gen.device).to(choose.device)[0]
    chosen[rows] = draw(probs, uniforms)
    return chosen.tolist()


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: for each row of ``probs`` [R, V] (each summing to about 1),
    the first token whose cumulative probability exceeds its row's uniform in [0, 1)
    times the row's total. The sums are float64, so a token's share of [0, 1) is its
    probability to about 1e-16, and a token of probability 0 (filtered, or masked by a
    grammar) is never drawn: the sum does not rise over it. One pass over the row, where
    ``torch.multinomial`` draws an exponential per vocabulary entry: 0.07 vs 1.2 ms a row
    of SmolLM2's 49,152 tokens on one CPU core, 12 ms of a 10-sequence decode step.

    Raises ValueError for a row with no probability (all masked) or a NaN."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1]
    if not bool(((total > 0) & torch.isfinite(total)).all()):
        raise ValueError("no token can be sampled: every probability is 0 or not a number")
    target = (uniforms.to(cdf.device, torch.float64) * total).unsqueeze(-1)
    picked = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return picked.clamp_(max=probs.shape[-1] - 1)


def make_generator(params: SamplingParams, stream: int) -> Optional[torch.Generator]:
    """A seeded sequence's generator for one side of the handover: ``stream`` 0 samples
    the first token (prefill), 1 the rest (decode). Same seed → same tokens, on any
    workers; any integer seed works (taken modulo 2**64, torch's range)."""
    if params.greedy or params.seed is None:
        return None
    return torch.Generator().manual_seed((int(params.seed) * 2 + stream) % (1 << 64))


def sample_first(logits: torch.Tensor, params: SamplingParams,
                 grammars: Grammars) -> list[SampledToken]:
    """A request's first tokens, one per choice (``params.n``), from its prompt's last
    logits row [V] (the prefill side): choice i is sampled with ``params.choice(i)`` under
    a fresh matcher of the grammar if there is one (the decode worker advances its own
    matcher with the token: common/grammar.py)."""
    choices = [params.choice(i) for i in range(params.n)]
    bitmask = grammars.bitmask([grammars.matcher(p) for p in choices])
    sampled = sample(logits.unsqueeze(0).expand(len(choices), -1), choices,
                     [make_generator(p, 0) for p in choices], bitmask,
                     [p.resumed for p in choices])  # a continuation's penalties
    return [SampledToken(t, lp, top) for t, lp, top in sampled]


class Sampler:
    """Owns the per-request generators: seeded from the request, or from the engine seed."""

    def __init__(self, seed: int = 0):
        self._base = seed
        self._count = 0

    def generator(self, params: SamplingParams, device: str = "cpu") -> Optional[torch.Generator]:
        if params.greedy:
            return None
        self._count += 1
        seed = params.seed if params.seed is not None else self._base * 1_000_003 + self._count
        return torch.Generator(device=device).manual_seed(seed)

    def sample(self, logits: torch.Tensor, params: Sequence[SamplingParams],
               generators: Sequence[Optional[torch.Generator]]) -> Sampled:
        return sample(logits, params, generators)
