"""Engine configuration and per-step inputs."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"   # or a .gguf path, an HF dir, "dummy-tiny", "dummy-llama3-8b", ...
    dtype: str = "float32"
    # The dtype the linear layers multiply in, where it differs from ``dtype`` (weights
    # stored in it, activations cast at each): "bfloat16" in a float32 decode engine on a
    # CPU with AVX-512 BF16 or AMX (common/model/linear.py Linear). None: ``dtype``.
    linear_dtype: Optional[str] = None
    # A model's quantized linears (common/model/quant.py): "auto" keeps a GGUF's as the
    # file holds them on a float32 CPU engine, "none" expands them to float, "q8_0" and
    # "q4_0" quantize a float checkpoint's at load (ClusterConfig.quantization)
    quantization: str = "auto"
    kv_dtype: str = "auto"  # paged KV storage dtype; auto = dtype (see common/kv/memory.py)
    kv_shm_path: Optional[str] = None  # back the paged KV with this new /dev/shm file
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int = 1024
    prefill_chunk: int = 512
    # Batch invariance (ClusterConfig.batch_invariant): a prompt chunk attends in parts cut
    # at multiples of this many tokens, so a token's attention is computed the same
    # however the load groups its prompt's pieces into steps (not with a backend that
    # computes each prompt row alone: the CPU kernel). 0: one part a chunk.
    chunk_align: int = 0
    max_batch_size: int = 64
    attention_backend: str = "auto"   # auto | cpu | sdpa | triton | flash
    # On a GPU with the Triton backend, decode steps of up to max_batch_size sequences
    # replay CUDA graphs captured at start (common/engine/cuda_graphs.py).
    cuda_graphs: bool = True
    # On a GPU, prompt steps of up to this many tokens replay piecewise CUDA graphs (the
    # layers between attentions: common/engine/prompt_graphs.py); 0: none.
    prompt_graph_tokens: int = 0
    seed: int = 0
    num_layers: Optional[int] = None  # instantiate only the first N layers (huge dummies)
    num_threads: Optional[int] = None  # torch intra-op threads; None keeps torch's default
    stage: tuple[int, int] = (0, 1)  # (this stage, stages) of a pipeline: its share of layers
    # LoRA adapters served beside the model: (name, PEFT directory) pairs
    # (ClusterConfig.lora_modules, common/model/lora.py)
    lora_modules: tuple[tuple[str, str], ...] = ()


def stage_layers(num_layers: int, stages: int, stage: int) -> range:
    """Layers of ``stage`` of ``stages``: contiguous, sizes differing by at most one
    (earlier stages take the extra ones)."""
    if not 1 <= stages <= num_layers or not 0 <= stage < stages:
        raise ValueError(f"stage {stage} of {stages} over {num_layers} layers: a pipeline "
                         f"needs 1 to {num_layers} stages (the model's layers)")
    size, extra = divmod(num_layers, stages)
    start = stage * size + min(stage, extra)
    return range(start, start + size + (stage < extra))


@dataclass(frozen=True)
class DecodeInput:
    """One running sequence in a decode step: feed `token_id` at `position`."""
    token_id: int
    position: int
    block_table: list[int]
    adapter: Optional[str] = None  # the LoRA adapter it runs on (None: the base model)


@dataclass(frozen=True)
class PrefillChunk:
    """One prompt's slice in a step: compute tokens [start, end) of ``token_ids`` (the
    whole prompt) into ``block_table``; earlier positions' KV is already there."""
    token_ids: list[int]
    start: int
    end: int
    block_table: list[int]
    adapter: Optional[str] = None  # the LoRA adapter it runs on (None: the base model)

    @property
    def last(self) -> bool:
        """This chunk ends the prompt: the step returns logits of its last token."""
        return self.end == len(self.token_ids)
