"""Mixtures of experts (common/model/moe.py; Mixtral, Qwen2-MoE, Qwen3-MoE): the routing
is transformers', a row's answer is the same alone as in any batch, a GGUF's stacked
experts stay quantized on the CPU and answer as their expansion, routers are never
quantized, and which layers are sparse is read as transformers reads it. (Each family's
logits against transformers': test_architectures.py and test_gguf_families.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from common.engine import Engine, EngineConfig, UnknownModelError
from common.model import cpu_linear
from common.model.arch import config_from_hf
from common.model.config import ModelConfig
from common.model.linear import Linear
from common.model.moe import GatedMLP, Mixture
from common.model.quant import quantize
from tests.model.gguf_files import write_family
from tests.model.tiny_checkpoints import (
    assert_alone_as_in_a_batch,
    assert_decodes_as,
    greedy_rows,
    write_checkpoint,
)

QUANT = cpu_linear.quant_kernel()
QWEN3_MOE = {"num_experts": 6, "num_experts_per_tok": 3, "moe_intermediate_size": 32,
             "norm_topk_prob": True}


def _mixture(experts: int, k: int, normalize: bool, hidden: int = 32, inner: int = 16,
             shared: bool = False, seed: int = 0, pack: bool = True) -> Mixture:
    """``pack``: the CPU's packed kernels, else plain weights (a GPU's)."""
    gen = torch.Generator().manual_seed(seed)

    def linear(rows: int, cols: int) -> Linear:
        return Linear(torch.randn(rows, cols, generator=gen) * 0.3, pack)

    def mlp() -> GatedMLP:
        return GatedMLP(linear(2 * inner, hidden), linear(hidden, inner))

    return Mixture(linear(experts, hidden), [mlp() for _ in range(experts)], k, normalize,
                   mlp() if shared else None, linear(1, hidden) if shared else None)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


@pytest.mark.parametrize("normalize, shared_expert", [(True, False), (False, True)])
def test_each_row_is_its_k_best_experts_weighted_by_their_probabilities(
        normalize: bool, shared_expert: bool) -> None:
    """Against every expert run on every row and masked: the k of highest probability,
    their probabilities (renormalized where asked), a sigmoid-gated shared expert."""
    moe = _mixture(8, 3, normalize, shared=shared_expert)
    x = torch.randn(19, 32, generator=torch.Generator().manual_seed(1))
    probs = torch.softmax(moe.router(x), dim=-1)
    top = probs.topk(3, dim=-1)
    mask = torch.zeros_like(probs).scatter(1, top.indices, 1.0)
    weights = probs * mask
    if normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    every = torch.stack([e(x, _silu_mul) for e in moe.experts], dim=1)  # [T, E, hidden]
    want = (every * weights.unsqueeze(-1)).sum(1)
    if shared_expert:
        want = want + torch.sigmoid(moe.shared_gate(x)) * moe.shared(x, _silu_mul)
    assert torch.allclose(moe(x, _silu_mul), want, atol=1e-5)
    got_weights, chosen = moe.route(x)
    assert torch.equal(chosen, top.indices)
    assert torch.allclose(got_weights.sum(-1), torch.ones(19)) == normalize


def test_a_row_is_the_same_alone_as_in_any_batch() -> None:
    """Bit for bit: what a row is routed to and added in does not depend on the rows
    beside it (a greedy answer must not change with the load)."""
    moe = _mixture(8, 2, True, shared=True)
    x = torch.randn(33, 32, generator=torch.Generator().manual_seed(2))
    whole = moe(x, _silu_mul)
    for rows in (slice(0, 1), slice(5, 6), slice(3, 11), slice(0, 32)):
        assert torch.equal(moe(x[rows], _silu_mul), whole[rows])


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("qwen3moe")
    return path, write_checkpoint("qwen3_moe", path, **QWEN3_MOE)


def test_decode_rows_alone_and_in_batches_on_the_engine(qwen3_moe) -> None:
    path, _ = qwen3_moe
    engine = Engine(EngineConfig(model=str(path), num_blocks=96, block_size=4,
                                 prefill_chunk=7))
    a, b = [(7 * i + 3) % 300 for i in range(37)], [(5 * i + 1) % 300 for i in range(13)]
    assert_alone_as_in_a_batch(engine, [a, b], steps=5)
    assert not engine.model.graphable  # which experts run is data: no CUDA graph


def test_a_checkpoint_quantized_at_load_keeps_its_routers_float(qwen3_moe) -> None:
    path, _ = qwen3_moe
    engine = Engine(EngineConfig(model=str(path), quantization="q8_0", num_blocks=16))
    mixture = engine.model.layers[0].mlp
    assert isinstance(mixture, Mixture)
    assert not isinstance(mixture.router.native, cpu_linear.QuantLinear)
    if QUANT is not None:
        assert all(isinstance(linear.native, cpu_linear.QuantLinear)
                   for e in mixture.experts for _, linear in e.linears())


@pytest.fixture(scope="module")
def quantized_mixture(tmp_path_factory: pytest.TempPathFactory):
    """A Qwen3-MoE GGUF whose matrices are Q8_0, each layer's experts stacked in one
    tensor (its router float32, as llama.cpp's quantize leaves it), with a cache of its
    own; and transformers' model with each matrix rounded as the file's."""
    path = tmp_path_factory.mktemp("q8moe")
    hf, _, gguf = write_family("qwen3moe", path, matrices="Q8_0")
    with torch.no_grad():  # transformers holds each layer's experts as [experts, rows, k]
        for name, param in hf.named_parameters():
            if param.dim() >= 2 and not name.endswith("gate.weight"):
                rows = param.reshape(-1, param.shape[-1])
                param.copy_(quantize(rows, "q8_0").dequantize().view(param.shape))
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CRESCENT_CACHE_DIR", str(path / "cache"))
        yield gguf, hf


def test_a_quantized_gguf_keeps_its_experts_so_and_answers_as_their_expansion(
        quantized_mixture) -> None:
    gguf, hf = quantized_mixture
    prompts = [[(7 * i + 3) % 300 for i in range(37)], [(5 * i + 1) % 300 for i in range(13)]]
    got = {}
    for mode in ("auto", "none"):
        engine = Engine(EngineConfig(model=str(gguf), quantization=mode, num_blocks=96,
                                     block_size=4, prefill_chunk=7))
        expert = engine.model.layers[1].mlp.experts[5].down
        assert isinstance(expert.native, cpu_linear.QuantLinear) == (
            mode == "auto" and QUANT is not None)
        got[mode] = greedy_rows(engine, prompts, steps=4)
        assert_decodes_as(engine, hf, prompts, steps=4)
    assert all(torch.equal(a, b) for a, b in zip(got["auto"], got["none"]))


def _config(**d) -> ModelConfig:
    base = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    return config_from_hf({**base, **d}, "m")


def test_which_layers_are_sparse_is_read_as_transformers_reads_it() -> None:
    qwen = _config(architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                   decoder_sparse_step=2, mlp_only_layers=[3])
    assert qwen.dense_layers == (0, 2, 3, 4)  # odd layers sparse, but for layer 3
    assert [qwen.sparse(i) for i in range(6)] == [False, True, False, False, False, True]
    assert not qwen.normalize_experts  # transformers' default: norm_topk_prob false
    mixtral = _config(architectures=["MixtralForCausalLM"], num_local_experts=8)
    assert mixtral.dense_layers == () and mixtral.normalize_experts
    assert mixtral.expert_intermediate_size == 48  # Mixtral's experts are intermediate_size
    cut = qwen.with_layers(3)
    assert cut.dense_layers == (0, 2)
    assert ModelConfig.from_dict(json.loads(json.dumps(qwen.to_dict()))) == qwen
    with pytest.raises(ValueError, match="not a mixture"):
        _config(architectures=["Qwen3MoeForCausalLM"], num_experts=2, num_experts_per_tok=3)


def test_a_checkpoint_missing_an_expert_is_refused_by_name(qwen3_moe, tmp_path: Path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    path, _ = qwen3_moe
    for name in ("config.json", "model.safetensors"):
        shutil.copy(path / name, tmp_path / name)
    weights = load_file(str(tmp_path / "model.safetensors"))
    del weights["model.layers.1.mlp.experts.4.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(UnknownModelError,
                       match="missing weight 'model.layers.1.mlp.experts.4.up_proj.weight'"):
        Engine(EngineConfig(model=str(tmp_path), num_blocks=8, block_size=4))


@pytest.mark.skipif(cpu_linear.experts_kernel() is None, reason="the CPU quantized kernels "
                    "did not build (no compiler or no AVX-512): experts run one by one")
@pytest.mark.parametrize("linear_dtype", [None, "int8"])
def test_quantized_experts_in_one_call_are_each_experts_own(quantized_mixture,
                                                            linear_dtype) -> None:
    """Each projection of all of a layer's experts in one kernel call
    (cpu_linear.ExpertLinears) gives what the experts' calls one by one give, bit for bit,
    and a row alone what it gives in a batch."""
    gguf, _ = quantized_mixture
    engine = Engine(EngineConfig(model=str(gguf), linear_dtype=linear_dtype, num_blocks=96,
                                 block_size=4, prefill_chunk=7))
    mixtures = [lw.mlp for lw in engine.model.layers if isinstance(lw.mlp, Mixture)]
    assert mixtures and all(m.grouped is not None for m in mixtures)
    prompts = [[(7 * i + 3) % 300 for i in range(37)], [(5 * i + 1) % 300 for i in range(13)]]
    grouped = assert_alone_as_in_a_batch(engine, prompts, steps=4)
    for mixture in mixtures:
        mixture.grouped = None
    one_by_one = greedy_rows(engine, prompts, steps=4)
    assert all(torch.equal(a, b) for a, b in zip(grouped, one_by_one))


def test_stacked_experts_in_grouped_matmuls_give_the_loops_answer() -> None:
    """``Mixture.stack`` (a CUDA model's path in bfloat16: torch._grouped_mm over the
    stacked weights, offsets made on the device), run here on the CPU in float32: the
    expert-by-expert answer, for rows routed to few or many experts, an expert given no
    row, and one row; no second copy of the weights."""
    moe = _mixture(8, 3, True, shared=True, pack=False)
    x = torch.randn(23, 32, generator=torch.Generator().manual_seed(4))
    want = moe(x, _silu_mul)
    one = moe(x[:1], _silu_mul)
    moe.stack()
    assert moe.stacked is not None
    assert moe.experts[3].down.weight.data_ptr() == moe.stacked[1][3].data_ptr()
    assert torch.allclose(moe(x, _silu_mul), want, atol=1e-5)
    assert torch.allclose(moe(x[:1], _silu_mul), one, atol=1e-5)
    few = x[:2]  # 6 choices of 8 experts: some get none
    assert torch.allclose(moe(few, _silu_mul), want[:2], atol=1e-5)


def test_olmoes_clipped_qkv_is_refused(tmp_path: Path) -> None:
    """OLMoE's ``clip_qkv`` (q, k and v clamped) is not done here: refused, not ignored."""
    write_checkpoint("olmoe", tmp_path, num_experts=4, num_experts_per_tok=2,
                     intermediate_size=32)
    config = json.loads((tmp_path / "config.json").read_text())
    config["clip_qkv"] = 8.0
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnknownModelError, match="clip_qkv is not supported"):
        Engine(EngineConfig(model=str(tmp_path), num_blocks=8, block_size=4))


