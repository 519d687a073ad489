"""Quantized linears (common/model/quant.py, csrc/linear_q.c): every GGUF type the form
takes gives gguf's own float32 weights; the kernel gives the float32 kernel's result on
them bit for bit, each row alone whatever the batch; a GGUF's matrices stay quantized in
the cache and the model, which answers as the expanded one did, logit for logit; a float
checkpoint quantized at load keys its KV apart."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import ClusterConfig
from common.engine import Engine, EngineConfig, EngineInputError
from common.kv.block_keys import model_fingerprint
from common.model import cpu_linear
from common.model.linear import Linear
from common.model.quant import QuantizedWeight, from_gguf, gather, quantize
from tests.model.gguf_files import write_family
from tests.model.tiny_checkpoints import (
    assert_alone_as_in_a_batch,
    assert_decodes_as,
    greedy_rows,
)

QUANT = cpu_linear.quant_kernel()
INT8 = cpu_linear.quant_kernel(int8=True)
F32 = cpu_linear.kernel(torch.float32)
needs_kernels = pytest.mark.skipif(
    QUANT is None or F32 is None, reason="the CPU quantized and float32 linear kernels did "
    "not build (no C compiler or no AVX-512): quantized weights are expanded to float")
# the float16 fields of each type's block (offsets): random bytes there could be NaN
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
          "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """An [n, k] tensor of ``type_name`` as a GGUF holds it: random codes and scales."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for at in HALVES[type_name]:
        data[..., at:at + 2] = rng.normal(0, 0.05, (n, k // block, 1)).astype(
            np.float16).view(np.uint8)
    return data.reshape(n, -1)


@pytest.mark.parametrize("type_name", list(HALVES))
def test_each_type_gives_ggufs_own_float32_weights(type_name: str) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    data = random_blocks(type_name, 6, 512, seed=len(type_name))
    want = dequantize(data, GGMLQuantizationType[type_name]).reshape(6, 512)
    got = from_gguf(data, type_name, (6, 512))
    assert got is not None and got.shape == (6, 512)
    assert got.bits == (4 if type_name in ("Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K") else 8)
    assert got.group == (16 if type_name in ("Q2_K", "Q3_K", "Q6_K") else 32)
    assert np.array_equal(got.dequantize().numpy(), want)  # bit for bit (0.0 == -0.0)


def test_other_types_are_read_as_float() -> None:
    assert from_gguf(np.zeros((2, 136 * 2), np.uint8), "IQ4_XS", (2, 512)) is None
    assert from_gguf(np.zeros((2, 128), np.uint8), "F32", (2, 32)) is None


def test_joined_rows_keep_every_weight_and_the_parts_round_trip() -> None:
    """A layer's q/k/v of different types (a Q4_K_M file: Q6_K v beside Q4_K q and k) in
    one matmul: the widest codes, the smallest group, the same floats."""
    q = from_gguf(random_blocks("Q4_K", 8, 256, 1), "Q4_K", (8, 256))
    v = from_gguf(random_blocks("Q6_K", 4, 256, 2), "Q6_K", (4, 256))
    joined = QuantizedWeight.cat([q, v, q.rows(slice(0, 2))])
    assert (joined.bits, joined.group, joined.shape) == (8, 16, (14, 256))
    assert torch.equal(joined.dequantize(), torch.cat([q.dequantize(), v.dequantize(),
                                                       q.dequantize()[:2]]))
    back = gather({**q.flatten("a.weight"), **v.flatten("b.weight"), "c": torch.ones(2)})
    assert set(back) == {"a.weight", "b.weight", "c"}
    assert torch.equal(back["a.weight"].dequantize(), q.dequantize())
    assert torch.equal(back["b.weight"].dequantize(), v.dequantize())


def _expanded(weight: QuantizedWeight) -> cpu_linear.PackedLinear:
    return cpu_linear.PackedLinear(F32, weight.dequantize(), torch.float32)


@needs_kernels
@pytest.mark.parametrize("type_name, n, k", [("Q4_0", 200, 96), ("Q8_0", 64, 64),
                                             ("Q6_K", 130, 512), ("Q4_K", 576, 256),
                                             ("Q5_1", 3, 160), ("Q3_K", 70, 256)])
def test_the_kernel_is_the_float32_kernel_on_the_expanded_weights(type_name: str, n: int,
                                                                  k: int) -> None:
    """Bit for bit, at a decode step's rows (the fused way) and a prompt's (chunked),
    every row the same alone, in any batch, on one thread or two."""
    weight = from_gguf(random_blocks(type_name, n, k, seed=n), type_name, (n, k))
    x = torch.randn(150, k, generator=torch.Generator().manual_seed(k))
    quant, expanded = cpu_linear.QuantLinear(QUANT, weight), _expanded(weight)
    alone = torch.cat([quant(x[i:i + 1]) for i in range(0, 150, 7)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (1, 2, 3, 5, 6, 7, 13, 16, 17, 40, 150):
                got = quant(x[:m])
                assert torch.equal(got, expanded(x[:m])), (t, m)
                assert torch.equal(got[::7], alone[:len(got[::7])]), (t, m)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(INT8 is None, reason="the CPU int8 linear kernel did not build (no C "
                    "compiler or no AVX-512 VNNI): linear_dtype int8 multiplies in float32")
@pytest.mark.parametrize("type_name, n, k", [("Q4_0", 200, 96), ("Q8_0", 64, 64),
                                             ("Q6_K", 130, 512), ("Q4_K", 576, 256),
                                             ("Q2_K", 64, 256)])
def test_int8_inputs_give_the_reference_and_each_row_alone(type_name: str, n: int,
                                                           k: int) -> None:
    """csrc/linear_int8.c: its inputs rounded per group as ``int8_reference`` rounds them,
    exact integer sums, float32 only at each group's end; a row the same alone, in any
    batch, on one thread or two."""
    weight = from_gguf(random_blocks(type_name, n, k, seed=n), type_name, (n, k))
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(k))
    x[3, :16] = 0.0  # a group of zeros (its scale 0)
    linear = cpu_linear.QuantLinear(INT8, weight, int8=True)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(40)])
    want = cpu_linear.int8_reference(x, weight)
    assert (alone.double() - want).abs().max() < 1e-6 * want.abs().max()  # float32 sums
    exact = x.double() @ weight.dequantize().double().T  # what rounding the inputs costs
    assert not torch.allclose(alone.double(), exact, atol=1e-6)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for m in (1, 2, 3, 4, 7, 40):
                assert torch.equal(linear(x[:m]), alone[:m]), (t, m)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
