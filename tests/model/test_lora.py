"""LoRA adapters (common/model/lora.py): written by PEFT itself from a transformers model,
served beside the base model, each row of a batch on its own adapter, every logit within
1e-4 of PEFT's own model of the adapter (W x + s B A x); a row's bits the same alone as
in any batch."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np

import pytest
import torch

from common.engine import Engine, EngineConfig, UnknownModelError
from common.engine.config import DecodeInput, PrefillChunk
from common.engine.errors import EngineInputError
from tests.model.tiny_checkpoints import SMALL, reference_logits, write_checkpoint

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(base: torch.nn.Module, path: Path, targets: list[str], r: int = 4,
                  seed: int = 1, **extra: Any) -> torch.nn.Module:
    """A LoRA adapter of ``base`` saved by PEFT (A and B random, so it changes every
    output); PEFT's model of it back: the reference."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=r, lora_alpha=extra.pop("lora_alpha", 2 * r), target_modules=targets,
                        init_lora_weights=False, **extra)
    model = get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():  # PEFT's random B is small: made to matter
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(4)
    model.save_pretrained(str(path))
    return model.eval()


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, SMALL["vocab_size"], (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """(an engine serving a LLaMA and two adapters of it: every linear at r = 4 with
    rsLoRA; q and v at r = 8 with an alpha_pattern; the references by name, None: base)."""
    root = tmp_path_factory.mktemp("lora")
    base = write_checkpoint("llama", root / "base")
    refs: dict[Optional[str], torch.nn.Module] = {None: base}
    refs["everything"] = write_adapter(base, root / "everything", ALL, use_rslora=True)
    refs["attention"] = write_adapter(base, root / "attention", ["q_proj", "v_proj"], r=8,
                                      seed=2, alpha_pattern={"v_proj": 3.0})
    engine = Engine(EngineConfig(model=str(root / "base"), num_blocks=128, block_size=4,
                                 prefill_chunk=7, lora_modules=(
                                     ("everything", str(root / "everything")),
                                     ("attention", str(root / "attention")),
                                     ("twin", str(root / "everything")))))
    return engine, refs, root


@torch.inference_mode()
def test_each_row_of_a_mixed_batch_equals_peft(served) -> None:
    """Prefill in chunks of 7 after a cached prefix, then greedy decode steps of a batch
    that mixes the base model and both adapters, every logit as PEFT's model's."""
    engine, refs, _ = served
    names = [None, "everything", "attention", "everything"]
    prompts = [_ids(13 + 4 * i, seed=i) for i in range(len(names))]
    tables = [engine.pool.allocate(engine.blocks_needed(len(p) + 5)) for p in prompts]
    logits = []
    for p, t, name in zip(prompts, tables, names):
        engine.prefill(p, t, adapter=name)
        logits.append(engine.prefill(p, t, num_cached_tokens=9, adapter=name))
    seqs = [list(p) for p in prompts]
    for step in range(6):
        for row, seq, name in zip(logits, seqs, names):
            assert (row - reference_logits(refs[name], seq)[-1]).abs().max().item() < 1e-4
        if step == 5:
            break
        for row, seq in zip(logits, seqs):
            seq.append(int(row.argmax()))
        logits = list(engine.decode_step([DecodeInput(s[-1], len(s) - 1, t, name)
                                          for s, t, name in zip(seqs, tables, names)]))
    # the adapters change the answers (else the test shows nothing)
    assert not torch.allclose(reference_logits(refs[None], seqs[1]),
                              reference_logits(refs["everything"], seqs[1]), atol=1e-2)
    for t in tables:
        engine.pool.free(t)


def _rows(engine: Engine, prompts: list[list[int]], names: list[Optional[str]],
          steps: int) -> list[list[torch.Tensor]]:
    """Each sequence's logits: its prefill's, then ``steps`` greedy decode steps of all."""
    tables = [engine.pool.allocate(engine.blocks_needed(len(p) + steps)) for p in prompts]
    seqs = [list(p) for p in prompts]
    out = [[engine.prefill(p, t, adapter=n)] for p, t, n in zip(prompts, tables, names)]
    for _ in range(steps):
        for rows, seq in zip(out, seqs):
            seq.append(int(rows[-1].argmax()))
        step = engine.decode_step([DecodeInput(s[-1], len(s) - 1, t, n)
                                   for s, t, n in zip(seqs, tables, names)])
        for rows, row in zip(out, step):
            rows.append(row)
    for t in tables:
        engine.pool.free(t)
    return out


@torch.inference_mode()
def test_a_row_on_an_adapter_is_the_same_alone_as_in_any_batch(served) -> None:
    engine, _, _ = served
    prompts = [_ids(11, seed=9), _ids(23, seed=10), _ids(6, seed=11), _ids(17, seed=12)]
    alone = _rows(engine, prompts[:1], ["everything"], steps=4)[0]
    for names in (["everything", None, "attention", "everything"],
                  ["everything", "everything"], ["everything", None]):
        together = _rows(engine, prompts[:len(names)], names, steps=4)[0]
        assert all(torch.equal(a, b) for a, b in zip(alone, together)), names


@torch.inference_mode()
def test_a_mixed_prompt_step_equals_its_chunks_alone(served) -> None:
    """Two prompts' chunks in one step, one on an adapter: as each computed alone."""
    engine, refs, _ = served
    a, b = _ids(19, seed=20), _ids(12, seed=21)
    ta, tb = (engine.pool.allocate(engine.blocks_needed(len(p))) for p in (a, b))
    step, _ = engine.step([PrefillChunk(a, 0, len(a), ta, "attention"),
                           PrefillChunk(b, 0, len(b), tb)])
    assert (step[0] - reference_logits(refs["attention"], a)[-1]).abs().max() < 1e-4
    assert (step[1] - reference_logits(refs[None], b)[-1]).abs().max() < 1e-4
    engine.pool.free(ta)
    engine.pool.free(tb)


def test_each_adapter_names_its_blocks_apart(served) -> None:
    """A prompt's blocks on the base model and on each adapter have keys of their own;
    one adapter under two names shares them."""
    engine, _, _ = served
    ids = _ids(16, seed=3)
    keys = {name: engine.block_keys(ids, name) for name in (None, "everything", "attention")}
    assert len({k[0] for k in keys.values()}) == 3
    assert engine.block_keys(ids, "twin") == keys["everything"]
    with pytest.raises(EngineInputError, match="no LoRA adapter 'other'"):
        engine.block_keys(ids, "other")
    table = engine.pool.allocate(4)
    with pytest.raises(EngineInputError, match="no LoRA adapter 'other'"):
        engine.decode_step([DecodeInput(1, 0, table, "other")])
    engine.pool.free(table)


def test_pipeline_stages_hold_their_layers_updates(served) -> None:
    """Two stages (layers 0-1 and 2), each with its layers' share of the adapter."""
    _, refs, root = served
    modules = (("everything", str(root / "everything")),)
    stages = [Engine(EngineConfig(model=str(root / "base"), num_blocks=32, block_size=4,
                                  stage=(i, 2), lora_modules=modules)) for i in range(2)]
    assert [sorted(e.model.adapters["everything"].layers) for e in stages] == [[0, 1], [0]]
    ids = _ids(21, seed=4)
    hidden = None
    for engine in stages:
        table = engine.pool.allocate(engine.blocks_needed(len(ids)))
        hidden, logits = engine.stage_step([PrefillChunk(ids, 0, len(ids), table,
                                                         "everything")], hidden)
    assert (logits[0] - reference_logits(refs["everything"], ids)[-1]).abs().max() < 1e-4


def _refused(model: str, adapter: Path, match: str) -> None:
    with pytest.raises(UnknownModelError, match=match):
        Engine(EngineConfig(model=model, num_blocks=8, block_size=4,
                            lora_modules=(("x", str(adapter)),)))


def test_what_is_not_served_is_refused_by_name(served, tmp_path: Path) -> None:
    _, refs, root = served
    base = str(root / "base")
    cases = {
        "embed": (dict(target_modules=["embed_tokens", "q_proj"]), "embed_tokens"),
        "dora": (dict(target_modules=["q_proj"], use_dora=True), "DoRA"),
        "saved": (dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
                  "modules_to_save"),
        "bias": (dict(target_modules=["q_proj"], bias="lora_only"), "trained biases"),
    }
    for name, (extra, match) in cases.items():
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(copy.deepcopy(refs[None]), LoraConfig(r=2, **extra))
        model.save_pretrained(str(tmp_path / name))
        _refused(base, tmp_path / name, match)
    _refused(base, tmp_path / "absent", "no adapter_config.json")
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "adapter_config.json").write_text(json.dumps({"r": 2}))
    (tmp_path / "pickled" / "adapter_model.bin").write_bytes(b"")
    _refused(base, tmp_path / "pickled", "safe_serialization")
    # an adapter of another model: its shapes do not fit
    other = write_checkpoint("llama", tmp_path / "wide", hidden_size=96, head_dim=24)
    write_adapter(other, tmp_path / "wide-adapter", ["o_proj"])
    _refused(base, tmp_path / "wide-adapter", "do not fit")


