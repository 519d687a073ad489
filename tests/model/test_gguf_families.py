"""A GGUF of each family Crescent serves, made from a tiny random checkpoint as llama.cpp's
convert script makes it (tests/model/gguf_files.py), gives transformers' logits on the
checkpoint itself (float32, within 1e-4) on a prefill and batched decode steps; its
tokenizer, chat template and turn end come from the file; and a file Crescent cannot serve
as written is refused by name."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.engine import Engine, EngineConfig, UnknownModelError
from tests.model.gguf_files import FAMILIES, write_family
from tests.model.tiny_checkpoints import CHAT, SMALL, assert_decodes_as


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, SMALL["vocab_size"], (n,),
                         generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(the GGUF's path, the checkpoint's directory, transformers' model, the special
    tokens' ids) of one family. The loader's disk cache is the test's own: a cached file
    of the same bytes would not be read again."""
    arch = request.param
    path = tmp_path_factory.mktemp(arch)
    hf, specials, gguf = write_family(arch, path)
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CRESCENT_CACHE_DIR", str(path / "cache"))
        yield gguf, path, hf, specials


def test_a_gguf_prefills_and_decodes_as_transformers_on_its_checkpoint(family) -> None:
    gguf, _, hf, _ = family
    engine = Engine(EngineConfig(model=str(gguf), num_blocks=96, block_size=4,
                                 prefill_chunk=7))
    assert_decodes_as(engine, hf, [_ids(37, seed=1), _ids(13, seed=2)], steps=4)


def test_its_tokenizer_template_and_turn_end_come_from_the_file(family) -> None:
    """As the router reads it: the ids of tokenizer.json, the template, and the turn end
    among the end-of-sequence ids though a Gemma file names ``<eos>``."""
    from tokenizers import Tokenizer as HFTokenizer

    from common.model.tokenizer import Tokenizer
    from services.router.tokenizer import load_model_meta

    gguf, path, _, specials = family
    config, spec = load_model_meta(str(gguf))
    template, _, turn_end, _ = CHAT[FAMILIES[gguf.stem.removesuffix("-tiny")][2]]
    text = "What is the weather in Paris today? Count: 1 2 3.\n<|im_end|> done"
    ours = Tokenizer(spec)
    assert ours.encode(text, add_special_tokens=False) == \
        HFTokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
    assert spec["chat_template"] == template
    assert specials[turn_end] in config.eos_token_ids
    messages = [{"role": "user", "content": "Hello"}]
    assert ours.render_chat(messages).endswith(
        "<|im_start|>assistant\n" if turn_end == "<|im_end|>" else "<start_of_turn>model\n")


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CRESCENT_CACHE_DIR", str(tmp_path / "cache"))


def test_a_gguf_of_another_architecture_is_refused_by_name(tmp_path: Path) -> None:
    data = write_family("qwen2", tmp_path)[2].read_bytes()
    # the same file, architecture "phi2" (both names are five bytes: the layout holds)
    (tmp_path / "phi.gguf").write_bytes(data.replace(b"qwen2", b"phi2x"))
    with pytest.raises(UnknownModelError, match="GGUF architecture 'phi2x' is not supported"):
        Engine(EngineConfig(model=str(tmp_path / "phi.gguf"), num_blocks=8, block_size=4))


@pytest.mark.parametrize("case, match", [
    ({"extra_tensor": "blk.0.attn_norm_2.weight"},
     "GGUF tensor 'blk.0.attn_norm_2.weight' is not a weight this model reads"),
    ({"head_dim_rotated": 8}, r"rotates 8 of each head's 16 dimensions \(partial RoPE\)"),
    ({"arch": "mixtral", "extra_tensor": "blk.0.ffn_gate.3.weight"},
     "an older Mixtral file, each expert its own tensor"),
])
def test_a_gguf_the_family_would_misread_is_refused(tmp_path: Path, case: dict,
                                                     match: str) -> None:
    case = dict(case)  # the parameter's own dict stays whole
    gguf = write_family(case.pop("arch", "qwen3"), tmp_path, **case)[2]
    with pytest.raises(UnknownModelError, match=match):
        Engine(EngineConfig(model=str(gguf), num_blocks=8, block_size=4))