def test_linear_runs_a_quantized_weight_on_the_kernel() -> None:
    weight = quantize(torch.randn(96, 64), "q8_0")
    bias = torch.randn(96)
    linear = Linear(weight, bias=bias, dtype=torch.bfloat16)  # the kernel's float32 wins
    assert isinstance(linear.native, cpu_linear.QuantLinear) and linear.weight is None
    x = torch.randn(3, 64)
    assert torch.equal(linear(x), _expanded(weight)(x) + bias)
    unpacked = Linear(weight, pack=False)  # no kernel: expanded
    assert unpacked.native is None and torch.equal(unpacked.weight, weight.dequantize())
    int8 = Linear(weight, dtype=torch.int8)
    assert int8.native.int8 == (INT8 is not None)
    plain = Linear(torch.randn(96, 64), dtype=torch.int8)  # a float weight: its own dtype
    assert plain.cast is None and not isinstance(plain.native, cpu_linear.QuantLinear)


@pytest.fixture(scope="module")
def quantized_llama(tmp_path_factory: pytest.TempPathFactory):
    """A LLaMA GGUF whose matrices are Q8_0 (its q and k rows permuted, as the convert
    script writes them), with a cache of its own; and transformers' model of the
    checkpoint with each matrix rounded as the file's (row by row, as Q8_0 rounds)."""
    path = tmp_path_factory.mktemp("q8")
    hf, _, gguf = write_family("llama", path, matrices="Q8_0")
    with torch.no_grad():
        for param in hf.parameters():
            if param.dim() == 2:
                param.copy_(quantize(param, "q8_0").dequantize())
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CRESCENT_CACHE_DIR", str(path / "cache"))
        yield gguf, path / "cache", hf


