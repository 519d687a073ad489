"""Single-process generation on one Engine (tests, benchmarks, simple workers).

Prompt blocks are looked up in the engine's block pool (local prefix reuse), the rest is
prefilled, then all sequences decode together (continuous batching) until each stops.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from common.engine.config import DecodeInput
from common.engine.engine import Engine
from common.engine.sampling import Sampler, SamplingParams, sample


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str               # "stop" | "length"
    logprobs: Optional[list[float]]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class _Seq:
    prompt: list[int]
    params: SamplingParams
    generator: Optional[torch.Generator]
    blocks: list[int]
    num_cached: int
    out: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_text: Optional[str] = None  # output text cut before a matched stop string
    finish: Optional[str] = None


def generate(engine: Engine, token_ids: list[int], params: Optional[SamplingParams] = None,
             sampler: Optional[Sampler] = None) -> GenerationResult:
    params = params or SamplingParams(max_tokens=16)
    return generate_batch(engine, [token_ids], [params], sampler)[0]


def generate_batch(engine: Engine, prompts: Sequence[list[int]], params: Sequence[SamplingParams],
                   sampler: Optional[Sampler] = None) -> list[GenerationResult]:
    sampler = sampler or Sampler(engine.config.seed)
    for prompt in prompts:
        engine.validate_prompt(prompt)
    seqs: list[_Seq] = []
    try:
        for pr, sp in zip(prompts, params):
            seqs.append(_start(engine, list(pr), sp, sampler))
        running = [s for s in seqs if s.finish is None]
        while running:
            for i in range(0, len(running), engine.config.max_batch_size):
                _decode(engine, running[i:i + engine.config.max_batch_size])
            running = [s for s in running if s.finish is None]
    finally:  # on any error, give every block back
        for s in seqs:
            if s.blocks:
                engine.pool.free(s.blocks)
                s.blocks = []
    return [_result(engine, s) for s in seqs]


def _start(engine: Engine, prompt: list[int], params: SamplingParams, sampler: Sampler) -> _Seq:
    bs, pool = engine.config.block_size, engine.pool
    keys = engine.block_keys(prompt, params.adapter)
    cached = pool.match_prefix(keys[:(len(prompt) - 1) // bs])  # last token's block stays private
    try:
        fresh = pool.allocate(engine.blocks_needed(len(prompt)) - len(cached))
    except Exception:
        pool.free(cached)
        raise
    seq = _Seq(prompt, params, sampler.generator(params, engine.config.device),
               cached + fresh, len(cached) * bs)
    try:
        logits = engine.prefill(prompt, seq.blocks, seq.num_cached, adapter=params.adapter)
    except Exception:
        pool.free(seq.blocks)
        raise
    pool.cache_full_blocks(seq.blocks[:len(keys)], keys)
    _accept(engine, seq, logits[None])
    return seq


def _decode(engine: Engine, seqs: list[_Seq]) -> None:
    bs = engine.config.block_size
    batch = []
    for s in seqs:
        pos = len(s.prompt) + len(s.out) - 1
        if pos // bs >= len(s.blocks):
            s.blocks += engine.pool.allocate(1)
        batch.append(DecodeInput(s.out[-1], pos, s.blocks, s.params.adapter))
    logits = engine.decode_step(batch)
    _accept_many(engine, seqs, logits)


def _accept(engine: Engine, seq: _Seq, logits: torch.Tensor) -> None:
    _accept_many(engine, [seq], logits)


def _accept_many(engine: Engine, seqs: list[_Seq], logits: torch.Tensor) -> None:
    for s, (tok, lp, _) in zip(seqs, sample(logits, [s.params for s in seqs],
                                            [s.generator for s in seqs])):
        s.out.append(tok)
        if lp is not None:
            s.logprobs.append(lp)
        s.finish = _finish_reason(engine, s, tok)
        if s.finish is not None:
            engine.pool.free(s.blocks)
            s.blocks = []


def _finish_reason(engine: Engine, s: _Seq, tok: int) -> Optional[str]:
    p = s.params
    if tok in p.stop_token_ids or (not p.ignore_eos and tok in engine.model_config.eos_token_ids):
        return "stop"
    if p.stop:
        text = engine.decode_tokens(s.out)
        hits = [text.find(x) for x in p.stop if x and x in text]
        if hits:
            s.stop_text = text[:min(hits)]
            return "stop"
    if len(s.out) >= p.max_tokens or len(s.prompt) + len(s.out) >= engine.max_context:
        return "length"
    return None


def _result(engine: Engine, s: _Seq) -> GenerationResult:
    if s.stop_text is not None:
        text = s.stop_text
    else:
        ids = s.out
        stops = set(s.params.stop_token_ids) | set(engine.model_config.eos_token_ids)
        if s.finish == "stop" and ids and ids[-1] in stops:
            ids = ids[:-1]
        text = engine.decode_tokens(ids)
    return GenerationResult(s.out, text, s.finish or "length",
                            s.logprobs if s.params.logprobs else None,
                            len(s.prompt), s.num_cached)
