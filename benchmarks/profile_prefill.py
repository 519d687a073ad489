"""Profile our CPU engine and write a CostModel JSON (prefill polynomial + decode TBT).

    python benchmarks/profile_prefill.py --model smollm2-135m --out out/cost_cpu.json

Prefill: time ``engine.prefill`` for a grid of (new, cached) tokens (the cached prefix is
computed first, untimed) and fit ``f(n, c)`` by least squares. Decode: time
``engine.decode_step`` for batch sizes x contexts and fit ``g(B, K)``. The JSON can be fed
to ``crescent simulate --profile PATH``.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.scheduling import CostModel, DecodeCoefficients, fit_prefill_cost  # noqa: E402
from common.scheduling.cost import fit_decode_cost  # noqa: E402


def _tokens(engine, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(10, engine.model_config.vocab_size - 10, size=n)]


def profile_prefill(engine, news: Sequence[int], cacheds: Sequence[int], reps: int) -> list:
    samples = []
    for cached in cacheds:
        for new in news:
            ids = _tokens(engine, cached + new, seed=cached * 7919 + new)
            table = engine.pool.allocate(engine.blocks_needed(len(ids)))
            try:
                if cached:
                    engine.prefill(ids[:cached], table, 0)
                best = min(_timed(lambda: engine.prefill(ids, table, cached)) for _ in range(reps))
            finally:
                engine.pool.free(table)
            samples.append((new, cached, best))
            print(f"prefill new={new:5d} cached={cached:5d}: {best * 1000:8.2f} ms", flush=True)
    return samples


def profile_decode(engine, batches: Sequence[int], contexts: Sequence[int], reps: int) -> DecodeCoefficients:
    from common.engine.config import DecodeInput

    samples = []
    for ctx in contexts:
        for b in batches:
            tables = [engine.pool.allocate(engine.blocks_needed(ctx + 1)) for _ in range(b)]
            try:
                batch = [DecodeInput(token_id=11, position=ctx, block_table=t) for t in tables]
                best = min(_timed(lambda: engine.decode_step(batch)) for _ in range(reps))
            finally:
                for t in tables:
                    engine.pool.free(t)
            samples.append((b, b * ctx, best))
            print(f"decode batch={b:3d} ctx={ctx:5d}: {best * 1000:8.2f} ms", flush=True)
    return fit_decode_cost(samples)


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out", type=Path, default=Path("out/cost_cpu.json"))
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--bandwidth", type=float, default=1e9,
                    help="KV transfer bytes/s (TCP loopback through the transfer engine: ~1e9)")
    ap.add_argument("--quick", action="store_true", help="small grid (a smoke test)")
    args = ap.parse_args(argv)
    try:
        from common.engine.config import EngineConfig
        from common.engine.engine import Engine
    except ImportError as e:
        print(f"engine not available: {e}")
        return 2
    news = (16, 64, 256) if args.quick else (16, 64, 128, 256, 512, 1024)
    cacheds = (0, 256) if args.quick else (0, 256, 1024, 2048)
    batches = (1, 4) if args.quick else (1, 4, 16)
    contexts = (64, 512) if args.quick else (64, 512, 2048)
    # Room for the largest decode batch at the longest context, and the longest prefill.
    blocks = max(max(batches) * (max(contexts) // 16 + 2), (max(news) + max(cacheds)) // 16 + 2)
    engine = Engine(EngineConfig(model=args.model, num_blocks=blocks))
    samples = profile_prefill(engine, news, cacheds, args.reps)
    decode = profile_decode(engine, batches, contexts, args.reps)
    mc = engine.model_config
    cost = CostModel(
        prefill=fit_prefill_cost(samples), decode=decode,
        kv_bytes_per_token=2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * engine.kv.data.element_size(),
        transfer_bandwidth_bytes_per_s=args.bandwidth,
        kv_capacity_tokens=engine.config.num_blocks * engine.config.block_size,
        name=f"cpu-{args.model}",
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    cost.to_json(args.out)
    for n, c, s in samples:
        print(f"fit check new={n:5d} cached={c:5d}: measured {s * 1000:8.2f} ms, "
              f"fitted {cost.prefill_seconds(n, c) * 1000:8.2f} ms")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