def test_a_quantized_gguf_answers_as_its_expansion_logit_for_logit(quantized_llama) -> None:
    """Kept quantized ("auto") or expanded ("none"): the same float32 logits, bit for
    bit, on a prefill in chunks and batched decode steps, and transformers' on the
    rounded checkpoint (the un-permuted q/k rows, the joined q/k/v, the tied LM head);
    the cache holds the codes, not floats."""
    gguf, cache, hf = quantized_llama
    prompts = [[(7 * i + 3) % 300 for i in range(37)], [(5 * i + 1) % 300 for i in range(13)]]
    got = {}
    for mode in ("auto", "none"):
        engine = Engine(EngineConfig(model=str(gguf), quantization=mode, num_blocks=96,
                                     block_size=4, prefill_chunk=7))
        kept = isinstance(engine.model.layers[0].wqkv.native, cpu_linear.QuantLinear)
        assert kept == (mode == "auto" and QUANT is not None)
        got[mode] = greedy_rows(engine, prompts, steps=4)
        assert_decodes_as(engine, hf, prompts, steps=4)
    assert all(torch.equal(a, b) for a, b in zip(got["auto"], got["none"]))
    (shards,) = [p for p in cache.iterdir() if p.is_dir()]
    names = set()
    for file in shards.glob("*.safetensors"):
        from safetensors import safe_open

        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    assert "model.layers.0.self_attn.q_proj.weight.q8codes" in names
    assert "model.layers.0.self_attn.q_proj.weight" not in names


def test_bfloat16_linears_take_the_expansion(quantized_llama) -> None:
    """Where the linears multiply in bfloat16 (faster there at 8 rows and more) the
    matrices are expanded, and counted for the worker's log."""
    gguf = quantized_llama[0]
    bf16 = Engine(EngineConfig(model=str(gguf), linear_dtype="bfloat16", num_blocks=16))
    assert not isinstance(bf16.model.layers[0].wqkv.native, cpu_linear.QuantLinear)
    assert bf16.model.kept_quantized == 0 and bf16.model.expanded_quantized > 0
    f32 = Engine(EngineConfig(model=str(gguf), num_blocks=16))
    if QUANT is not None:
        assert f32.model.expanded_quantized == 0
        assert f32.model.kept_quantized == bf16.model.expanded_quantized


def test_int8_linears_decode_near_the_float_model_and_alone_as_in_a_batch(
        quantized_llama) -> None:
    """``linear_dtype = "int8"``: the model's linears on csrc/linear_int8.c, its logits
    near the float32 ones (the inputs' rounding), a sequence's the same alone as beside
    another."""
    gguf = quantized_llama[0]
    engine = Engine(EngineConfig(model=str(gguf), linear_dtype="int8", num_blocks=96,
                                 block_size=4, prefill_chunk=7))
    assert engine.model.kept_quantized > 0
    assert engine.model.layers[0].mlp.down.native.int8 == (INT8 is not None)
    plain = Engine(EngineConfig(model=str(gguf), num_blocks=96, block_size=4,
                                prefill_chunk=7))
    a, b = [(7 * i + 3) % 300 for i in range(37)], [(5 * i + 1) % 300 for i in range(13)]
    together = assert_alone_as_in_a_batch(engine, [a, b], steps=4)
    # the same inputs: within what rounding them costs this random model (its weights'
    # scale 0.2; SmolLM2's prompt logits moved 3 %, BENCHMARKS.md "Quantized linears")
    for x, y in zip(together[:2], greedy_rows(plain, [a, b], steps=0)):
        assert 0 < (x - y).abs().max() < 0.25 * y.abs().max()


def test_a_float_checkpoint_quantized_at_load_keys_its_kv_apart() -> None:
    plain = Engine(EngineConfig(model="dummy-tiny", num_blocks=32))
    q8 = Engine(EngineConfig(model="dummy-tiny", quantization="q8_0", num_blocks=32))
    if QUANT is not None:
        assert isinstance(q8.model.layers[0].mlp.down.native, cpu_linear.QuantLinear)
        assert isinstance(q8.model.lm_head.native, cpu_linear.QuantLinear)
    a, b = greedy_rows(plain, [list(range(20))], 2), greedy_rows(q8, [list(range(20))], 2)
    assert all(torch.allclose(x, y, atol=0.05) and not torch.equal(x, y) for x, y in zip(a, b))
    assert q8.fingerprint != plain.fingerprint  # its blocks are other bytes
    assert q8.fingerprint == model_fingerprint(q8.model_config, "float32", "q8_0")
    assert plain.fingerprint == model_fingerprint(plain.model_config, "float32", "none")