@pytest.mark.parametrize("model_type,extra,targets,match", [
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24),
     ["gate_proj", "up_proj"], "adapters of experts are not supported"),
    ("deepseek_v3", dict(num_key_value_heads=4, head_dim=8, q_lora_rank=None, kv_lora_rank=32,
                         qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                         n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                         moe_intermediate_size=24, first_k_dense_replace=1),
     ["q_proj"], "latent attention"),
])
def test_adapters_of_experts_and_latent_attention_are_refused(
        tmp_path: Path, model_type: str, extra: dict, targets: list[str], match: str) -> None:
    base = write_checkpoint(model_type, tmp_path / "base", **extra)
    write_adapter(base, tmp_path / "adapter", targets)
    _refused(str(tmp_path / "base"), tmp_path / "adapter", match)


def test_an_attention_adapter_of_a_mixture_is_served(tmp_path: Path) -> None:
    base = write_checkpoint("qwen3_moe", tmp_path / "base", num_experts=4,
                            num_experts_per_tok=2, moe_intermediate_size=24)
    ref = write_adapter(base, tmp_path / "adapter", ["q_proj", "o_proj"])
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), num_blocks=16, block_size=4,
                                 lora_modules=(("a", str(tmp_path / "adapter")),)))
    ids = _ids(15, seed=6)
    got = engine.prefill(ids, engine.pool.allocate(engine.blocks_needed(len(ids))), adapter="a")
    assert (got - reference_logits(ref, ids)[-1]).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_adds_each_part_s_update_to_its_rows_and_columns_only(
        monkeypatch, dtype: torch.dtype) -> None:
    """A fused linear of three parts, the middle one not adapted, 70 inputs (a partial
    vector at the end): csrc/lora.c adds B (A x) to the chosen rows' adapted columns, as
    float64 computes it from the weights held (float32, or bfloat16 made float32 exactly);
    the others keep their bits; a row's bits do not depend on which rows are in the call;
    torch's path (a GPU's) agrees."""
    from common.model import lora

    g = torch.Generator().manual_seed(0)
    k, outs, r = 70, [40, 24, 24], [5, 0, 3]
    a = torch.randn(sum(r), k, generator=g).to(dtype)
    bt = torch.zeros(sum(r), sum(outs), dtype=dtype)
    bt[:5, :40] = torch.randn(5, 40, generator=g)
    bt[5:, 64:] = torch.randn(3, 24, generator=g)
    update = lora.LoraSlot(a.T.contiguous(), bt, [0, 40, 64, 88], [0, 5, 8])
    x, y = torch.randn(9, k, generator=g), torch.randn(9, sum(outs), generator=g)
    rows = torch.tensor([1, 4, 8])
    got = update.add(x, y.clone(), rows)
    want = y.double().clone()
    want[rows] += x[rows].double() @ a.double().T @ bt.double()
    assert (got - want).abs().max().item() < 1e-5
    others = [i for i in range(9) if i not in rows.tolist()]
    assert torch.equal(got[others], y[others]) and torch.equal(got[:, 40:64], y[:, 40:64])
    alone = update.add(x[4:5], y[4:5].clone(), None)
    assert torch.equal(alone[0], got[4])
    assert torch.equal(update.add(x, y.clone(), None)[4], got[4])  # in a pass of 4 rows
    monkeypatch.setattr(lora, "_kernel", lambda: None)
    # torch's bfloat16 matmuls round x and A x too
    tolerance = 1e-5 if dtype is torch.float32 else 0.02 * got.abs().max().item()
    assert (update.add(x, y.clone(), rows) - got).abs().max().item() < tolerance