@pytest.mark.parametrize("layers, hidden, heads, head_dim, scalar", [
    (46, 4608, 32, 128, 144),  # Gemma 2 27B: hidden / heads
    (42, 3584, 16, 256, 256),  # Gemma 2 9B: head_dim
])
def test_gemma_query_scale_follows_llama_cpp(tmp_path: Path, layers: int, hidden: int,
                                             heads: int, head_dim: int, scalar: int) -> None:
    """The file has no query scale: llama.cpp takes 1/sqrt(hidden / heads) for the 27B
    models (known by their layer count), 1/sqrt(head_dim) for the others."""
    import gguf

    from common.model.gguf_loader import hf_config

    w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "gemma2")
    for add, value in [(w.add_block_count, layers), (w.add_embedding_length, hidden),
                       (w.add_head_count, heads), (w.add_key_length, head_dim),
                       (w.add_feed_forward_length, 4 * hidden), (w.add_vocab_size, 256)]:
        add(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    assert hf_config(gguf.GGUFReader(str(tmp_path / "g.gguf")))["query_pre_attn_scalar"] == scalar


def test_the_cache_is_written_in_shards_once_and_read_back(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold load streams the dequantized tensors into shards (never all in memory at
    once), renamed into place whole; a warm load reads the same tensors back; a load that
    finds another's cache in place keeps it; a cache it cannot write costs only time."""
    import gguf

    from common.model import loader
    from common.model.gguf_loader import read_config, read_weights

    path = write_family("qwen3", tmp_path / "m")[2]
    reader = gguf.GGUFReader(str(path))
    want = dict(read_weights(reader, read_config(reader, "m", str(path))))
    monkeypatch.setattr(loader, "SHARD_BYTES", 64 << 10)  # the tiny model in several shards
    cache = tmp_path / "cache"
    monkeypatch.setenv("CRESCENT_CACHE_DIR", str(cache))
    for _ in range(2):  # cold, then warm
        _, got, _ = loader._load_gguf_cached(str(path))
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want)
    (shards,) = [p for p in cache.iterdir() if p.is_dir() and p.name.startswith("gguf-")]
    assert len(list(shards.glob("*.safetensors"))) > 2
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith("gguf-")) == \
        [shards.name, shards.name + ".json"]  # no half-written leftovers
    (shards.parent / (shards.name + ".json")).unlink()  # as if another load were writing
    _, got, _ = loader._load_gguf_cached(str(path))  # its directory stays, the JSON comes
    assert got.keys() == want.keys() and (shards.parent / (shards.name + ".json")).is_file()
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("CRESCENT_CACHE_DIR", str(tmp_path / "file" / "cache"))
    _, got, _ = loader._load_gguf_cached(str(path))
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_a_cold_load_drops_what_older_versions_cached_from_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A v4 directory and a pre-v4 file cached from the same path go; another file's
    cache stays."""
    import json

    from common.model import loader

    path = write_family("qwen3", tmp_path / "m")[2]
    cache = tmp_path / "cache"
    monkeypatch.setenv("CRESCENT_CACHE_DIR", str(cache))
    cache.mkdir()
    for stem, source, shards in (("gguf-old4", str(path), True), ("gguf-old2", str(path), False),
                                 ("gguf-other", str(tmp_path / "x.gguf"), True)):
        (cache / f"{stem}.json").write_text(json.dumps({"source": source}))
        if shards:
            (cache / stem).mkdir()
            (cache / stem / "00000.safetensors").write_bytes(b"x")
        else:
            (cache / f"{stem}.safetensors").write_bytes(b"x")
    loader._load_gguf_cached(str(path))
    left = sorted(p.name for p in cache.iterdir())
    assert [n for n in left if "old" in n] == []
    assert {"gguf-other", "gguf-other.json"} <= set(left) and len(left) == 4
