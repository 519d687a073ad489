"""The CUDA path: the engine on a GPU agrees with the CPU, and KV in GPU memory moves through
the transfer engine (the CUDA build of mooncake-transfer-engine) to host and GPU memory.

Skipped without a CUDA GPU. ``benchmarks/gpu_device.sh`` runs these on a lent GPU machine.
"""
from __future__ import annotations

import asyncio

import pytest
import torch

from common.engine import DecodeInput, Engine, EngineConfig
from common.engine.config import PrefillChunk
from common.transfer import TransferAgent

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the CUDA path needs a CUDA GPU (none here)")]


def _run(device: str, dtype: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A prompt in chunks of 32 after a cached prefix, two decoding sequences, then five
    greedy tokens; logits come back on the CPU."""
    e = Engine(EngineConfig(model="dummy-tiny", dtype=dtype, device=device, num_blocks=64,
                            block_size=16, prefill_chunk=32))
    ids = torch.randint(3, 500, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    a, b = e.pool.allocate(e.blocks_needed(170)), e.pool.allocate(e.blocks_needed(170))
    e.prefill(ids[:64], a)
    first = e.prefill(ids, a, num_cached_tokens=64).float().cpu()  # KV of 64 reused
    e.prefill(ids[:100], b)
    step = e.decode_step([DecodeInput(ids[-1], 150, a), DecodeInput(7, 100, b)]).float().cpu()
    tokens, pos = [int(first.argmax())], 151
    for _ in range(5):
        logits = e.decode_step([DecodeInput(tokens[-1], pos, a)])[0]
        tokens.append(int(logits.argmax()))
        pos += 1
    return first, step, tokens


def test_engine_on_cuda_equals_cpu() -> None:
    cpu_first, cpu_step, cpu_tokens = _run("cpu", "float32")
    gpu_first, gpu_step, gpu_tokens = _run("cuda", "float32")
    assert torch.allclose(gpu_first, cpu_first, atol=1e-4, rtol=1e-4)
    assert torch.allclose(gpu_step, cpu_step, atol=1e-4, rtol=1e-4)
    assert gpu_tokens == cpu_tokens
    bf_first, bf_step, _ = _run("cuda", "bfloat16")  # the dtype a GPU serves in
    assert torch.isfinite(bf_first).all() and torch.isfinite(bf_step).all()
    assert torch.allclose(bf_first, cpu_first, atol=5e-2)


def test_three_stages_on_cuda_fed_host_hidden_states_give_the_whole_models_logits() -> None:
    """A pipeline's stages on the GPU, each fed its predecessor's hidden states from host
    memory, as a stage's inbox slot delivers them: the last stage's logits are the whole
    model's. (Before, a later stage kept them on the host and died on its first step.)"""
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(2)).tolist()

    def engine(stage: tuple[int, int]) -> Engine:
        torch.manual_seed(0)
        return Engine(EngineConfig(model="dummy-bench-prefill", device="cuda", num_blocks=8,
                                   block_size=16, prefill_chunk=64, stage=stage))

    whole = engine((0, 1))
    want = whole.prefill(ids, whole.pool.allocate(whole.blocks_needed(40))).float().cpu()
    hidden = None
    for k in range(3):
        e = engine((k, 3))
        chunk = PrefillChunk(ids, 0, 40, e.pool.allocate(e.blocks_needed(40)))
        hidden, rows = e.stage_step([chunk], hidden)
        hidden = hidden.cpu()
    assert rows[0] is not None
    assert torch.allclose(rows[0].float().cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("src_dev,dst_dev", [("cuda", "cpu"), ("cpu", "cuda"), ("cuda", "cuda")])
def test_transfer_engine_moves_gpu_memory(src_dev: str, dst_dev: str) -> None:
    """What a GPU worker does with its KV pool: register the device memory with the
    transfer engine, then write scattered blocks to a peer and read them back."""
    local, remote = TransferAgent(), TransferAgent()
    try:
        n, block = 64, 64 << 10
        src = torch.randint(0, 255, (n * block,), dtype=torch.uint8, device=src_dev)
        dst = torch.zeros(n * block, dtype=torch.uint8, device=dst_dev)
        back = torch.zeros_like(src)
        for agent, t in ((local, src), (remote, dst), (local, back)):
            agent.register(t.data_ptr(), t.numel())
        order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
        lengths = [block] * n
        moved = local.write(remote.session_id, [src.data_ptr() + i * block for i in range(n)],
                            [dst.data_ptr() + j * block for j in order], lengths, timeout=30)
        assert moved == n * block
        got = dst.view(n, block).cpu()
        want = src.view(n, block).cpu()
        assert all(torch.equal(got[j], want[i]) for i, j in enumerate(order))
        local.read(remote.session_id, [back.data_ptr()], [dst.data_ptr()], [n * block], timeout=30)
        assert torch.equal(back.cpu(), dst.cpu())
    finally:
        local.close()
        remote.close()


def test_seeded_sampling_on_cuda_draws_what_the_cpu_draws() -> None:
    """A seeded request's generator lives on the CPU (make_generator), so a GPU worker's
    logits give the same tokens as a CPU worker's; a logit_bias and a penalty apply there."""
    from common.engine.sampling import make_generator, sample
    from common.sampling_params import SamplingParams

    logits = torch.randn(3, 4096, generator=torch.Generator().manual_seed(2)) * 3
    params = [SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=s,
                             logit_bias_ids=(5,), logit_bias_values=(2.0,),
                             presence_penalty=0.5) for s in (1, 2, 3)]
    outputs = [[5, 9], [], [7]]

    def draw(device: str) -> list[int]:
        return sample(logits.to(device), params, [make_generator(p, 1) for p in params],
                      outputs=outputs).tokens

    assert draw("cuda") == draw("cpu")


