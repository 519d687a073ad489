"""transformers' own LlamaForCausalLM loaded from the same GGUF: the independent reference.

transformers' GGUF path dequantizes and un-permutes Q/K with its own code: its loader
(load_gguf_checkpoint, what from_pretrained(dir, gguf_file=...) calls), with
LlamaForCausalLM built by hand (with accelerate installed, as peft brings it, from_pretrained
marks the model quantized and refuses the float32 cast).
The load takes ~8 s on 2 cores (``_load_uncached``), so its state dict is cached on disk.
"""
from __future__ import annotations

import functools
import json
import os
from unittest import mock

import torch

from common.model.loader import _cache_key, cache_dir


def load_hf_reference(gguf_path: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    base = os.path.join(cache_dir(), f"hfref-{_cache_key(gguf_path)}")
    if os.path.isfile(base + ".json") and os.path.isfile(base + ".safetensors"):
        from safetensors.torch import load_file

        with open(base + ".json") as f:
            cfg = json.load(f)
        from transformers.initialization import no_init_weights

        with no_init_weights():  # every weight comes from the file; skip the random init
            model = LlamaForCausalLM(LlamaConfig(**cfg))
        missing = model.load_state_dict(load_file(base + ".safetensors"), strict=False).missing_keys
        assert set(missing) <= {"lm_head.weight"}, missing
    else:
        model = _load_uncached(gguf_path)
        _save(model, base)
    model.tie_weights()
    return model.eval().float()


def _load_uncached(gguf_path: str) -> torch.nn.Module:
    """transformers parses the file twice (its config, then its tensors) and builds gguf's
    tensor-name map again for each of the model's 397 modules: both are pure, so each is
    done once here (the 2-core box: 22 -> 8 s), and the tensors are transformers'
    own all the same."""
    import gguf

    with mock.patch.object(gguf, "GGUFReader", functools.cache(gguf.GGUFReader)), \
            mock.patch.object(gguf, "get_tensor_name_map",
                              functools.cache(gguf.get_tensor_name_map)):
        return _load_with_transformers(gguf_path)


def _load_with_transformers(gguf_path: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    cfg = dict(load_gguf_checkpoint(gguf_path, return_tensors=False)["config"])
    cfg.pop("model_type", None)
    model = LlamaForCausalLM(LlamaConfig(**cfg))
    tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=False)
    return model


def _save(model: torch.nn.Module, base: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(os.path.dirname(base), exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, base + ".safetensors.tmp")
    os.replace(base + ".safetensors.tmp", base + ".safetensors")
    cfg = model.config.to_dict()
    with open(base + ".json.tmp", "w") as f:
        json.dump(cfg, f)
    os.replace(base + ".json.tmp", base + ".json")