def test_bfloat16_linears_hold_the_adapter_in_bfloat16(served) -> None:
    """A worker whose linears multiply in bfloat16 holds its adapters so (half the bytes a
    decode step reads): a row on one is the same alone as in any batch, and its prompt's
    logits near the float32 engine's."""
    engine32, _, root = served
    engine = Engine(EngineConfig(model=str(root / "base"), num_blocks=128, block_size=4,
                                 prefill_chunk=7, linear_dtype="bfloat16", lora_modules=(
                                     ("everything", str(root / "everything")),
                                     ("attention", str(root / "attention")))))
    from common.model import lora

    held = engine.model.adapters["everything"].layers[0]["qkv"].at.dtype
    assert held is (torch.bfloat16 if lora._kernel() is not None else torch.float32)
    prompts = [_ids(11, seed=9), _ids(23, seed=10), _ids(6, seed=11), _ids(17, seed=12)]
    with torch.inference_mode():
        alone = _rows(engine, prompts[:1], ["everything"], steps=3)[0]
        together = _rows(engine, prompts, ["everything", None, "attention", "everything"],
                         steps=3)[0]
        assert all(torch.equal(a, b) for a, b in zip(alone, together))
        want = _rows(engine32, prompts[:1], ["everything"], steps=3)[0]
    # the prompt's logits (the greedy paths part at bfloat16's first different choice)
    assert (alone[0] - want[0]).abs().max().item() < 0.05 * want[0].abs().max().item()