def test_a_json_schema_document_sampled_on_cuda_parses() -> None:
    """A grammar's token bitmask applied to GPU logits (xgrammar's kernel on the device):
    seeded sampling from random GPU logits under a JSON schema gives a document that parses
    and names the required key, and each token is what the CPU draws from the same row."""
    import json

    from common.grammar import Grammars, tokenizer_info
    from common.engine.sampling import make_generator, sample
    from common.model.tokenizer import ByteTokenizer
    from common.sampling_params import SamplingParams

    tok = ByteTokenizer(300)
    grammars = Grammars(lambda: tokenizer_info(tok, 300, (tok.eos_token_id,)))
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(64, temperature=1.0, seed=4, response_format=json.dumps(
        {"type": "json_schema", "json_schema": {"schema": schema}}, separators=(",", ":")))
    matchers = {dev: grammars.matcher(params) for dev in ("cuda", "cpu")}
    gens = {dev: make_generator(params, 1) for dev in ("cuda", "cpu")}
    rows = torch.randn(64, 300, generator=torch.Generator().manual_seed(5)) * 2
    out: list[int] = []
    for row in rows:
        picked = {dev: sample(row[None].to(dev), [params], [gens[dev]],
                              grammars.bitmask([matchers[dev]])).tokens[0] for dev in matchers}
        assert picked["cuda"] == picked["cpu"]
        if picked["cuda"] == tok.eos_token_id:
            break
        out.append(picked["cuda"])
        for m in matchers.values():
            assert m.accept_token(picked["cuda"])
    assert isinstance(json.loads(tok.decode(out))["n"], int)


