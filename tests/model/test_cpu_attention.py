"""The CPU's paged attention (common/model/cpu_attention.py), decode rows and prompt
chunks: equal to torch's attention over each sequence's own keys, read in place from
scattered blocks, and every row independent of what else is in the call (batch
invariance) or, for a prompt, of the chunk it is computed in."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.engine import DecodeInput, Engine, EngineConfig
from common.kv.memory import PagedKVMemory
from common.model import cpu_attention
from common.model.attention import CpuPagedAttention, SdpaAttention

KERNEL = cpu_attention.kernel()
SPLIT = 4  # threads a call splits over in the cases that split (OpenMP, where built)
pytestmark = pytest.mark.skipif(KERNEL is None, reason="no C compiler: the CPU's paged "
                                "attention kernel did not build (decode gathers instead)")


def _memory(dtype: torch.dtype, heads: int = 3, head_dim: int = 64) -> PagedKVMemory:
    kv = PagedKVMemory(40, 3, 16, heads, head_dim, dtype, torch.device("cpu"))
    kv.data.copy_(torch.randn(kv.data.shape, generator=torch.Generator().manual_seed(1)))
    return kv


def _reference(q: torch.Tensor, kv: PagedKVMemory, layer: int, table: list[int],
               n: int, scale: float) -> torch.Tensor:
    keys, values = (x[:n].float().transpose(0, 1)[None] for x in
                    kv.gather(layer, torch.tensor(table)))
    return F.scaled_dot_product_attention(q[None, :, None], keys, values, scale=scale,
                                          enable_gqa=True)[0, :, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 2, 128), (14, 2, 64),
                                                     (6, 3, 80), (4, 2, 256), (4, 4, 24),
                                                     (16, 1, 576)])  # DeepSeek's latent
def test_equals_torch_attention(dtype: torch.dtype, heads: int, kv_heads: int,
                                head_dim: int) -> None:
    """Lengths of one key, of part of a block, of whole blocks; tables in any order; the
    specialised head widths (64, 128), other multiples of 16 (80, 256: the vector code at
    run-time widths), groups split into passes (7 heads a kv head: 4 + 3), and the scalar
    code (24)."""
    kv = _memory(dtype, kv_heads, head_dim)
    g = torch.Generator().manual_seed(heads)
    lens = [1, 7, 16, 33, 80]
    tables = [torch.randperm(40, generator=g)[:6].tolist() for _ in lens]
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    got = KERNEL.attend(q, kv, 2, torch.tensor(tables), torch.arange(len(lens)),
                        torch.tensor(lens), 0.125)
    for t, n in enumerate(lens):
        want = _reference(q[t], kv, 2, tables[t], n, 0.125)
        assert torch.allclose(got[t], want, atol=2e-6), (n, (got[t] - want).abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (4, 1, 256), (4, 4, 24)])
def test_a_sliding_window_reads_only_its_keys(dtype: torch.dtype, heads: int, kv_heads: int,
                                              head_dim: int) -> None:
    """Decode rows of a sliding layer (the last ``window`` keys) equal torch's attention
    over those keys alone, whether the window starts on a block's first key, inside a
    block, or at 0 (a row shorter than it); the blocks before it are not read (their
    table entries point past the memory); and each row is the same alone as beside
    others (vector and scalar code)."""
    kv = _memory(dtype, kv_heads, head_dim)
    g = torch.Generator().manual_seed(head_dim)
    window = 17
    lens = [9, 33, 80, 64, 6]  # first keys 0, 16, 63, 47, 0
    tables = [torch.randperm(40, generator=g)[:6].tolist() for _ in lens]
    for table, n in zip(tables, lens):
        first = max(0, n - window)
        table[:first // 16] = [10 ** 9] * (first // 16)  # never read
    q = torch.randn(len(lens), heads, head_dim, generator=g)
    got = KERNEL.attend(q, kv, 1, torch.tensor(tables), None, torch.tensor(lens), 0.2,
                        window=window)
    for t, n in enumerate(lens):
        table = [b if b < 40 else 0 for b in tables[t]]
        keys, values = (x[max(0, n - window):n].float().transpose(0, 1)[None] for x in
                        kv.gather(1, torch.tensor(table)))
        want = F.scaled_dot_product_attention(q[t][None, :, None], keys, values, scale=0.2,
                                              enable_gqa=True)[0, :, 0]
        assert torch.allclose(got[t], want, atol=2e-6), n
        alone = KERNEL.attend(q[t:t + 1], kv, 1, torch.tensor(tables[t:t + 1]), None,
                              torch.tensor(lens[t:t + 1]), 0.2, window=window)
        assert torch.equal(alone[0], got[t])


def test_rows_are_batch_invariant() -> None:
    """A row's output is bit for bit the same alone, beside rows of other lengths, read
    through another table row, and with the rows split over threads."""
    kv = _memory(torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    tables = torch.stack([torch.randperm(40, generator=g)[:8] for _ in range(12)])
    lens = torch.randint(1, 128, (12,), generator=g)
    q = torch.randn(12, 9, 64, generator=g)
    batch = KERNEL.attend(q, kv, 0, tables, torch.arange(12), lens, 0.125)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(SPLIT)  # rows split over threads
        rows = cpu_attention.ROWS_PER_THREAD * SPLIT
        many = KERNEL.attend(q.repeat(rows // 12 + 1, 1, 1), kv, 0, tables,
                             torch.arange(12).repeat(rows // 12 + 1), lens.repeat(rows // 12 + 1),
                             0.125)
        split = many[:12]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, split) and torch.equal(many[12:24], batch)
    for t in (0, 5, 11):
        alone = KERNEL.attend(q[t:t + 1], kv, 0, tables[t:t + 1], torch.tensor([0]),
                              lens[t:t + 1], 0.125)
        assert torch.equal(alone[0], batch[t])
        shifted = KERNEL.attend(q[t:t + 1], kv, 0, tables, torch.tensor([t]),
                                lens[t:t + 1], 0.125)
        assert torch.equal(shifted[0], batch[t])


@pytest.mark.parametrize("window", [None, 50])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(9, 3, 64), (8, 2, 128), (4, 1, 256),
                                                     (16, 1, 576)])
def test_a_prompt_chunk_equals_torch_causal_attention(dtype: torch.dtype, heads: int,
                                                      kv_heads: int, head_dim: int,
                                                      window: int) -> None:
    """Query rows at positions [37, 300) over their prompt's keys, causally (a sliding
    layer's: the last 50 of them; the chunk's first row's window starts in block 0, its
    last's in block 15), blocks in any order: torch's masked attention over the gathered
    keys."""
    kv = _memory(dtype, kv_heads, head_dim)
    g = torch.Generator().manual_seed(heads)
    table = torch.randperm(40, generator=g)[:19]
    start, end = 37, 300
    q = torch.randn(end - start, heads, head_dim, generator=g)
    scale = head_dim ** -0.5  # the models' (scores' rounding grows with them)
    got = KERNEL.attend_chunk(q, kv, 1, table, start, scale, window)
    keys, values = (x[:end].float().transpose(0, 1)[None] for x in kv.gather(1, table))
    behind = torch.arange(start, end)[:, None] - torch.arange(end)[None, :]
    seen = (behind >= 0) & (behind < (window or end))
    want = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys, values,
                                          attn_mask=seen[None, None], scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("window", [None, 40])
def test_prompt_rows_do_not_depend_on_the_chunks(window: int) -> None:
    """A prompt's rows are bit for bit the same computed at once, in chunks ending
    anywhere (mid-block too), and split over threads; in a sliding layer too (a chunk's
    copy of the blocks then starts at its first row's window, elsewhere each time)."""
    kv = _memory(torch.bfloat16)
    g = torch.Generator().manual_seed(4)
    table = torch.randperm(40, generator=g)[:20]
    q = torch.randn(300, 9, 64, generator=g)
    whole = KERNEL.attend_chunk(q, kv, 0, table, 0, 0.125, window)
    for cuts in ([0, 7, 100, 133, 300], [0, 16, 32, 256, 300], [0, 299, 300]):
        parts = [KERNEL.attend_chunk(q[a:b], kv, 0, table, a, 0.125, window)
                 for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts), whole), cuts
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(SPLIT)
        assert torch.equal(KERNEL.attend_chunk(q, kv, 0, table, 0, 0.125, window), whole)
    finally:
        torch.set_num_threads(threads)


