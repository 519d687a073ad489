"""Block keys: chained, 16 bytes, full blocks only, deterministic across processes."""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import xxhash

from common.kv.block_keys import compute_block_keys, model_fingerprint
from common.model.config import DUMMY_CONFIGS

FP = b"\x07" * 16


def test_keys_are_chained_xxh3_128() -> None:
    toks = list(range(10))
    keys = compute_block_keys(toks, 4, FP)
    assert len(keys) == 2 and all(len(k) == 16 for k in keys)
    k0 = xxhash.xxh3_128(FP + np.arange(4, dtype="<i4").tobytes()).digest()
    k1 = xxhash.xxh3_128(k0 + FP + np.arange(4, 8, dtype="<i4").tobytes()).digest()
    assert keys == [k0, k1]
    assert compute_block_keys(toks[4:8], 4, FP, parent=k0) == [k1]


def test_prefix_property_and_sensitivity() -> None:
    a = compute_block_keys([1, 2, 3, 4, 5, 6, 7, 8], 4, FP)
    b = compute_block_keys([1, 2, 3, 4, 5, 6, 7, 9], 4, FP)
    c = compute_block_keys([0, 2, 3, 4, 5, 6, 7, 8], 4, FP)
    assert a[0] == b[0] and a[1] != b[1]
    assert a[1] != c[1]  # a change early changes every later key
    assert compute_block_keys([1, 2, 3], 4, FP) == []
    assert compute_block_keys([1, 2, 3, 4], 4, b"\x08" * 16) != a[:1]


def test_fingerprint_stable_across_processes() -> None:
    cfg = DUMMY_CONFIGS["dummy-tiny"]
    code = ("from common.kv.block_keys import model_fingerprint, compute_block_keys;"
            "from common.model.config import DUMMY_CONFIGS;"
            "fp = model_fingerprint(DUMMY_CONFIGS['dummy-tiny']);"
            "print(fp.hex(), compute_block_keys(list(range(32)), 16, fp)[1].hex())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123"}, cwd=".").stdout.split()
    fp = model_fingerprint(cfg)
    assert out == [fp.hex(), compute_block_keys(list(range(32)), 16, fp)[1].hex()]
    assert len(fp) == 16
    assert model_fingerprint(DUMMY_CONFIGS["dummy-llama3-8b"]) != fp


def test_a_dense_models_fingerprint_is_what_it_was_before_mixtures() -> None:
    """A dense model's blocks keep their keys across the upgrade that added the mixture
    and latent-attention fields (in a store, on disk): its fingerprint is that of its
    config without them (dummy-tiny's, float32, as every version before printed it); a
    model that has them changes with each."""
    import dataclasses

    from common.kv.block_keys import ADDED_FIELDS

    assert model_fingerprint(DUMMY_CONFIGS["dummy-tiny"]).hex() == \
        "bedff85858a3db7c1ea7f48059a5fdf1"
    moe = DUMMY_CONFIGS["dummy-qwen3-30b-a3b"]
    changed = {"num_experts": 64, "experts_per_token": 4, "expert_intermediate_size": 512,
               "shared_expert_intermediate_size": 256, "normalize_experts": False,
               "dense_layers": (0,), "router_scoring": "sigmoid", "router_bias": True,
               "expert_groups": 8, "expert_groups_per_token": 4, "expert_group_score": 1,
               "routed_scaling": 2.5,
               "q_lora_rank": 64, "kv_lora_rank": 128, "qk_nope_head_dim": 96,
               "v_head_dim": 128, "rope_dim": 32, "rope_interleaved": True}
    assert set(changed) == set(ADDED_FIELDS)
    fps = {model_fingerprint(dataclasses.replace(moe, **{name: value}))
           for name, value in changed.items()}
    assert len(fps | {model_fingerprint(moe)}) == len(changed) + 1
    # a model's own defaults are those the fingerprint leaves out
    defaults = {f.name: f.default for f in dataclasses.fields(type(moe)) if f.name in changed}
    assert defaults == ADDED_FIELDS