def test_layer_wise_kv_from_the_gpu_is_what_the_engine_wrote() -> None:
    """A prefill on the GPU streams each layer's KV through the transfer engine as the
    next layers compute (services/prefill/layer_io.py). The engine's kernels are queued,
    not done, when a layer's hook runs; the peer still gets every layer's final bytes, not
    the zeros the KV memory held before, because the transfer engine's copy (cudaMemcpy on
    the default stream, like the kernels) waits for the kernels queued before it."""
    from concurrent.futures import ThreadPoolExecutor

    from common.engine.config import PrefillChunk
    from common.kv.memory import PagedKVMemory
    from services.prefill.layer_io import PartIO, StepIO
    from services.prefill.streaming import KVStream

    e = Engine(EngineConfig(model="dummy-llama3-8b", num_layers=4, dtype="bfloat16",
                            device="cuda", num_blocks=300, block_size=16, prefill_chunk=4096))
    peer = PagedKVMemory(300, 4, 16, e.model_config.num_kv_heads, e.model_config.head_dim,
                         e.kv.dtype, "cuda")
    local, remote = TransferAgent(), TransferAgent()
    lane = ThreadPoolExecutor(1)
    try:
        local.register(e.kv.base_address, e.kv.nbytes)
        remote.register(peer.base_address, peer.nbytes)
        n = 4096
        ids = torch.randint(3, 100000, (n,), generator=torch.Generator().manual_seed(3)).tolist()
        table = e.pool.allocate(e.blocks_needed(n))
        remote_blocks = list(reversed(range(300)))[:len(table)]
        stream = KVStream(local, lane, e.kv, table, remote_blocks, remote.session_id,
                          peer.base_address)
        io = StepIO([PartIO(stream, 0, n)], e.kv, 0, None, None, True)
        e.stage_step([PrefillChunk(ids, 0, n, table)], None, io.after, io.before)
        assert asyncio.run(stream.wait(60)) == len(table) * e.kv.block_nbytes
        got = peer.data[remote_blocks].cpu()
        want = e.kv.data[table].cpu()
        assert want.abs().amax(dim=(2, 3, 4, 5)).min() > 0  # every layer of every block written
        assert torch.equal(got, want)
    finally:
        lane.shutdown()
        local.close()
        remote.close()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_mixtures_and_latent_attention_on_cuda_equal_cpu(tmp_path, model_type: str) -> None:
    """A mixture of experts (and DeepSeek's latent attention) on the GPU: float32 gives the
    CPU's logits and greedy tokens (the experts one by one); bfloat16 stacks the experts
    for torch._grouped_mm at load and stays near them. Written on a CPU-only day
    (2026-11-29), not yet run."""
    from common.model.moe import Mixture
    from tests.model.test_architectures import FAMILIES
    from tests.model.tiny_checkpoints import write_checkpoint

    write_checkpoint(model_type, tmp_path, **FAMILIES[model_type])
    ids = torch.randint(3, 300, (40,), generator=torch.Generator().manual_seed(3)).tolist()

    def run(device: str, dtype: str) -> tuple[Engine, torch.Tensor, list[int]]:
        e = Engine(EngineConfig(model=str(tmp_path), dtype=dtype, device=device,
                                num_blocks=64, block_size=16, prefill_chunk=16))
        table = e.pool.allocate(e.blocks_needed(50))
        first = e.prefill(ids, table).float().cpu()
        tokens, pos = [int(first.argmax())], len(ids)
        for _ in range(5):
            tokens.append(int(e.decode_step([DecodeInput(tokens[-1], pos, table)])[0].argmax()))
            pos += 1
        return e, first, tokens

    _, cpu_first, cpu_tokens = run("cpu", "float32")
    _, gpu_first, gpu_tokens = run("cuda", "float32")
    assert torch.allclose(gpu_first, cpu_first, atol=1e-4, rtol=1e-4)
    assert gpu_tokens == cpu_tokens
    bf16, bf_first, _ = run("cuda", "bfloat16")
    mixtures = [lw.mlp for lw in bf16.model.layers if isinstance(lw.mlp, Mixture)]
    assert mixtures and all(m.stacked is not None for m in mixtures)
    assert torch.isfinite(bf_first).all()
    assert torch.allclose(bf_first, cpu_first, atol=0.15 * cpu_first.abs().max().item())


def test_lora_rows_on_cuda_equal_cpu(tmp_path) -> None:
    """A batch mixing the base model and a LoRA adapter on the GPU (torch's matmuls add
    the update; CUDA graphs only for steps without an adapter row): float32 gives the
    CPU's logits (csrc/lora.c there). Written on a CPU-only day (2026-11-29), not yet run."""
    from common.model.dummy_weights import random_adapter
    from common.model.loader import load_model_source

    config = load_model_source("dummy-tiny")[0]
    adapter = str(random_adapter(tmp_path / "a", config, rank=8))
    prompts = [torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (23, 40)]

    def run(device: str) -> list[torch.Tensor]:
        e = Engine(EngineConfig(model="dummy-tiny", device=device, num_blocks=64,
                                block_size=16, lora_modules=(("a", adapter),)))
        tables = [e.pool.allocate(e.blocks_needed(len(p) + 4)) for p in prompts]
        rows = [e.prefill(p, t, adapter=name).float().cpu()
                for p, t, name in zip(prompts, tables, ("a", None))]
        for step in range(3):
            rows += list(e.decode_step([
                DecodeInput(7 + step, len(p) + step, t, name)
                for p, t, name in zip(prompts, tables, ("a", None))]).float().cpu())
        return rows

    for got, want in zip(run("cuda"), run("cpu")):
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
