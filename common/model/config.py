"""Model configuration of a LLaMA-family decoder, and the named dummy configs."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rope_scaling: Optional[dict]
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: Optional[int]
    eos_token_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")

    def with_layers(self, num_layers: int) -> ModelConfig:
        """The same model cut to its first `num_layers` layers (profiling huge models)."""
        if not 0 < num_layers <= self.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.num_layers}], got {num_layers}")
        name = self.name if num_layers == self.num_layers else f"{self.name}@{num_layers}L"
        return dataclasses.replace(self, num_layers=num_layers, name=name)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        return ModelConfig(**d)


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

DUMMY_CONFIGS: dict[str, ModelConfig] = {
    "dummy-tiny": ModelConfig(
        name="dummy-tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, rope_scaling=None,
        rms_norm_eps=1e-5, max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=1, eos_token_ids=(2,)),
    "dummy-llama3-8b": ModelConfig(
        name="dummy-llama3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001, 128009)),
    "dummy-llama3-70b": ModelConfig(
        name="dummy-llama3-70b", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE, rms_norm_eps=1e-5, max_position_embeddings=131072,
        tie_word_embeddings=False, bos_token_id=128000, eos_token_ids=(128001, 128009)),
    # benchmarks/prefill.py: 16k-token prompts in seconds on one CPU core, 4 KiB of KV per
    # token (float32), 4 layers so a pipeline of 2 or 4 stages splits evenly
    "dummy-bench-prefill": ModelConfig(
        name="dummy-bench-prefill", vocab_size=4096, hidden_size=256, intermediate_size=512,
        num_layers=4, num_heads=2, num_kv_heads=2, head_dim=64, rope_theta=10000.0,
        rope_scaling=None, rms_norm_eps=1e-5, max_position_embeddings=32768,
        tie_word_embeddings=False, bos_token_id=1, eos_token_ids=(2,)),
    # benchmarks/prefill.py's default (issue 12: "sized so each run takes seconds"): the
    # attention and KV of dummy-bench-prefill (2 heads of 64, 4 KiB of KV per token), with
    # projections widened so that, as in LLaMA-3-8B, a token of context costs 1/26.6k of a
    # token's projection FLOPs (2 * 128 attention dims / 6.8M weights per layer; the narrow
    # model spends 13x that share on attention). One core: 1k tokens ~0.55 s, 16k ~13 s.
    "dummy-bench-prefill-wide": ModelConfig(
        name="dummy-bench-prefill-wide", vocab_size=4096, hidden_size=1024,
        intermediate_size=2048, num_layers=4, num_heads=2, num_kv_heads=2, head_dim=64,
        rope_theta=10000.0, rope_scaling=None, rms_norm_eps=1e-5,
        max_position_embeddings=32768, tie_word_embeddings=False, bos_token_id=1,
        eos_token_ids=(2,)),
}


def config_from_hf(d: dict[str, Any], name: str) -> ModelConfig:
    """ModelConfig from a HF config.json dict (LlamaConfig fields)."""
    heads = d["num_attention_heads"]
    rope_scaling = d.get("rope_scaling")
    theta = d.get("rope_theta")
    params = d.get("rope_parameters")
    if params:
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    return ModelConfig(
        name=name, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
        intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
        num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        rope_theta=float(theta if theta is not None else 10000.0), rope_scaling=rope_scaling,
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=d.get("max_position_embeddings", 2048),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids)
