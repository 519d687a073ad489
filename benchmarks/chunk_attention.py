"""A prompt chunk's attention after a prefix: the masked SDPA call against the unmasked
split (common/model/attention.py ``chunk_attention``), at LLaMA-3-8B's heads (32 query,
8 KV, 128 wide), one layer.

``python benchmarks/chunk_attention.py [--device cuda] [--dtype bfloat16]`` (seconds on a
GPU; on a CPU use small ``--shapes``). Shapes are ``queries:prefix`` pairs: the default is
a 4k prompt's warm tenth (416 after 3,680), its second cold chunk (2,048 after 2,048), a
16k prompt's warm tenth (1,648 after 14,736) and last cold chunk (2,048 after 14,336).
Prints a table (ms per call, TFLOPS of the causal work), then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.model.attention import _CUDA_SPLIT, chunk_attention, splits_chunks  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn`` (synchronized), after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shapes", default="416:3680,2048:2048,1648:14736,2048:14336")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    split = splits_chunks(device, dtype)
    variant = _CUDA_SPLIT.get((torch.device("cuda", 0), dtype)) if device.type == "cuda" \
        else "cpu flash"
    rows = []
    for shape in args.shapes.split(","):
        q_len, start = (int(x) for x in shape.split(":"))
        end = start + q_len
        padded = -(-end // 16) * 16
        q = torch.randn(1, HEADS, q_len, HEAD_DIM, device=device, dtype=dtype)
        k, v = (torch.randn(1, KV_HEADS, padded, HEAD_DIM, device=device, dtype=dtype)
                for _ in range(2))
        mask = torch.zeros(q_len, padded, dtype=dtype, device=device)
        mask[:, start:].masked_fill_(torch.ones(q_len, padded - start, dtype=torch.bool,
                                                device=device).triu_(1), float("-inf"))
        masked = timed(lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[None, None], enable_gqa=True), device, args.reps)
        unmasked = timed(lambda: chunk_attention(q, k, v, start, end), device, args.reps) \
            if split else None
        flops = 4 * HEADS * HEAD_DIM * q_len * (start + (q_len + 1) / 2)
        rows.append({"queries": q_len, "prefix": start, "masked_ms": masked * 1e3,
                     "split_ms": unmasked * 1e3 if unmasked else None,
                     "masked_tflops": flops / masked / 1e12,
                     "split_tflops": flops / unmasked / 1e12 if unmasked else None})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, {args.dtype}, split via {variant if split else 'none (masked only)'}")
    print("| queries | prefix | masked ms | split ms | masked TFLOPS | split TFLOPS | speedup |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        sp = r["split_ms"]
        split = ("-", "-", "-") if sp is None else (
            f"{sp:.3f}", f"{r['split_tflops']:.0f}", f"{r['masked_ms'] / sp:.2f}x")
        print(f"| {r['queries']} | {r['prefix']} | {r['masked_ms']:.3f} | {split[0]} | "
              f"{r['masked_tflops']:.0f} | {split[1]} | {split[2]} |")
    print(json.dumps({"bench": "chunk_attention", "device": name, "dtype": args.dtype,
                      "variant": variant if split else None, "rows": rows}))


if __name__ == "__main__":
    main()
