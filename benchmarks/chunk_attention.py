"""A prompt chunk's attention after a prefix: the masked SDPA call against the unmasked
split (common/model/chunk_attention.py), at LLaMA-3-8B's heads (32 query,
8 KV, 128 wide), one layer.

``python benchmarks/chunk_attention.py [--device cuda] [--dtype bfloat16]`` (seconds on a
GPU; on a CPU use small ``--shapes``). Shapes are ``queries:prefix`` pairs: the default is
a 4k prompt's warm tenth (416 after 3,680), its second cold chunk (2,048 after 2,048), a
16k prompt's warm tenth (1,648 after 14,736) and last cold chunk (2,048 after 14,336).
On a GPU a third column times one flash-attention call whose causal mask is aligned to
the last key (flash-attention 2 aligns it so when queries are fewer than keys): the chunk
and its prefix in one launch, no merge; its largest difference from the masked result is
in the JSON (``one_err``), and "-" where this torch or card lacks the op.
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

from common.model.chunk_attention import _CUDA_SPLIT, chunk_attention, splits_chunks  # noqa: E402

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


def one_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, end: int) -> torch.Tensor:
    """The chunk's attention as one flash call, causal from the last key back; K/V heads
    expanded where the op wants them equal to the query's."""
    k, v = k[:, :, :end], v[:, :, :end]
    try:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
    except RuntimeError:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]


def timed_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, end: int,
              want: torch.Tensor, reps: int) -> tuple[float, float] | None:
    """(seconds, largest difference from ``want``) of ``one_call``; None off a GPU or
    where the op fails."""
    if q.device.type != "cuda":
        return None
    try:
        err = (one_call(q, k, v, end).float() - want.float()).abs().max().item()
        return timed(lambda: one_call(q, k, v, end), q.device, reps), err
    except RuntimeError as exc:
        print(f"one flash call: {exc}", file=sys.stderr)
        return None


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
        masked_call = lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask[None, None], enable_gqa=True)
        masked = timed(masked_call, device, args.reps)
        one = timed_one(q, k, v, end, masked_call(), args.reps)
        unmasked = timed(lambda: chunk_attention(q, k, v, start, end), device, args.reps) \
            if split else None
        flops = 4 * HEADS * HEAD_DIM * q_len * (start + (q_len + 1) / 2)
        rows.append({"queries": q_len, "prefix": start, "masked_ms": masked * 1e3,
                     "split_ms": unmasked * 1e3 if unmasked else None,
                     "masked_tflops": flops / masked / 1e12,
                     "split_tflops": flops / unmasked / 1e12 if unmasked else None,
                     "one_ms": one[0] * 1e3 if one else None,
                     "one_tflops": flops / one[0] / 1e12 if one else None,
                     "one_err": one[1] if one else None})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"{name}, {args.dtype}, split via {variant if split else 'none (masked only)'}")
    print("| queries | prefix | masked ms | split ms | masked TFLOPS | split TFLOPS | speedup "
          "| one call ms | one call TFLOPS |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        sp = r["split_ms"]
        split = ("-", "-", "-") if sp is None else (
            f"{sp:.3f}", f"{r['split_tflops']:.0f}", f"{r['masked_ms'] / sp:.2f}x")
        one = ("-", "-") if r["one_ms"] is None else (f"{r['one_ms']:.3f}",
                                                      f"{r['one_tflops']:.0f}")
        print(f"| {r['queries']} | {r['prefix']} | {r['masked_ms']:.3f} | {split[0]} | "
              f"{r['masked_tflops']:.0f} | {split[1]} | {split[2]} | {one[0]} | {one[1]} |")
    print(json.dumps({"bench": "chunk_attention", "device": name, "dtype": args.dtype,
                      "variant": variant if split else None, "rows": rows}))


if __name__ == "__main__":
    main()