def test_a_checkpoint_quantized_at_load_is_cached(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An HF directory with ``quantization = "q4_0"``: rounded once, then read from the
    cache (the rounding is not called again), the same weights."""
    from common.model import quant
    from tests.model.tiny_checkpoints import write_checkpoint

    write_checkpoint("llama", tmp_path / "m")
    monkeypatch.setenv("CRESCENT_CACHE_DIR", str(tmp_path / "cache"))
    config = EngineConfig(model=str(tmp_path / "m"), quantization="q4_0", num_blocks=16)
    first = Engine(config)
    (cached,) = [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("q4_0-")]
    assert list(cached.glob("*.safetensors"))
    monkeypatch.setattr(quant, "quantize", lambda *_: pytest.fail("rounded again"))
    again = Engine(config)
    x = torch.randn(2, first.model.layers[0].mlp.down.in_features)
    assert torch.equal(first.model.layers[0].mlp.down(x), again.model.layers[0].mlp.down(x))
    assert again.model.kept_quantized == first.model.kept_quantized > 0


def test_an_unknown_quantization_or_linear_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="quantization must be one of auto, none"):
        ClusterConfig(quantization="int4")
    with pytest.raises(EngineInputError, match="quantization must be one of"):
        Engine(EngineConfig(model="dummy-tiny", quantization="int4"))
    with pytest.raises(ValueError, match="linear_dtype must be auto, .* or int8"):
        ClusterConfig(linear_dtype="int4")
    with pytest.raises(ValueError, match="prefill_dtype must be .* or int8"):
        ClusterConfig(prefill_dtype="int4")
    with pytest.raises(EngineInputError, match="unknown linear_dtype 'int4'"):
        Engine(EngineConfig(model="dummy-tiny", linear_dtype="int4"))
    assert ClusterConfig(linear_dtype="int8").linear_dtype == "int8"


def test_the_workers_get_it(tmp_path: Path) -> None:
    """``quantization`` on every worker; ``linear_dtype`` int8 on decode workers;
    ``prefill_dtype`` int8: a prefill worker in float32, its linears in int8."""
    from common.worker import engine_config

    config = ClusterConfig(quantization="q4_0", linear_dtype="int8")
    decode, prefill = engine_config(config, "decode"), engine_config(config, "prefill")
    assert decode.quantization == prefill.quantization == "q4_0"
    assert (decode.dtype, decode.linear_dtype) == ("float32", "int8")
    assert (prefill.dtype, prefill.linear_dtype) == ("float32", None)
    prefill = engine_config(ClusterConfig(prefill_dtype="int8"), "prefill")
    assert (prefill.dtype, prefill.linear_dtype) == ("float32", "int8")
    assert engine_config(ClusterConfig(prefill_dtype="int8"), "decode").linear_dtype is None


@needs_kernels
@pytest.mark.parametrize("linear_dtype", [None, "int8"])
def test_tied_embeddings_are_looked_up_from_the_lm_heads_codes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, linear_dtype) -> None:
    """A tied, quantized embedding is held once: the lookup reads the LM head's packed
    codes (either kernel's layout), giving the file's rows bit for bit."""
    from common.model.loader import load_model_source

    monkeypatch.setenv("CRESCENT_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_family("qwen3", tmp_path, matrices="Q8_0")[2]  # tied (no output.weight)
    engine = Engine(EngineConfig(model=str(gguf), linear_dtype=linear_dtype, num_blocks=16))
    model = engine.model
    assert model.embed is model.lm_head.native
    ids = torch.tensor([0, 1, 63, 64, 200, 319])
    want = load_model_source(str(gguf))[1]["model.embed_tokens.weight"].rows(ids).dequantize()
    assert torch.equal(model.embed_tokens(ids), want)


@needs_kernels
@pytest.mark.parametrize("bits, group", [(4, 32), (4, 16), (8, 32), (8, 16)])
@pytest.mark.parametrize("int8", [False, True])
def test_rows_read_back_from_packed_codes_are_the_weights(bits: int, group: int,
                                                         int8: bool) -> None:
    """``QuantLinear.rows``: rows across tiles and both nibbles of either kernel's layout
    (a partial last tile too) are ``dequantize``'s, bit for bit."""
    kernel = cpu_linear.quant_kernel(int8) or QUANT
    g = torch.Generator().manual_seed(bits + group)
    n, k = 200, 96
    weight = QuantizedWeight(torch.randint(0, 256, (n, k * bits // 8), generator=g,
                                           dtype=torch.uint8),
                             torch.rand(n, k // group, generator=g),
                             torch.randn(n, k // group, generator=g), bits)
    linear = cpu_linear.QuantLinear(kernel, weight, int8 and INT8 is not None)
    ids = torch.tensor([0, 5, 15, 16, 31, 32, 47, 48, 63, 64, 130, 199])
    assert torch.equal(linear.rows(ids), weight.rows(ids).dequantize())


@pytest.mark.parametrize("memory_gib, expand", [(64, True), (24, False)])
def test_auto_dtypes_keep_the_codes_where_bfloat16_would_not_fit(
        monkeypatch: pytest.MonkeyPatch, memory_gib: int, expand: bool) -> None:
    """default.toml's ``auto`` dtypes on a CPU with bfloat16: an 8B Q4_0 model's matrices
    (8.0B parameters, ~15 GiB in bfloat16 in each of a prefill and a decode worker) expand
    on a 64 GiB host and keep their codes on a 24 GiB one, on both workers; a pipeline's
    stages hold their share; the default model expands on either. (Its tensors are not
    made: the parameters are counted from the shapes.)"""
    from common import worker

    monkeypatch.setattr(worker, "native_bfloat16", lambda: True)
    monkeypatch.setattr(worker, "memory_bytes", lambda: memory_gib << 30)
    config = ClusterConfig.load("launch/configs/default.toml", {
        "model": "dummy-llama3-8b", "quantization": "q4_0"})
    prefill, decode = (worker.engine_config(config, r) for r in ("prefill", "decode"))
    want = ("bfloat16", "bfloat16") if expand else ("float32", None)
    assert (prefill.dtype, decode.linear_dtype) == want
    default = ClusterConfig.load("launch/configs/default.toml")
    assert worker.engine_config(default, "decode").linear_dtype == "bfloat16"
    # on 64 GiB: two stages of one group (half the layers each) as one prefill worker; a
    # second whole prefill worker is 45 GiB in all
    monkeypatch.setattr(worker, "memory_bytes", lambda: 64 << 30)
    staged = ClusterConfig.load("launch/configs/default.toml", {
        "model": "dummy-llama3-8b", "quantization": "q4_0", "prefill_stages": 2})
    assert worker.engine_config(staged, "decode").linear_dtype == "bfloat16"
    whole = ClusterConfig.load("launch/configs/default.toml", {
        "model": "dummy-llama3-8b", "quantization": "q4_0", "prefill_workers": 2})
    assert worker.engine_config(whole, "decode").linear_dtype is None


def test_a_dummy_quantized_at_load_is_rounded_once(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A dummy's seeded weights quantized at load are cached under its shape, as a
    checkpoint's are: the next engine maps them (an 8B dummy took ~85 s and 6 GB of each
    worker's memory to round); another shape gets its own."""
    import glob

    from common.engine import Engine, EngineConfig

    monkeypatch.setenv("CRESCENT_CACHE_DIR", str(tmp_path))
    first = Engine(EngineConfig(model="dummy-tiny", quantization="q8_0", num_blocks=8))
    assert len(glob.glob(str(tmp_path / "q8_0-*"))) == 1
    again = Engine(EngineConfig(model="dummy-tiny", quantization="q8_0", num_blocks=8))
    ids = list(range(5, 25))
    assert torch.equal(first.prefill(ids, first.pool.allocate(2)),
                       again.prefill(ids, again.pool.allocate(2)))
    Engine(EngineConfig(model="dummy-tiny", quantization="q8_0", num_blocks=8, num_layers=1))
    assert len(glob.glob(str(tmp_path / "q8_0-*"))) == 2
