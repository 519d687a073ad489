"""Cases of tests/model/test_triton_ops.py that run in Triton's interpreter: that test
runs this file in a child process with TRITON_INTERPRET=1 (the interpreter is chosen when
triton is imported). Not collected by the suite itself (not a test_*.py file).

The GPU engine's kernels (common/model/triton_ops.py) and its graphed decode step
(common/engine/cuda_graphs.py) against the torch path: paged decode attention against
SDPA over gathered K/V, the fused elementwise steps against TorchOps, and a padded decode
batch fed from the graphs' static buffers against the eager SDPA engine.
"""
from __future__ import annotations

import os

import pytest
import torch

from common.model import triton_ops

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="run by tests/model/test_triton_ops.py with "
                                "TRITON_INTERPRET=1")


def _reference(q: torch.Tensor, kv, layer: int, table: torch.Tensor, n: int) -> torch.Tensor:
    """SDPA of one sequence's query [heads, dim] over its first n tokens."""
    k, v = kv.gather(layer, table[None])
    k, v = (x[0, :n].transpose(0, 1).to(q.dtype)[None] for x in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q[None, :, None], k, v,
                                                           enable_gqa=True)
    return out.reshape(-1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("splits", [1, 3, None])
@pytest.mark.parametrize("stride_in_memory", [False, True])
def test_paged_decode_attention_equals_sdpa(dtype: torch.dtype, tol: float, splits,
                                            stride_in_memory: bool) -> None:
    from common.kv.memory import PagedKVMemory

    torch.manual_seed(0)
    kv = PagedKVMemory(64, 3, 16, 2, 32, dtype)
    kv.data.normal_()
    lens = [1, 17, 100, 0, 64, 130]  # 0: a padded row
    width = 9
    tables = torch.randperm(64)[:len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), 6, 32).to(dtype)  # groups of 3 query heads per KV head
    stride = None
    if stride_in_memory:  # a CUDA graph's flat tables
        stride = torch.tensor([width])
        flat = torch.cat([tables.reshape(-1), torch.full((20,), -7)])  # junk past the rows
        out = triton_ops.paged_decode_attention(q, kv.layer_view(1), flat[None],
                                                torch.tensor(lens), splits, stride)
    else:
        out = triton_ops.paged_decode_attention(q, kv.layer_view(1), tables,
                                                torch.tensor(lens, dtype=torch.int32), splits)
    assert out.shape == (len(lens), 6 * 32) and out.dtype == dtype
    for b, n in enumerate(lens):
        if n == 0:
            assert torch.count_nonzero(out[b]) == 0
            continue
        want = _reference(q[b], kv, 1, tables[b], n)
        assert torch.allclose(out[b].float(), want.float(), atol=tol, rtol=tol), (b, n)


def test_write_kv_writes_rows_and_skips_padding() -> None:
    from common.kv.memory import PagedKVMemory

    kv, want = PagedKVMemory(6, 2, 4, 2, 8), PagedKVMemory(6, 2, 4, 2, 8)
    qkv = torch.randn(3, 64)  # strided k and v, as split from the QKV product
    k, v = qkv[:, 32:48].view(3, 2, 8), qkv[:, 48:].view(3, 2, 8)
    blocks, positions = torch.tensor([4, 1, 4]), torch.tensor([2, 7, 3])
    rows = kv.token_rows(blocks, positions)
    want.write_rows(1, rows[[0, 2]], k[[0, 2]], v[[0, 2]])
    rows[1] = -1  # a padded row: nothing written
    triton_ops.write_kv(kv.data, 1, rows, k, v)
    assert torch.equal(kv.data, want.data)


def test_fused_steps_equal_the_torch_path() -> None:
    from common.model.decoder import TorchOps, TritonOps
    from common.model.rope import inv_frequencies
    from common.model.config import DUMMY_CONFIGS

    torch.manual_seed(1)
    h, delta, w = torch.randn(5, 96), torch.randn(5, 96), torch.rand(96) + 0.5
    assert torch.allclose(TritonOps.rms_norm(h, w, 1e-5), TorchOps.rms_norm(h, w, 1e-5),
                          atol=1e-5)
    for got, want in zip(TritonOps.add_rms_norm(h, delta, w, 1e-5),
                         TorchOps.add_rms_norm(h, delta, w, 1e-5)):
        assert torch.allclose(got, want, atol=1e-5)
    gate_up = torch.randn(4, 2 * 1100)  # more than one program a row
    assert torch.allclose(TritonOps.silu_mul(gate_up), TorchOps.silu_mul(gate_up), atol=1e-5)
    llama3 = DUMMY_CONFIGS["dummy-llama3-8b"]  # its scaled frequencies
    inv_freq = inv_frequencies(llama3.head_dim, llama3.rope_theta, llama3.rope_scaling)[:16]
    positions = torch.tensor([0, 1, 77, 4000])
    qkv = torch.randn(4, 5 * 32)
    q, k = qkv[:, :96].view(4, 3, 32), qkv[:, 96:128].view(4, 1, 32)
    want = TorchOps.rope(inv_freq, positions, torch.float32)(q.clone(), k.clone())
    got = TritonOps.rope(inv_freq, positions, torch.float32)(q, k)
    assert got[0].data_ptr() == qkv.data_ptr()  # in place, in the QKV product
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=2e-4)
    apart = torch.randn(4, 3, 32), torch.randn(4, 2, 32)  # not side by side: two launches
    want = TorchOps.rope(inv_freq, positions, torch.float32)(*(x.clone() for x in apart))
    for g, w in zip(TritonOps.rope(inv_freq, positions, torch.float32)(*apart), want):
        assert torch.allclose(g, w, atol=2e-4)


