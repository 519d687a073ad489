"""Engine throughput vs transformers on the default model (same machine, same threads).

Prefill: tokens/s of one prompt of 512 / 2048 tokens (engine: paged, prefill_chunk 512,
float32 as transformers). Decode: tokens/s of B sequences (128-token prompts) advancing
together for N steps (engine: decode_step continuous batching, in the default cluster's
decode precision: float32 with ``--linear-dtype`` linears, "auto" as
launch/configs/default.toml; transformers: generate() in float32 with a KV cache, decode
time = time(N+1 new tokens) - time(1 new token)). Median of a few repeats. The
transformers twin runs first, in a process of its own (``--twin-only``): sharing one
process with the engine, alternating, its decode at batch 32 ran 1.2-1.6x faster than
alone (220-247 against 151 tokens/s), with what the engine had run before it. Prints a
table, then one line of JSON.

``--variants float32/float32,float32/bfloat16,bfloat16/bfloat16`` instead compares engines
of different compute/KV dtypes side by side (runs interleaved, no transformers): prefill
512, decode at batch 8 and 32, KV bytes per token.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.engine import DecodeInput, Engine, EngineConfig  # noqa: E402
from common.model.loader import default_gguf_path  # noqa: E402

PROMPT_LEN = 128


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def engine_prefill(engine: Engine, n: int) -> Callable[[], float]:
    """A closure that prefills one n-token prompt and returns tokens/s."""
    ids = _tokens(n, n)
    blocks = engine.pool.allocate(engine.blocks_needed(n))
    engine.prefill(ids[:64], blocks)  # warm-up
    return lambda: n / _timed(lambda: engine.prefill(ids, blocks))


def engine_decode(engine: Engine, batch: int, steps: int, repeats: int) -> Callable[[], float]:
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
    return lambda: batch * steps / _timed(run)


def hf_prefill(model: torch.nn.Module, n: int) -> Callable[[], float]:
    ids = torch.tensor([_tokens(n, n)])
    with torch.inference_mode():
        model(ids[:, :64])

    def run() -> float:
        with torch.inference_mode():
            return n / _timed(lambda: model(ids, use_cache=True))
    return run


def hf_decode(model: torch.nn.Module, batch: int, steps: int) -> Callable[[], float]:
    """generate() time of steps+1 new tokens minus that of 1 new token (the prefill)."""
    ids = torch.tensor([_tokens(PROMPT_LEN, 1000 + i) for i in range(batch)])
    mask = torch.ones_like(ids)

    def gen(new: int) -> float:
        with torch.inference_mode():
            return _timed(lambda: model.generate(
                ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                do_sample=False, pad_token_id=2))

    gen(2)
    return lambda: batch * steps / max(gen(steps + 1) - gen(1), 1e-9)


def twin(steps: int, repeats: int) -> dict[str, float]:
    """The transformers twin's figures (``hf_`` keys), measured in this process."""
    from tests.model.hf_reference import load_hf_reference

    hf = load_hf_reference(default_gguf_path())
    fns = {f"hf_prefill_tps_{n}": hf_prefill(hf, n) for n in (512, 2048)}
    fns.update({f"hf_decode_tps_b{b}": hf_decode(hf, b, steps) for b in (1, 8, 32)})
    return measure(fns, repeats)


def twin_in_process(steps: int, repeats: int) -> dict[str, float]:
    """``twin`` in a process of its own, before the engine loads."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--twin-only",
                           "--steps", str(steps), "--repeats", str(repeats)],
                          capture_output=True, text=True, check=True, timeout=1800)
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(fns: dict[str, Callable[[], float]], repeats: int) -> dict[str, float]:
    """Each figure's median over ``repeats`` runs."""
    return {key: statistics.median(fn() for _ in range(repeats)) for key, fn in fns.items()}


def interleaved_medians(fns: list[Callable[[], float]], repeats: int) -> list[float]:
    """Median of each fn over `repeats` rounds; each round runs every fn once, in turn."""
    samples: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            samples[i].append(fn())
    return [statistics.median(xs) for xs in samples]


