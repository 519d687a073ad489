"""Latent attention on the CPU (common/model/latent.py): what a decode step's attention costs
when the KV cache holds DeepSeek's latent (one head of 576: the latent and the rotated
key) against every head's own k and v (16 heads of 192, the materialized form), and what
a whole decode step of Moonlight-16B-A3B's shape costs.

1. The attention alone (csrc/paged_attention.c, the decode kernel), Moonlight's 16 query
   heads: ``latent`` (1 KV head of 576; every head scores 576 dimensions a key) against
   ``per-head`` (16 KV heads of 192), KV in bfloat16, contexts ``--contexts``, batches
   ``--batches``: the least ms of ``--rounds`` rounds, and the KV bytes a token a layer.
2. ``dummy-moonlight-16b-a3b`` cut to ``--layers`` layers with its LM head, random weights
   quantized at load (``q4_0``): ms per decode step at the same contexts and batches, and
   the share of a step its per-head absorptions take.

    python benchmarks/latent.py [--contexts 1024,4096,16384] [--batches 1,8] [--threads 1]

Prints the tables, then one JSON line (``--out`` writes it to a file too).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.decode_step import step_ms  # noqa: E402
from benchmarks.quantized import emit  # noqa: E402
from common.engine import Engine, EngineConfig  # noqa: E402
from common.kv.memory import PagedKVMemory  # noqa: E402
from common.model import cpu_attention  # noqa: E402

HEADS = 16
FORMS = {"latent": (1, 576), "per-head": (16, 192)}  # (KV heads, width)
MODEL = "dummy-moonlight-16b-a3b"


def attention_ms(kernel: cpu_attention.PagedAttentionKernel, kv_heads: int, width: int,
                 context: int, batch: int, rounds: int) -> float:
    blocks = -(-context // 16)
    kv = PagedKVMemory(batch * blocks, 1, 16, kv_heads, width, torch.bfloat16,
                       torch.device("cpu"))
    kv.data.normal_()
    tables = torch.arange(batch * blocks).view(batch, blocks)
    lens = torch.full((batch,), context, dtype=torch.int32)
    q = torch.randn(batch, HEADS, width)
    times = []
    for _ in range(rounds * 3):
        started = time.perf_counter()
        kernel.attend(q, kv, 0, tables, None, lens, width ** -0.5, context)
        times.append(time.perf_counter() - started)
    return min(times) * 1e3


def absorb_share(engine: Engine, batch: int, context: int) -> float:
    """The share of a decode step the per-head absorptions take (their time, measured
    by wrapping them, over the step's)."""
    spent: list[float] = []
    latents = [lw.latent for lw in engine.model.layers if lw.latent is not None]
    originals = [(lat, lat.absorb_q, lat.absorb_v) for lat in latents]

    def timed(linear):
        def call(x):
            started = time.perf_counter()
            y = linear(x)
            spent.append(time.perf_counter() - started)
            return y
        return call

    for lat in latents:
        lat.absorb_q = [timed(lin) for lin in lat.absorb_q]
        lat.absorb_v = [timed(lin) for lin in lat.absorb_v]
    try:
        step = step_ms(engine, batch, context, steps=4, distinct=True)
        per_step = sum(spent) * 1e3 / 4
    finally:
        for lat, q, v in originals:
            lat.absorb_q, lat.absorb_v = q, v
    return round(per_step / step, 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", help="also write the JSON line here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = cpu_attention.kernel()
    if kernel is None:
        sys.exit("the CPU attention kernel does not build here")
    contexts = [int(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batches.split(",")]

    print(f"attention of {HEADS} query heads, KV bfloat16, {args.threads} thread(s): ms")
    print(f"{'context':>8}{'batch':>6}" + "".join(f"{n:>10}" for n in FORMS) + f"{'ratio':>8}")
    attention: dict[str, dict[str, float]] = {}
    for context in contexts:
        for batch in batches:
            row = {name: round(attention_ms(kernel, h, w, context, batch, args.rounds), 3)
                   for name, (h, w) in FORMS.items()}
            attention[f"ctx{context}_b{batch}"] = row
            print(f"{context:>8}{batch:>6}" + "".join(f"{row[n]:>10.3f}" for n in FORMS)
                  + f"{row['latent'] / row['per-head']:>8.2f}")
    kv_bytes = {name: 2 * h * w * 2 for name, (h, w) in FORMS.items()}  # K and V, bf16
    print("KV bytes a token a layer: " + ", ".join(f"{n} {b:,}" for n, b in kv_bytes.items()))

    blocks = max(batches) * (max(contexts) + 120) // 16 + 64
    engine = Engine(EngineConfig(model=MODEL, num_layers=args.layers, kv_dtype="bfloat16",
                                 quantization="q4_0", num_blocks=blocks))
    print(f"\n{MODEL}, {args.layers} layers, q4_0: ms per decode step (absorptions' share)")
    steps: dict[str, dict[str, float]] = {}
    for context in [c for c in contexts if c + 70 < engine.max_context]:  # 8,192 positions
        for batch in batches:
            ms = min(step_ms(engine, batch, context, distinct=True) for _ in range(args.rounds))
            share = absorb_share(engine, batch, context)
            steps[f"ctx{context}_b{batch}"] = {"ms": round(ms, 1), "absorb_share": share}
            print(f"{context:>8}{batch:>6}{ms:>10.1f}{share:>8.1%}")
    emit({"threads": args.threads, "layers": args.layers, "attention_ms": attention,
          "kv_bytes_per_token_layer": kv_bytes, "moonlight_steps": steps}, args.out)


if __name__ == "__main__":
    main()