def test_padded_graph_batch_equals_the_eager_sdpa_engine() -> None:
    """Three sequences padded to a captured size of 4, fed from the graphs' static buffers
    (tables flat, their stride in memory), on the Triton path: the eager SDPA engine's
    logits, and the padded row wrote nothing."""
    from common.engine import DecodeInput, Engine, EngineConfig
    from common.engine.cuda_graphs import DecodeGraphs
    from common.model.decoder import TritonOps

    def engine(backend: str) -> Engine:
        e = Engine(EngineConfig(model="dummy-tiny", num_blocks=64, block_size=16,
                                attention_backend=backend))
        if backend == "triton":
            e.model.ops = TritonOps  # chosen on CUDA only
            if e.model.config.activation == "silu":
                e.model.gated = TritonOps.silu_mul
        return e

    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    results = []
    for e in (engine("sdpa"), engine("triton")):
        a, b = e.pool.allocate(e.blocks_needed(60)), e.pool.allocate(e.blocks_needed(60))
        first = e.prefill(ids, a)
        e.prefill(ids[:24], b)
        before = e.kv.data.clone()
        batch = [DecodeInput(5, 40, a), DecodeInput(9, 24, b), DecodeInput(3, 33, b)]
        if e.config.attention_backend == "triton":
            graphs = DecodeGraphs(e.model, e.attention, e.kv, 8, e.max_context, capture=False)
            logits = graphs.replay(batch)
            assert graphs.host[graphs.ROWS * 8 + 3] == -1  # the padded row's KV row
        else:
            logits = e.decode_step(batch)
        changed = (e.kv.data != before).flatten(1).any(1).nonzero().flatten().tolist()
        results.append((first, logits, changed))
    (first, want, changed_ref), (got_first, got, changed) = results
    assert torch.allclose(got_first, first, atol=1e-4)
    assert torch.allclose(got, want, atol=1e-4)
    assert changed == changed_ref  # the blocks of positions 40, 24, 33 only


@pytest.mark.parametrize("model_type", ["gemma3_text", "qwen2_moe", "deepseek_v3"])
def test_the_triton_path_serves_other_families(tmp_path, model_type: str) -> None:
    """Gemma3's per-head q/k norms (a Triton RMSNorm, as Qwen3's), its query scale (the
    decode kernel's ``scale``) and sliding layers (the masked SDPA path), Qwen2-MoE's
    experts and shared expert (the Triton SiLU of each expert's rows), and DeepSeek V3's
    latent attention (the rotation of each head's last dimensions and of one shared key
    part, the latent's norm, heads 24 wide), on the Triton path: the SDPA engine's logits (tests/model/test_architectures.py checks those
    against transformers), on a prefill and a decode batch past the window."""
    from common.engine import DecodeInput, Engine, EngineConfig
    from common.model.decoder import TritonOps
    from tests.model.test_architectures import FAMILIES
    from tests.model.tiny_checkpoints import write_checkpoint

    write_checkpoint(model_type, tmp_path, **FAMILIES[model_type])
    # 12 and 10 tokens: past the window (8) on both rows, and few kernel launches to
    # interpret (one RMSNorm program a row of every q/k head)
    ids = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    results = []
    for backend in ("sdpa", "triton"):
        e = Engine(EngineConfig(model=str(tmp_path), num_blocks=32, block_size=4,
                                attention_backend=backend))
        if backend == "triton":
            e.model.ops = TritonOps  # chosen on CUDA only
            if e.model.config.activation == "silu":
                e.model.gated = TritonOps.silu_mul
        a, b = e.pool.allocate(e.blocks_needed(24)), e.pool.allocate(e.blocks_needed(24))
        first = e.prefill(ids, a)
        e.prefill(ids[:10], b)
        results.append((first, e.decode_step([DecodeInput(5, 12, a), DecodeInput(9, 10, b)])))
    (first, want), (got_first, got) = results
    assert torch.allclose(got_first, first, atol=1e-4)
    assert torch.allclose(got, want, atol=1e-4)


def test_prompt_graph_pieces_on_the_triton_path() -> None:
    """A chunk after a prefix (13 tokens, padded to 16) through the prompt graphs' pieces
    (common/engine/prompt_graphs.py, eager) on the Triton path: the fused steps on the
    static buffers' rows give the SDPA engine's logits and KV."""
    from common.engine import Engine, EngineConfig
    from common.engine.config import PrefillChunk
    from common.engine.prompt_graphs import PromptGraphs
    from common.model.decoder import TritonOps

    ids = torch.randint(3, 500, (33,), generator=torch.Generator().manual_seed(5)).tolist()
    results = []
    for backend in ("sdpa", "triton"):
        e = Engine(EngineConfig(model="dummy-tiny", num_blocks=16, block_size=16,
                                attention_backend=backend))
        if backend == "triton":
            e.model.ops = TritonOps  # chosen on CUDA only
            if e.model.config.activation == "silu":
                e.model.gated = TritonOps.silu_mul
            e.prompt_graphs = PromptGraphs(e.model, 32, capture=False)
        table = e.pool.allocate(e.blocks_needed(len(ids)))
        e.prefill(ids[:20], table)
        logits = e.step([PrefillChunk(ids, 20, 33, table)])[0][0]
        results.append((logits, e.kv.data.clone()))
    (want, kv_want), (got, kv_got) = results
    assert torch.allclose(got, want, atol=1e-4)
    assert torch.allclose(kv_got, kv_want, atol=1e-5)
