"""Model configuration of a decoder (LLaMA and the families in common/model/arch.py), and
the named dummy configs."""
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
    # What sets a family apart (common/model/arch.py reads these; LLaMA needs none of them)
    architecture: str = "LlamaForCausalLM"  # HF's ``architectures[0]``: the family
    qkv_bias: bool = False       # q/k/v projections have biases (Qwen2; ``attention_bias``)
    o_bias: bool = False         # the output projection has one (``attention_bias``)
    mlp_bias: bool = False
    activation: str = "silu"     # of the gated MLP: "silu" or "gelu_tanh" (Gemma)
    sliding_window: Optional[int] = None  # keys a sliding layer's query sees, itself included
    sliding_layers: tuple[int, ...] = ()  # the sliding layers (the others see everything)
    query_scale: Optional[float] = None   # attention's scale; None: head_dim ** -0.5
    attn_softcap: Optional[float] = None  # cap * tanh(score / cap) (Gemma2)
    final_softcap: Optional[float] = None  # the same on the logits (Gemma2)
    local_rope_theta: Optional[float] = None  # the sliding layers' own RoPE base (Gemma3)
    local_rope_scaling: Optional[dict] = None
    # A mixture of experts (common/model/moe.py; 0 experts: every layer's MLP is dense):
    # each token's MLP is the ``experts_per_token`` of ``num_experts`` gated MLPs of
    # ``expert_intermediate_size`` its router scores highest, weighted by their softmax
    # probabilities (renormalized over the chosen ones where ``normalize_experts``), plus a
    # shared expert of ``shared_expert_intermediate_size`` gated by a sigmoid (Qwen2-MoE)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    normalize_experts: bool = True
    dense_layers: tuple[int, ...] = ()  # layers of a mixture whose MLP is dense
    # DeepSeek's routers: V3's sigmoid scores, a bias added to choose (not to weigh);
    # experts in ``expert_groups`` groups of which a token chooses from its best
    # ``expert_groups_per_token``; weights times ``routed_scaling``
    router_scoring: str = "softmax"  # or "sigmoid"
    router_bias: bool = False
    expert_groups: int = 1
    expert_groups_per_token: int = 1
    expert_group_score: int = 2  # a group's score: the sum of its best this many (V2: 1)
    routed_scaling: float = 1.0
    # Multi-head latent attention (DeepSeek V3, Kimi K2, Moonlight; kv_lora_rank 0: none):
    # k and v of every head are made from one latent of ``kv_lora_rank`` a token (and q
    # from one of ``q_lora_rank``, where 0: directly); each head's q and k are
    # ``qk_nope_head_dim`` plain dimensions then ``rope_dim`` rotated ones (head_dim, the
    # KV cache's width; the rotated part of k is one for all heads), its v
    # ``v_head_dim`` (the cache holds it padded to head_dim)
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_dim: int = 0  # the dimensions of a head RoPE rotates, its last; 0: all of them
    rope_interleaved: bool = False  # their pairs interleaved (x0, x1), (x2, x3), ...
    # A sample of the weight files (common/model/loader.py weights_id): two checkpoints of
    # one config (fine-tunes of one base) get different block keys; "" for dummies
    weights_id: str = ""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} not a multiple of "
                             f"num_kv_heads {self.num_kv_heads}")
        if self.num_experts and not (0 < self.experts_per_token <= self.num_experts
                                     and self.expert_intermediate_size > 0):
            raise ValueError(f"{self.experts_per_token} experts a token of {self.num_experts}, "
                             f"each of {self.expert_intermediate_size}: not a mixture")

    @property
    def attention_scale(self) -> float:
        return self.query_scale if self.query_scale is not None else self.head_dim ** -0.5

    def window(self, layer: int) -> Optional[int]:
        """The sliding window of ``layer`` (an index of the whole model), None if it sees
        every earlier key."""
        return self.sliding_window if layer in self.sliding_layers else None

    def sparse(self, layer: int) -> bool:
        """Whether ``layer``'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in self.dense_layers

    def with_layers(self, num_layers: int) -> ModelConfig:
        """The same model cut to its first `num_layers` layers (profiling huge models)."""
        if not 0 < num_layers <= self.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.num_layers}], got {num_layers}")
        name = self.name if num_layers == self.num_layers else f"{self.name}@{num_layers}L"
        return dataclasses.replace(
            self, num_layers=num_layers, name=name,
            sliding_layers=tuple(layer for layer in self.sliding_layers if layer < num_layers),
            dense_layers=tuple(layer for layer in self.dense_layers if layer < num_layers))

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["sliding_layers"] = list(self.sliding_layers)
        d["dense_layers"] = list(self.dense_layers)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        d["sliding_layers"] = tuple(d.get("sliding_layers", ()))
        d["dense_layers"] = tuple(d.get("dense_layers", ()))
        return ModelConfig(**d)


_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

_QWEN3_30B_A3B = ModelConfig(
    name="dummy-qwen3-30b-a3b", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
    num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, rope_theta=1e6,
    rope_scaling=None, rms_norm_eps=1e-6, max_position_embeddings=40960,
    tie_word_embeddings=False, bos_token_id=None, eos_token_ids=(151645, 151643),
    architecture="Qwen3MoeForCausalLM", num_experts=128, experts_per_token=8,
    expert_intermediate_size=768, normalize_experts=True)

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
    # benchmarks/moe.py: Qwen3-30B-A3B's shape (128 experts of 768, 8 a token), and its
    # dense twin: the same layer with one MLP as wide as the 8 experts a token runs
    "dummy-qwen3-30b-a3b": _QWEN3_30B_A3B,
    "dummy-qwen3-a3b-dense": dataclasses.replace(
        _QWEN3_30B_A3B, name="dummy-qwen3-a3b-dense", architecture="Qwen3ForCausalLM",
        num_experts=0, experts_per_token=0, expert_intermediate_size=0),
    # benchmarks/latent.py: Moonlight-16B-A3B's shape (DeepSeek V3's architecture: latent
    # attention of 16 heads, 64 experts of 1,408 with 6 a token and 2 shared)
    "dummy-moonlight-16b-a3b": ModelConfig(
        name="dummy-moonlight-16b-a3b", vocab_size=163840, hidden_size=2048,
        intermediate_size=11264, num_layers=27, num_heads=16, num_kv_heads=1, head_dim=576,
        rope_theta=50000.0, rope_scaling=None, rms_norm_eps=1e-5,
        max_position_embeddings=8192, tie_word_embeddings=False, bos_token_id=163584,
        eos_token_ids=(163585,), architecture="DeepseekV3ForCausalLM",
        query_scale=192 ** -0.5, num_experts=64, experts_per_token=6,
        expert_intermediate_size=1408, shared_expert_intermediate_size=2816,
        normalize_experts=True, dense_layers=(0,), router_scoring="sigmoid",
        router_bias=True, routed_scaling=2.446, kv_lora_rank=512, qk_nope_head_dim=128,
        v_head_dim=128, rope_dim=64, rope_interleaved=True),
    # benchmarks/sliding_window.py: Gemma 3 1B's shape, 5 layers in 6 sliding over 512 keys
    "dummy-gemma3-1b": ModelConfig(
        name="dummy-gemma3-1b", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
        num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, rope_theta=1e6,
        rope_scaling=None, rms_norm_eps=1e-6, max_position_embeddings=32768,
        tie_word_embeddings=True, bos_token_id=2, eos_token_ids=(1, 106),
        architecture="Gemma3ForCausalLM", activation="gelu_tanh", sliding_window=512,
        sliding_layers=tuple(i for i in range(26) if (i + 1) % 6), query_scale=256 ** -0.5,
        local_rope_theta=10000.0),
}