@pytest.mark.skipif(QUANT is None, reason="the CPU quantized kernel did not build (no "
                    "compiler or no AVX-512): quantized weights are expanded to float")
def test_experts_stay_quantized_with_bfloat16_linears(quantized_mixture) -> None:
    """With bfloat16 linears (default.toml's on an AVX-512 BF16 CPU) a quantized file's
    attention and dense matrices are expanded, as before, but its experts, most of a
    mixture's weights and each seeing few rows, keep their codes; the answers stay
    transformers' on the rounded checkpoint within bfloat16's rounding."""
    gguf, hf = quantized_mixture
    engine = Engine(EngineConfig(model=str(gguf), linear_dtype="bfloat16", num_blocks=96,
                                 block_size=4, prefill_chunk=7))
    mixture = engine.model.layers[1].mlp
    assert isinstance(mixture, Mixture) and mixture.grouped is not None
    assert not isinstance(engine.model.layers[1].wqkv.native, cpu_linear.QuantLinear)
    assert engine.model.kept_quantized > engine.model.expanded_quantized > 0
    ids = [(7 * i + 3) % 300 for i in range(37)]
    got = engine.prefill(ids, engine.pool.allocate(engine.blocks_needed(len(ids))))
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, -1].float()
    assert (got - want).abs().max() < 0.05 * want.abs().max()
