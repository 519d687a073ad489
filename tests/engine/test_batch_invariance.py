"""Greedy answers that do not depend on the load (issue 27), on the default model in the
default cluster's precisions (bfloat16 prefill where the CPU has it, float32 decode with
bfloat16 linears where the CPU has them, bfloat16 KV): a prompt's KV and logits are the
same bit for bit alone, beside other prompts in one step, after a cached prefix and in
bigger chunks, when its chunks end and attend in parts where
``ClusterConfig.batch_invariant`` puts them (multiples of ``chunk_align()``); a decode
row's logits are the same alone and in a batch (common/model/cpu_attention.py, and
common/model/linear.py Linear's single row)."""
from __future__ import annotations

from typing import Sequence

import pytest
import torch

from common.config import ClusterConfig
from common.engine import DecodeInput, Engine, EngineConfig
from common.engine.config import PrefillChunk
from common.model import cpu_attention
from common.model.linear import Linear
from common.worker import native_bfloat16

ALIGN = ClusterConfig().chunk_align()  # where chunks end and attention parts are cut
PREFILL_DTYPE, LINEAR_DTYPE = ("bfloat16", "bfloat16") if native_bfloat16() else ("float32", None)

pytestmark = pytest.mark.skipif(cpu_attention.kernel() is None,
                                reason="no C compiler: decode gathers (not batch invariant)")


@pytest.fixture(scope="module", params=["kernel", "parts"])
def engines(request) -> tuple[Engine, Engine]:
    """A prefill engine and a decode engine sharing nothing, as in a cluster; prompts
    attend through the CPU kernel (each row alone), or, as without a C compiler, in
    flash-attention parts cut at ALIGN."""
    config = dict(kv_dtype="bfloat16", num_blocks=160, chunk_align=ALIGN)
    prefill = Engine(EngineConfig(dtype=PREFILL_DTYPE, **config,
                                  attention_backend="cpu" if request.param == "kernel" else "sdpa"))
    assert prefill.attention.prompt_rows_alone == (request.param == "kernel")
    return prefill, Engine(EngineConfig(dtype="float32", linear_dtype=LINEAR_DTYPE, **config))


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in (150, 37, 90)]


def _chunks(prompt: list[int], start: int, table: list[int],
            pieces: int = 1) -> list[PrefillChunk]:
    """The prompt's chunks from ``start`` (a multiple of ALIGN), each ``pieces`` x ALIGN
    tokens (the last to the prompt's end): how a step's budget may group them."""
    ends = list(range(start + pieces * ALIGN, len(prompt), pieces * ALIGN)) + [len(prompt)]
    return [PrefillChunk(prompt, s, e, table) for s, e in zip([start] + ends, ends)]


def _kv(engine: Engine, table: list[int], n: int) -> torch.Tensor:
    return torch.stack([torch.stack(engine.kv.gather(layer, torch.tensor(table)))
                        for layer in range(len(engine.layers))])[:, :, :n]


def test_prefill_alone_beside_others_and_after_a_cached_prefix(engines) -> None:
    prefill, _ = engines
    target, *others = _prompts()
    alone = prefill.pool.allocate(prefill.blocks_needed(len(target)))
    for chunk in _chunks(target, 0, alone):
        logits = prefill.step([chunk])[0][0]
    want = _kv(prefill, alone, len(target))
    # beside other prompts' chunks in the same steps (each step one mixed forward)
    busy = prefill.pool.allocate(prefill.blocks_needed(len(target)))
    tables = [prefill.pool.allocate(prefill.blocks_needed(len(p))) for p in others]
    other_chunks = [_chunks(p, 0, t) for p, t in zip(others, tables)]
    for i, chunk in enumerate(_chunks(target, 0, busy)):
        step = [c[i] for c in other_chunks if i < len(c)] + [chunk]
        busy_logits = prefill.step(step)[0][-1]
    assert torch.equal(_kv(prefill, busy, len(target)), want)
    assert torch.equal(busy_logits, logits)
    # after a cached prefix of ALIGN tokens: its blocks, then the rest computed alone
    cached = alone[:ALIGN // prefill.config.block_size]
    rest = prefill.pool.allocate(len(alone) - len(cached))
    for chunk in _chunks(target, ALIGN, cached + rest):
        warm_logits = prefill.step([chunk])[0][0]
    assert torch.equal(_kv(prefill, cached + rest, len(target)), want)
    assert torch.equal(warm_logits, logits)
    # in bigger chunks (a step with more budget left): the engine cuts the same parts
    whole = prefill.pool.allocate(len(alone))
    for chunk in _chunks(target, 0, whole, pieces=2):
        whole_logits = prefill.step([chunk])[0][0]
    assert torch.equal(_kv(prefill, whole, len(target)), want)
    assert torch.equal(whole_logits, logits)
    for t in (alone, busy, rest, whole, *tables):
        prefill.pool.free(t)


def rows_invariant(linear: Linear, counts: Sequence[int] = (1, 2, 3, 5, 8, 13, 21, 34),
                   rows: int = 40) -> bool:
    """Whether each row's result is the same bit for bit whatever else is computed with
    it (the first of ``rows`` random rows in each of ``counts``)."""
    x = torch.randn(rows, linear.in_features, generator=torch.Generator().manual_seed(1))
    if linear.weight is not None:
        x = x.to(linear.weight)  # its dtype and device
    whole = linear(x)
    return all(torch.equal(linear(x[:m]), whole[:m]) for m in counts)


def test_every_linear_is_row_invariant(engines) -> None:
    """Each linear layer's rows are the same bit for bit in any number of rows (a single
    row computed as two where oneDNN takes another path for one)."""
    for engine in engines:
        bad = [name for name, linear in engine.model.linears() if not rows_invariant(linear)]
        assert not bad, f"{engine.config.dtype}/{engine.config.linear_dtype}: {bad}"


def test_decode_rows_alone_and_in_batches(engines) -> None:
    _, decode = engines
    prompts = [p[:n] for p, n in zip(_prompts(), (40, 9, 23))]
    tables = [decode.pool.allocate(decode.blocks_needed(len(p) + 2)) for p in prompts]
    for p, t in zip(prompts, tables):
        decode.prefill(p, t)
    rows = [DecodeInput(7, len(p), t) for p, t in zip(prompts, tables)]
    batch = decode.decode_step(rows)
    for i, row in enumerate(rows):
        assert torch.equal(decode.decode_step([row])[0], batch[i]), i
    assert torch.equal(decode.decode_step(rows[::-1])[0], batch[-1])
    for t in tables:
        decode.pool.free(t)
