"""The KV dtypes by name, without torch: the router hashes block keys with the name
(common/kv/block_keys.py), workers map it to a torch dtype (common/kv/memory.py)."""
from __future__ import annotations

KV_DTYPE_NAMES = ("float32", "bfloat16", "float16")


def resolve_kv_dtype(compute_dtype: str, kv_dtype: str) -> str:
    """The KV dtype's name: ``"auto"`` means the compute dtype. Raises on unknown names."""
    name = compute_dtype if kv_dtype == "auto" else kv_dtype
    if name not in KV_DTYPE_NAMES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r} (auto or one of "
                         f"{sorted(KV_DTYPE_NAMES)})")
    return name