def compare_variants(spec: str, steps: int, repeats: int) -> None:
    """One engine per ``compute/kv`` dtype pair; the same workloads, interleaved."""
    variants = [tuple(v.split("/")) for v in spec.split(",")]
    engines = {f"{c}/{k}": Engine(EngineConfig(num_blocks=1024, dtype=c, kv_dtype=k))
               for c, k in variants}
    pairs: dict[str, list[Callable[[], float]]] = {"prefill_tps_512": [
        engine_prefill(e, 512) for e in engines.values()]}
    for b in (8, 32):
        pairs[f"decode_tps_b{b}"] = [engine_decode(e, b, steps, repeats) for e in engines.values()]
    res: dict[str, float] = {}
    for key, fns in pairs.items():
        for name, median in zip(engines, interleaved_medians(fns, repeats)):
            res[f"{key}[{name}]"] = median
    for name, e in engines.items():
        res[f"kv_bytes_per_token[{name}]"] = e.kv.block_nbytes / e.config.block_size
    names = list(engines)
    print(f"model smollm2-135m | threads {torch.get_num_threads()} | compute/kv dtype")
    print(f"{'metric':<20}" + "".join(f"{n:>20}" for n in names))
    for key in list(pairs) + ["kv_bytes_per_token"]:
        print(f"{key:<20}" + "".join(f"{res[f'{key}[{n}]']:>20.1f}" for n in names))
    print(json.dumps({k: round(v, 2) for k, v in res.items()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-hf", action="store_true", help="skip the transformers twins")
    ap.add_argument("--twin-only", action="store_true",
                    help="measure the transformers twins alone and print their JSON")
    ap.add_argument("--variants", help="compute/kv dtype pairs to compare, comma separated")
    ap.add_argument("--linear-dtype", default="auto",
                    help="the decode engine's linear_dtype (auto: bfloat16 on a CPU with "
                         "AVX-512 BF16 or AMX, as the default cluster's decode worker)")
    args = ap.parse_args()
    if args.variants:
        return compare_variants(args.variants, args.steps, args.repeats)
    if args.twin_only:
        return print(json.dumps(twin(args.steps, args.repeats)))
    hf = {} if args.no_hf else twin_in_process(args.steps, args.repeats)
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(num_blocks=1024))
    load_s = time.perf_counter() - t0
    linear = args.linear_dtype
    if linear == "auto":
        from common.worker import native_bfloat16

        linear = "bfloat16" if native_bfloat16() else "float32"
    decoder = engine if linear == "float32" else Engine(
        EngineConfig(num_blocks=1024, linear_dtype=linear))
    fns = {f"prefill_tps_{n}": engine_prefill(engine, n) for n in (512, 2048)}
    fns.update({f"decode_tps_b{b}": engine_decode(decoder, b, args.steps, args.repeats)
                for b in (1, 8, 32)})
    res = {**measure(fns, args.repeats), **hf}
    print(f"model smollm2-135m float32 (decode linears {linear}, attention "
          f"{type(decoder.attention).__name__}) | threads {torch.get_num_threads()} | "
          f"load {load_s:.2f} s")
    print(f"{'metric':<18}{'engine':>10}{'transformers':>14}{'ratio':>8}")
    for key in [k for k in res if not k.startswith("hf_")]:
        hf_v = res.get("hf_" + key)
        ratio = f"{res[key] / hf_v:.2f}" if hf_v else "-"
        print(f"{key:<18}{res[key]:>10.1f}{(hf_v or float('nan')):>14.1f}{ratio:>8}")
    res["load_s"] = load_s
    res["threads"] = torch.get_num_threads()
    res["decode_linear_bf16"] = float(linear == "bfloat16")
    print(json.dumps({k: round(v, 2) for k, v in res.items()}))


if __name__ == "__main__":
    main()
