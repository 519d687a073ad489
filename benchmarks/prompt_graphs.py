"""Prompt steps replayed as piecewise CUDA graphs against the same steps run eagerly, on one
engine (common/engine/prompt_graphs.py; issue 26 goal 3 at 4k: a warm 4k prompt's tenth
was bound by its launches on the H200).

    python benchmarks/prompt_graphs.py --device cuda      # dummy-llama3-8b, bfloat16
    python benchmarks/prompt_graphs.py                    # CPU smoke run: the pieces eager

One engine with ``prompt_graph_tokens`` (on a GPU the graphs are captured at start; on
the CPU they run eagerly from the same buffers, no faster: a check of the script). For
each case ``queries:prefix`` the prefix is computed first (untimed), then the chunk's step
is timed with the graphs and without them (``engine.prompt_graphs`` set aside), turn
about, ``--reps`` times each: wall time of ``Engine.step`` to the synchronized logits.
Default cases: a warm 4k prompt's tenth (416 after 3,680), short chunks after a prefix
(64 and 128 after 2,048), a fresh 256-token prompt and a warm 16k prompt's 512-token
chunk piece (512 after 14,736). Prints a table (medians, ms) and one JSON line.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.engine import Engine, EngineConfig  # noqa: E402
from common.engine.config import PrefillChunk  # noqa: E402


def timed_step(engine: Engine, chunk: PrefillChunk) -> tuple[float, torch.Tensor]:
    """Seconds of one step to its synchronized logits, and the logits."""
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    logits = engine.step([chunk])[0][0]
    sync()
    return time.perf_counter() - t0, logits.float()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default=None, help="default: dummy-llama3-8b on a GPU, "
                   "dummy-bench-prefill on the CPU")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--cases", default=None, help="queries:prefix pairs, comma-separated")
    p.add_argument("--graph-tokens", type=int, default=512)
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    gpu = args.device != "cpu"
    model = args.model or ("dummy-llama3-8b" if gpu else "dummy-bench-prefill")
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    cases = [tuple(int(x) for x in c.split(":")) for c in (
        args.cases or ("416:3680,64:2048,128:2048,256:0,512:14736" if gpu else "64:256,32:0"))
        .split(",")]
    longest = max(q + s for q, s in cases)
    started = time.perf_counter()
    engine = Engine(EngineConfig(model=model, dtype=dtype, device=args.device,
                                 num_blocks=longest // 16 + 8, prefill_chunk=2048,
                                 cuda_graphs=False, prompt_graph_tokens=args.graph_tokens))
    graphs = engine.prompt_graphs
    if graphs is None and not gpu:  # the CPU: the same pieces, eager (a check of the script)
        from common.engine.prompt_graphs import PromptGraphs
        graphs = engine.prompt_graphs = PromptGraphs(engine.model, args.graph_tokens,
                                                     capture=False)
    if graphs is None:
        print("no prompt graphs on this engine (capture failed: see the log)", file=sys.stderr)
        return 1
    print(f"{model} {dtype} on {args.device}: engine up in {time.perf_counter() - started:.1f} s,"
          f" graphs captured in {graphs.capture_s:.1f} s for {graphs.ladder}")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for queries, prefix in cases:
        ids = torch.randint(3, engine.model_config.vocab_size - 3, (prefix + queries,),
                            generator=gen).tolist()
        table = engine.pool.allocate(engine.blocks_needed(len(ids)))
        if prefix:
            engine.prefill(ids[:prefix], table)
        chunk = PrefillChunk(ids, prefix, prefix + queries, table)
        times: dict[str, list[float]] = {"graphs": [], "eager": []}
        out = {}
        for rep in range(args.reps + 1):  # the first of each untimed (warm-up)
            for mode in ("graphs", "eager"):
                engine.prompt_graphs = graphs if mode == "graphs" else None
                seconds, out[mode] = timed_step(engine, chunk)
                if rep:
                    times[mode].append(seconds)
        engine.prompt_graphs = graphs
        engine.pool.free(table)
        med = {m: sorted(t)[len(t) // 2] * 1e3 for m, t in times.items()}
        rows.append({"queries": queries, "prefix": prefix, "graphs_ms": med["graphs"],
                     "eager_ms": med["eager"], "speedup": med["eager"] / med["graphs"],
                     "max_abs_diff": (out["graphs"] - out["eager"]).abs().max().item(),
                     "same_argmax": bool(out["graphs"].argmax() == out["eager"].argmax())})
    print("| queries | prefix | eager ms | graphs ms | speedup | max logit diff | same argmax |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['queries']} | {r['prefix']} | {r['eager_ms']:.2f} | {r['graphs_ms']:.2f} | "
              f"{r['speedup']:.2f}x | {r['max_abs_diff']:.3g} | {r['same_argmax']} |")
    name = torch.cuda.get_device_name() if gpu else "cpu"
    print(json.dumps({"bench": "prompt_graphs", "device": name, "model": model, "dtype": dtype,
                      "ladder": graphs.ladder, "capture_s": graphs.capture_s, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
