"""Prompt steps replayed as piecewise graphs (common/engine/prompt_graphs.py) against the
model's forward: on the CPU the pieces run eagerly from the static buffers (padding,
staging and the hooks' order checked there); on a GPU captured, against eager steps."""
from __future__ import annotations

import pytest
import torch

from common.engine import DecodeInput, Engine, EngineConfig
from common.engine.config import PrefillChunk
from common.engine.cuda_graphs import padded_size
from common.engine.prompt_graphs import PromptGraphs, token_ladder
from common.model import triton_ops


def test_the_ladder_ends_at_max_tokens_and_a_step_takes_the_next_size() -> None:
    assert token_ladder(64) == [16, 32, 48, 64]
    assert token_ladder(100) == [16, 32, 48, 64, 80, 96, 100]
    assert token_ladder(8) == [8]
    ladder = token_ladder(512)
    assert [padded_size(ladder, n) for n in (1, 16, 17, 416, 512)] == [16, 16, 32, 448, 512]
    with pytest.raises(ValueError):
        padded_size(ladder, 513)
    with pytest.raises(ValueError):
        token_ladder(0)


def engines(device: str = "cpu", dtype: str = "float32", tokens: int = 64,
            ) -> tuple[Engine, Engine]:
    """(graphed, plain): the same dummy weights; on the CPU the graphs are not captured."""
    def make(graph_tokens: int) -> Engine:
        return Engine(EngineConfig(model="dummy-bench-prefill", dtype=dtype, device=device,
                                   num_blocks=64, cuda_graphs=False,
                                   prompt_graph_tokens=graph_tokens))
    graphed, plain = make(tokens), make(0)
    if device == "cpu":
        assert graphed.prompt_graphs is None  # captured only on a GPU
        graphed.prompt_graphs = PromptGraphs(graphed.model, tokens, capture=False)
    return graphed, plain


def steps(e: Engine, calls: list) -> list[list]:
    """Three steps: a fresh chunk of A (40) and all of C (20); A's next 50 after its prefix,
    B's first 13 and C's first decode (64 tokens: a captured size), with all of D (10)
    computed after its layer 1, as a preempting prompt is (services/prefill/preempt.py);
    B's last 70 (past the largest size: the model's forward). Logits of each, on the CPU."""
    gen = torch.Generator().manual_seed(3)
    a, b, c, d = (torch.randint(3, 4000, (n,), generator=gen).tolist()
                  for n in (90, 83, 20, 10))
    ta, tb, tc, td = (e.pool.allocate(e.blocks_needed(n)) for n in (90, 83, 21, 10))
    out = []

    def hook(layer: int) -> None:
        calls.append(layer)
        if len(calls) == len(e.layers) + 2:  # the second step's layer 1
            out.append([e.step([PrefillChunk(d, 0, 10, td)])[0][0].float().cpu()])

    got, _ = e.step([PrefillChunk(a, 0, 40, ta), PrefillChunk(c, 0, 20, tc)], layer_hook=hook)
    out.append([x.float().cpu() for x in got if x is not None])
    first_c = int(got[1].argmax())
    got, dec = e.step([PrefillChunk(a, 40, 90, ta), PrefillChunk(b, 0, 13, tb)],
                      [DecodeInput(first_c, 20, tc)], layer_hook=hook)
    out.append([got[0].float().cpu(), dec.float().cpu()])
    got, _ = e.step([PrefillChunk(b, 13, 83, tb)], layer_hook=hook)
    out.append([got[0].float().cpu()])
    return out


def test_pieces_from_the_static_buffers_give_the_forward_and_its_kv() -> None:
    graphed, plain = engines()
    served = []
    forward = graphed.prompt_graphs.forward
    graphed.prompt_graphs.forward = lambda ids, *a, **k: served.append(len(ids)) or forward(
        ids, *a, **k)
    calls: dict[str, list] = {"graphed": [], "plain": []}
    got = steps(graphed, calls["graphed"])
    want = steps(plain, calls["plain"])
    assert served == [60, 64, 10]  # the 70-token step ran the model's forward
    for g_step, w_step in zip(got, want):
        for g, w in zip(g_step, w_step):
            assert torch.allclose(g, w, atol=1e-5, rtol=1e-5), (g - w).abs().max()
    layers = graphed.model_config.num_layers
    assert calls["graphed"] == calls["plain"]
    assert len(calls["plain"]) == 3 * layers and len(got) == len(want) == 4
    # every KV row the same (padding rows wrote none: the blocks no table holds stay 0)
    assert torch.allclose(graphed.kv.data, plain.kv.data, atol=1e-5, rtol=1e-5)


def test_a_pipeline_stage_has_no_prompt_graphs() -> None:
    stage = Engine(EngineConfig(model="dummy-bench-prefill", num_blocks=8, stage=(0, 2)))
    with pytest.raises(ValueError, match="whole model"):
        PromptGraphs(stage.model, 32, capture=False)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and triton_ops.available()),
                    reason="captured prompt graphs need a CUDA GPU and triton (none here)")
def test_captured_prompt_graphs_give_the_eager_steps() -> None:
    graphed, plain = engines("cuda", "bfloat16", tokens=64)
    assert graphed.prompt_graphs is not None and graphed.prompt_graphs.graphs
    calls: dict[str, list] = {"graphed": [], "plain": []}
    got, want = steps(graphed, calls["graphed"]), steps(plain, calls["plain"])
    for g_step, w_step in zip(got, want):
        for g, w in zip(g_step, w_step):
            # bfloat16 rounding: a padded step multiplies matrices of another height
            assert torch.allclose(g, w, atol=3e-2), (g - w).abs().max()
    assert calls["graphed"] == calls["plain"]


@pytest.mark.parametrize("model_type", ["qwen3", "gemma2", "gemma3_text"])
def test_every_familys_layers_cut_into_pieces_give_its_forward(model_type, tmp_path) -> None:
    """Per-head q/k norms (Qwen3, Gemma3), norms around the attention and MLP outputs, the
    embedding scale, soft-capping and sliding windows (Gemma), two ropes (Gemma3): the
    pieces (front and back of each layer, from the static buffers) give the forward's
    logits on a chunk past the window after a prefix."""
    from tests.model.test_architectures import FAMILIES
    from tests.model.tiny_checkpoints import write_checkpoint

    write_checkpoint(model_type, tmp_path, **FAMILIES[model_type])
    ids = torch.randint(0, 320, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    out = []
    for graphed in (True, False):
        e = Engine(EngineConfig(model=str(tmp_path), num_blocks=16, block_size=4))
        if graphed:
            e.prompt_graphs = PromptGraphs(e.model, 32, capture=False)
        table = e.pool.allocate(e.blocks_needed(len(ids)))
        e.prefill(ids[:12], table)
        out.append(e.step([PrefillChunk(ids, 12, 30, table)])[0][0])
    assert torch.allclose(out[0], out[1], atol=1e-5), (out[0] - out[1]).abs().max()
