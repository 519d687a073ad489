"""Engine throughput vs transformers on the default model (same machine, same threads).

Prefill: tokens/s of one prompt of 512 / 2048 tokens (engine: paged, prefill_chunk 512).
Decode: tokens/s of B sequences (128-token prompts) advancing together for N steps
(engine: decode_step continuous batching; transformers: generate() with a KV cache,
decode time = time(N+1 new tokens) - time(1 new token)). Median of a few repeats.
Prints a table, then one line of JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.engine import DecodeInput, Engine, EngineConfig  # noqa: E402
from common.model.loader import default_gguf_path  # noqa: E402

PROMPT_LEN = 128


def _median_time(fn: Callable[[], None], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_prefill_tps(engine: Engine, n: int, repeats: int) -> float:
    ids = _tokens(n, n)
    blocks = engine.pool.allocate(engine.blocks_needed(n))
    engine.prefill(ids[:64], blocks)  # warm-up
    t = _median_time(lambda: engine.prefill(ids, blocks), repeats)
    engine.pool.free(blocks)
    return n / t


def engine_decode_tps(engine: Engine, batch: int, steps: int, repeats: int) -> float:
    seqs = []
    for i in range(batch):
        ids = _tokens(PROMPT_LEN, 1000 + i)
        blocks = engine.pool.allocate(engine.blocks_needed(PROMPT_LEN + steps * (repeats + 1)))
        engine.prefill(ids, blocks)
        seqs.append([ids[-1], PROMPT_LEN, blocks])

    def run() -> None:
        for _ in range(steps):
            logits = engine.decode_step([DecodeInput(t, p, b) for t, p, b in seqs])
            for s, tok in zip(seqs, logits.argmax(-1).tolist()):
                s[0], s[1] = tok, s[1] + 1

    run()  # warm-up
    t = _median_time(run, repeats)
    for _, _, blocks in seqs:
        engine.pool.free(blocks)
    return batch * steps / t


@torch.inference_mode()
def hf_prefill_tps(model: torch.nn.Module, n: int, repeats: int) -> float:
    ids = torch.tensor([_tokens(n, n)])
    model(ids[:, :64])
    return n / _median_time(lambda: model(ids, use_cache=True), repeats)


@torch.inference_mode()
def hf_decode_tps(model: torch.nn.Module, batch: int, steps: int, repeats: int) -> float:
    ids = torch.tensor([_tokens(PROMPT_LEN, 1000 + i) for i in range(batch)])
    mask = torch.ones_like(ids)

    def gen(new: int) -> Callable[[], None]:
        return lambda: model.generate(ids, attention_mask=mask, max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=2)

    gen(2)()
    t_full = _median_time(gen(steps + 1), repeats)
    t_first = _median_time(gen(1), repeats)
    return batch * steps / max(t_full - t_first, 1e-9)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers twins")
    args = ap.parse_args()
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(num_blocks=1024))
    load_s = time.perf_counter() - t0
    res: dict[str, float] = {}
    res["prefill_tps_512"] = engine_prefill_tps(engine, 512, args.repeats)
    res["prefill_tps_2048"] = engine_prefill_tps(engine, 2048, args.repeats)
    for b in (1, 8, 32):
        res[f"decode_tps_b{b}"] = engine_decode_tps(engine, b, args.steps, args.repeats)
    if not args.no_hf:
        from tests.engine.hf_reference import load_hf_reference

        hf = load_hf_reference(default_gguf_path())
        res["hf_prefill_tps_512"] = hf_prefill_tps(hf, 512, args.repeats)
        res["hf_prefill_tps_2048"] = hf_prefill_tps(hf, 2048, args.repeats)
        for b in (1, 8, 32):
            res[f"hf_decode_tps_b{b}"] = hf_decode_tps(hf, b, args.steps, args.repeats)
    print(f"model smollm2-135m float32 | threads {torch.get_num_threads()} | load {load_s:.2f} s")
    print(f"{'metric':<18}{'engine':>10}{'transformers':>14}{'ratio':>8}")
    for key in [k for k in res if not k.startswith("hf_")]:
        hf_v = res.get("hf_" + key)
        ratio = f"{res[key] / hf_v:.2f}" if hf_v else "-"
        print(f"{key:<18}{res[key]:>10.1f}{(hf_v or float('nan')):>14.1f}{ratio:>8}")
    res["load_s"] = load_s
    res["threads"] = torch.get_num_threads()
    print(json.dumps({k: round(v, 2) for k, v in res.items()}))


if __name__ == "__main__":
    main()
