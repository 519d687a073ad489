"""The GPU engine's decode path: the Triton kernels on the card against SDPA in bfloat16,
and decode steps replayed as CUDA graphs against the same steps run eagerly.

Skipped without a CUDA GPU and triton. ``benchmarks/gpu_device.sh`` runs these on a lent
GPU machine; tests/model/test_triton_ops.py checks the same kernels on the CPU in Triton's
interpreter.
"""
from __future__ import annotations

import pytest
import torch

from common.engine import DecodeInput, Engine, EngineConfig
from common.model import triton_ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (torch.cuda.is_available() and triton_ops.available()),
    reason="the graphed decode path needs a CUDA GPU and triton (none here)")]


def test_paged_decode_attention_on_cuda_equals_sdpa() -> None:
    from common.kv.memory import PagedKVMemory

    torch.manual_seed(0)
    kv = PagedKVMemory(800, 2, 16, 8, 128, torch.bfloat16, "cuda")
    kv.data.normal_()
    lens = [1, 17, 1000, 0, 5000, 64]
    width = 5000 // 16 + 1
    tables = torch.stack([torch.randperm(800, device="cuda")[:width] for _ in lens])
    q = torch.randn(len(lens), 32, 128, dtype=torch.bfloat16, device="cuda")
    out = triton_ops.paged_decode_attention(q, kv.layer_view(1), tables,
                                            torch.tensor(lens, dtype=torch.int32, device="cuda"))
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.count_nonzero(out[b]) == 0
            continue
        k, v = kv.gather(1, tables[b][None])
        k, v = (x[0, :n].transpose(0, 1)[None] for x in (k, v))
        want = torch.nn.functional.scaled_dot_product_attention(
            q[b][None, :, None], k, v, enable_gqa=True).reshape(-1)
        assert torch.allclose(out[b].float(), want.float(), atol=2e-2, rtol=2e-2), (b, n)


def _engines() -> tuple[Engine, Engine]:
    def make(graphs: bool) -> Engine:
        return Engine(EngineConfig(model="dummy-bench-prefill", dtype="bfloat16", device="cuda",
                                   num_blocks=256, block_size=16, max_batch_size=16,
                                   cuda_graphs=graphs))
    return make(True), make(False)


def test_graphed_decode_gives_the_eager_steps_greedy_tokens() -> None:
    """Four sequences of different lengths (a captured size: no padding) decode 24 greedy
    steps on two engines, one replaying graphs, one eager: the same logits bit for bit,
    so the same tokens. Then three of them (padded to 4): the same tokens, logits equal to
    bfloat16 rounding (a padded batch multiplies a matrix of another height)."""
    graphed, eager = _engines()
    assert graphed.graphs is not None and eager.graphs is None
    assert graphed.graphs.ladder == [1, 2, 4, 8, 16]
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 4000, (n,), generator=gen).tolist() for n in (5, 40, 300, 77)]
    state = {}
    for name, e in (("graphed", graphed), ("eager", eager)):
        seqs = []
        for ids in prompts:
            table = e.pool.allocate(e.blocks_needed(len(ids) + 40))
            first = int(e.prefill(ids, table).argmax())
            seqs.append([first, len(ids), table, [first]])
        state[name] = seqs

    def step(n: int, exact: bool) -> None:
        got = {}
        for name, e in (("graphed", graphed), ("eager", eager)):
            seqs = state[name][:n]
            batch = [DecodeInput(tok, pos, table) for tok, pos, table, _ in seqs]
            logits = e.decode_step(batch) if name == "graphed" else e.step(decodes=batch)[1]
            got[name] = logits
            for s, t in zip(seqs, logits.argmax(-1).tolist()):
                s[0], s[1] = t, s[1] + 1
                s[3].append(t)
        if exact:
            diff = (got["graphed"] - got["eager"]).abs().max().item()
            assert torch.equal(got["graphed"], got["eager"]), diff
        else:
            assert torch.allclose(got["graphed"], got["eager"], atol=3e-2)

    for _ in range(24):
        step(4, exact=True)
    for _ in range(8):
        step(3, exact=False)
    assert [s[3] for s in state["graphed"]] == [s[3] for s in state["eager"]]
    assert len({tuple(s[3]) for s in state["graphed"]}) == 4  # the sequences differ


def test_engine_on_cuda_bfloat16_is_close_to_the_cpu_in_float32() -> None:
    """The whole GPU path (fused kernels, paged attention, a graphed decode step) against
    the CPU engine in float32: within bfloat16's rounding."""
    ids = torch.randint(3, 4000, (200,), generator=torch.Generator().manual_seed(6)).tolist()
    out = {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        e = Engine(EngineConfig(model="dummy-bench-prefill", dtype=dtype, device=device,
                                num_blocks=64, block_size=16, max_batch_size=4))
        table = e.pool.allocate(e.blocks_needed(230))
        first = e.prefill(ids, table).float().cpu()
        step = e.decode_step([DecodeInput(int(first.argmax()), 200, table)]).float().cpu()
        out[device] = (first, step)
    for got, want in zip(out["cuda"], out["cpu"]):
        assert (got - want).abs().max() < 5e-2 * want.abs().max()