def test_auto_backend_and_refusals() -> None:
    """``auto`` on the CPU takes the kernel for float32 and bfloat16 KV and SDPA for
    float16, which the kernel does not read; asking for it there says why."""
    from common.model.attention import make_backend

    assert isinstance(make_backend("auto", _memory(torch.bfloat16)), CpuPagedAttention)
    f16 = PagedKVMemory(4, 1, 16, 1, 8, torch.float16, torch.device("cpu"))
    backend = make_backend("auto", f16)
    assert type(backend) is SdpaAttention
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        make_backend("cpu", f16)


def _greedy(engine: Engine, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Prefill each prompt alone, then decode them together for ``steps`` tokens."""
    seqs = []
    for ids in prompts:
        blocks = engine.pool.allocate(engine.blocks_needed(len(ids) + steps))
        first = int(engine.prefill(ids, blocks).argmax())
        seqs.append([first, len(ids), blocks, [first]])
    for _ in range(steps - 1):
        logits = engine.decode_step([DecodeInput(t, p, b) for t, p, b, _ in seqs])
        for s, tok in zip(seqs, logits.argmax(-1).tolist()):
            s[0], s[1] = tok, s[1] + 1
            s[3].append(tok)
    for s in seqs:
        engine.pool.free(s[2])
    return [s[3] for s in seqs]


def test_engine_decode_equals_the_gathering_path() -> None:
    """dummy-tiny's greedy decode through the kernel equals SDPA's over gathered blocks
    (logits within float rounding, the same tokens), and a sequence's tokens are the same
    alone as in a batch of prompts of other lengths."""
    config = dict(model="dummy-tiny", num_blocks=64, kv_dtype="bfloat16")
    cpu = Engine(EngineConfig(attention_backend="cpu", **config))
    sdpa = Engine(EngineConfig(attention_backend="sdpa", **config))
    assert isinstance(cpu.attention, CpuPagedAttention)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (21, 5, 40, 17)]
    together = _greedy(cpu, prompts, 12)
    assert together == _greedy(sdpa, prompts, 12)
    assert _greedy(cpu, prompts[:1], 12) == together[:1]
    assert _greedy(cpu, prompts[2:3], 12) == together[2:3]


def test_a_sliding_model_on_the_kernel_equals_transformers(tmp_path) -> None:
    """A Mistral checkpoint (every layer sliding over 20 keys) with heads the prompt
    kernel takes: its prompt in chunks of 23 (each past the window) and its decode steps
    on the kernel give transformers' logits."""
    from tests.model.tiny_checkpoints import assert_decodes_as, write_checkpoint

    hf = write_checkpoint("mistral", tmp_path, hidden_size=128, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=64, sliding_window=20)
    engine = Engine(EngineConfig(model=str(tmp_path), num_blocks=32, prefill_chunk=23,
                                 chunk_align=16))  # batch invariance: rows alone
    assert isinstance(engine.attention, CpuPagedAttention)
    assert engine.attention.prompt_rows_alone
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (n,), generator=g).tolist() for n in (70, 31)]
    assert_decodes_as(engine, hf, prompts, steps=3)