def test_an_unreadable_adapter_is_refused_by_name(served, tmp_path: Path) -> None:
    _, refs, root = served
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text("{not json")
    (broken / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    _refused(str(root / "base"), broken, "unreadable")
    added = tmp_path / "added"
    write_adapter(refs[None], added, ["q_proj"])
    (added / "added_tokens.json").write_text('{"<sql>": 320}')
    _refused(str(root / "base"), added, "added tokens")


@pytest.mark.parametrize("model_type", ["qwen2", "gemma2", "gemma3_text"])
def test_adapters_of_other_families_equal_peft(tmp_path: Path, model_type: str) -> None:
    """Families with what LLaMA lacks around the linears: Qwen2's q/k/v biases (the update
    after them), Gemma 2's soft-capping and scaled queries, Gemma 3's q/k norms and sliding
    layers; the adapter on every linear, prompts longer than their windows."""
    from tests.model.test_architectures import FAMILIES

    base = write_checkpoint(model_type, tmp_path / "base", **FAMILIES[model_type])
    ref = write_adapter(base, tmp_path / "adapter", ALL, r=4)
    engine = Engine(EngineConfig(model=str(tmp_path / "base"), num_blocks=32, block_size=4,
                                 prefill_chunk=7, lora_modules=(("a", str(tmp_path / "adapter")),)))
    ids = _ids(29, seed=8)
    got = engine.prefill(ids, engine.pool.allocate(engine.blocks_needed(len(ids))), adapter="a")
    want = reference_logits(ref, ids)[-1]
    assert (got - want).abs().max().item() < 1e-4
    assert (want - reference_logits(base, ids)[-1]).abs().max().item() > 1e-2


def _to_gguf(hf_dir: Path, adapter: Path, out: Path, alpha: float) -> Path:
    """``adapter`` (PEFT's) as llama.cpp's convert_lora_to_gguf.py writes it for a LLaMA:
    each linear's lora_a and lora_b under the base tensor's GGUF name, B's q and k rows
    permuted as the model's (tests/model/gguf_files.py), ``adapter.lora.alpha``."""
    import gguf
    from safetensors.torch import load_file

    from tests.model.gguf_files import _permute

    config = json.loads((hf_dir / "config.json").read_text())
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, tensor in sorted(load_file(str(adapter / "adapter_model.safetensors")).items()):
        base = name.removeprefix("base_model.model.").split(".lora_")[0]
        data = tensor.float().numpy()
        if ".lora_B." in name and base.endswith(("q_proj", "k_proj")):
            data = _permute(data, config["num_attention_heads"] if base.endswith("q_proj")
                            else config["num_key_value_heads"])
        part = "lora_a" if ".lora_A." in name else "lora_b"
        w.add_tensor(f"{table.get_name(base)}.weight.{part}", np.ascontiguousarray(data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_a_gguf_adapter_of_a_gguf_model_equals_peft(tmp_path: Path) -> None:
    """llama.cpp's files both: the base model as convert_hf_to_gguf.py writes it, the
    adapter as convert_lora_to_gguf.py does (its q and k rows permuted, alpha / r)."""
    from tests.model.gguf_files import write_family

    hf, _, base = write_family("llama", tmp_path / "base")
    ref = write_adapter(hf, tmp_path / "peft", ALL, r=4, lora_alpha=6)
    adapter = _to_gguf(tmp_path / "base", tmp_path / "peft", tmp_path / "adapter.gguf", 6.0)
    engine = Engine(EngineConfig(model=str(base), num_blocks=32, block_size=4,
                                 lora_modules=(("a", str(adapter)),)))
    ids = _ids(27, seed=13)
    got = engine.prefill(ids, engine.pool.allocate(engine.blocks_needed(len(ids))), adapter="a")
    assert (got - reference_logits(ref, ids)[-1]).abs().max().item() < 1e-4
    assert engine.block_keys(ids, "a") != engine.block_keys(ids)
    _refused(str(base), base, "not a LoRA adapter GGUF")  # the model's own file
