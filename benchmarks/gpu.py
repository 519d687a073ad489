"""The engine and the KV path on a GPU: what one prefill or decode worker does there.

``python benchmarks/gpu.py [--model dummy-llama3-8b] [--device cuda]`` (~1 minute on an
H100/H200; ``--quick`` with ``--device cpu --model dummy-tiny`` checks the script here).

- prefill: TTFT of one prompt of 1k, 4k and 16k tokens alone in the engine (median of 3,
  after a warm-up), at the cluster's default chunk of 512 tokens and at 4096; the achieved
  TFLOP/s counts 2 x parameters x tokens plus the attention's 4 x layers x hidden x
  (causal pairs).
- decode: one step of B sequences at 1k tokens of context each: ms per step, tokens/s,
  replayed as a CUDA graph (the decode worker's path) and eager (the same kernels, one
  launch at a time), each also as a ratio to the floor: the step's matmuls alone (the
  engine's own weights, same shapes, no attention) captured in one CUDA graph. Also the
  paged attention kernel alone at the largest batch (GB/s of K/V read) and the time the
  engine took to capture its graphs.
- pieces: 2048 scattered pieces of one layer of one block (64 KiB for the 8B model), the
  unit of layer-wise streaming, in one transfer-engine write between host and GPU memory
  each way: µs per piece.
- KV: bytes per token; one layer of a 4k prompt's KV copied to pinned host memory, against
  that layer's share of the prefill (what layer-wise streaming must hide behind compute);
  a 4k prompt's KV written by the transfer engine (TCP on loopback, as the cluster does on
  one host) from GPU memory to another engine's host memory and to its GPU memory: GB/s.

Prints a table, then one line of JSON (with ``--out``, also written there, for
``benchmarks/results/gpu-<date>.json``); its ``goals`` object holds the figures issue 25
names.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import datetime, timezone
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common.engine import DecodeInput, Engine, EngineConfig  # noqa: E402
from common.model.moe import GatedMLP  # noqa: E402
from common.transfer import TransferAgent  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn: Callable[[], object], reps: int) -> float:
    """Median seconds of ``reps`` calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def prefill_flops(engine: Engine, n: int) -> float:
    """2 x (non-embedding) parameters x tokens, the last token's LM head, and attention:
    4 x heads x head_dim per (query, key) pair, n (n + 1) / 2 causal pairs per layer."""
    c = engine.model_config
    d, i, hd = c.hidden_size, c.intermediate_size, c.head_dim
    per_layer = d * hd * (2 * c.num_heads + 2 * c.num_kv_heads) + 3 * d * i
    attention = 4 * c.num_layers * c.num_heads * hd * n * (n + 1) / 2
    return 2 * c.num_layers * per_layer * n + 2 * c.vocab_size * d + attention


def run(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    lengths = [256, 1024] if args.quick else [1024, 4096, 16384]
    batches = [1, 8] if args.quick else [1, 8, 32, 128]
    context = 256 if args.quick else 1024
    block = 16
    need = max(lengths) + 16 + max(batches) * (context + 8)
    engines, capture_s = {}, 0.0
    for chunk in args.chunks[:1] if args.decode_only else args.chunks:  # graphs on the
        # first engine only: the others prefill
        t = time.perf_counter()
        engines[chunk] = Engine(EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device, block_size=block,
            num_blocks=need // block + 8, prefill_chunk=chunk, max_batch_size=max(batches),
            cuda_graphs=not engines, num_layers=args.layers))
        capture_s = capture_s or time.perf_counter() - t
    res: dict = {"model": args.model, "dtype": args.dtype, "device": str(device),
                 "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                 "prefill": {}, "decode": {}}
    e = engines[args.chunks[0]]
    vocab = e.model_config.vocab_size
    # ---- prefill
    for n in ([] if args.decode_only else lengths):
        ids = prompt(n, vocab, n)
        for chunk, eng in engines.items():
            blocks = eng.pool.allocate(eng.blocks_needed(n))
            s = timed(device, lambda: eng.prefill(ids, blocks), args.reps)
            eng.pool.free(blocks)
            res["prefill"][f"{n}/{chunk}"] = {"s": s, "tflops": prefill_flops(eng, n) / s / 1e12}
    # ---- decode (on the first engine): contexts of random KV, not prefilled
    for first in range(0, e.kv.num_blocks, 256):
        e.kv.data[first:first + 256].normal_()
    res["engine_start_s"] = capture_s
    res["graphs"] = e.graphs is not None
    res["capture_s"] = e.graphs.capture_s if e.graphs is not None else 0.0
    for b in batches:
        seqs = []
        for i in range(b):
            blocks = e.pool.allocate(e.blocks_needed(context + 8))
            seqs.append(DecodeInput(5 + i, context, blocks))
        s = timed(device, lambda: e.decode_step(seqs), args.reps)
        eager = timed(device, lambda: e.step(decodes=seqs), args.reps)
        dense = all(lw.wqkv is not None and isinstance(lw.mlp, GatedMLP)
                    for lw in e.model.layers)  # a mixture's or latent model's: no floor
        floor = (matmul_floor(e, b, args.reps) if device.type == "cuda" and dense
                 else float("nan"))
        if b >= 32 or b == max(batches):
            res.setdefault("attention", {})[str(b)] = attention_alone(
                e, seqs, args.reps, args.sweep)
        for q in seqs:
            e.pool.free(q.block_table)
        res["decode"][str(b)] = {"ms": s * 1e3, "tok_s": b / s, "eager_ms": eager * 1e3,
                                 "floor_ms": floor * 1e3, "over_floor": s / floor,
                                 "eager_over_floor": eager / floor}
    if args.no_kv or args.decode_only:
        return res
    # ---- KV
    n = lengths[1]
    blocks = e.pool.allocate(e.blocks_needed(n))
    idx = torch.tensor(blocks, device=device)
    kv_per_token = e.kv.block_nbytes // block
    layer = e.kv.data[idx, 0]  # one layer of the prompt's blocks
    host = torch.empty(layer.shape, dtype=layer.dtype, pin_memory=device.type == "cuda")
    copy_s = timed(device, lambda: host.copy_(e.kv.data[idx, 0]), args.reps)
    layer_compute_s = res["prefill"][f"{n}/{args.chunks[0]}"]["s"] / e.model_config.num_layers
    res["kv"] = {"bytes_per_token": kv_per_token, "layer_bytes": layer.numel() * layer.element_size(),
                 "layer_copy_to_host_s": copy_s, "layer_compute_s": layer_compute_s}
    res["kv"]["transfer"] = transfer(e, blocks, device, args.reps)
    e.pool.free(blocks)
    res["pieces"] = pieces(e.kv.layer_nbytes, 256 if args.quick else 2048, device, args.reps)
    return res


def matmul_floor(e: Engine, b: int, reps: int) -> float:
    """Seconds of a decode step's matmuls alone at batch ``b``: every layer's four linears
    and the LM head over the engine's own weights, captured in one CUDA graph (no
    attention, no norms): what the card's memory allows a step."""
    m, c = e.model, e.model_config
    x = torch.randn(b, c.hidden_size, dtype=e.dtype, device=e.device)
    o = torch.randn(b, c.num_heads * c.head_dim, dtype=e.dtype, device=e.device)
    act = torch.randn(b, c.intermediate_size, dtype=e.dtype, device=e.device)

    def step() -> None:
        for lw in m.layers:
            lw.wqkv(x), lw.wo(o), lw.mlp.gate_up(x), lw.mlp.down(act)
        m.lm_head(x)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return timed(e.device, graph.replay, reps)


def attention_alone(e: Engine, seqs: list[DecodeInput], reps: int, sweep: bool) -> dict:
    """The paged decode kernel alone, one layer, the batch's sequences: GB/s of K/V, at the
    engine's launch and (``sweep``) at others."""
    from common.model import triton_ops

    if not triton_ops.usable_on(e.device):
        return {}
    c, page = e.model_config, e.kv.block_size
    width = max(s.position // page + 1 for s in seqs)
    tables = torch.tensor([s.block_table[:width] for s in seqs], device=e.device)
    lens = torch.tensor([s.position + 1 for s in seqs], dtype=torch.int32, device=e.device)
    q = torch.randn(len(seqs), c.num_heads, c.head_dim, dtype=e.dtype, device=e.device)
    layer = e.kv.layer_view(0)
    kv_bytes = int(lens.sum()) * e.kv.layer_nbytes // page
    out: dict = {"batch": len(seqs), "kv_bytes": kv_bytes, "sweep": {}}
    out["s"] = timed(e.device, lambda: triton_ops.paged_decode_attention(q, layer, tables, lens),
                     reps * 5)  # the engine's launch
    if sweep:  # others: context slices, keys a tile, warps, pipeline stages
        for splits in (1, 2, 3, 4, 8):
            for block_n, warps, stages in ((32, 4, 2), (64, 4, 2), (32, 4, 3), (32, 2, 2),
                                           (16, 4, 2), (16, 2, 3)):
                s = timed(e.device, lambda: triton_ops.paged_decode_attention(
                    q, layer, tables, lens, splits, block_n=block_n, num_warps=warps,
                    num_stages=stages), reps * 5)
                out["sweep"][f"{splits}/{block_n}/{warps}/{stages}"] = kv_bytes / s / 1e9
    out["gb_s"] = kv_bytes / out["s"] / 1e9
    return out


def pieces(size: int, n: int, device: torch.device, reps: int) -> dict:
    """``n`` scattered pieces of ``size`` bytes (one layer of one block: what layer-wise
    streaming sends) in one transfer-engine write, between host and GPU memory each way:
    where the per-piece cost lies. Pieces sit every other slot, so none coalesce."""
    local, remote = TransferAgent(), TransferAgent()
    kinds = ["cpu"] + (["cuda"] if device.type == "cuda" else [])
    out = {}
    try:
        for src_dev in kinds:
            for dst_dev in kinds:
                src = torch.randint(0, 255, (2 * n * size,), dtype=torch.uint8, device=src_dev)
                dst = torch.zeros(2 * n * size, dtype=torch.uint8, device=dst_dev)
                local.register(src.data_ptr(), src.numel())
                remote.register(dst.data_ptr(), dst.numel())
                at = [2 * i * size for i in range(n)]
                s = timed(device, lambda: local.write(
                    remote.session_id, [src.data_ptr() + a for a in at],
                    [dst.data_ptr() + a for a in at], [size] * n, timeout=120), reps)
                ok = torch.equal(src.view(2 * n, size)[::2].cpu(), dst.view(2 * n, size)[::2].cpu())
                name = f"{'gpu' if src_dev == 'cuda' else 'host'} -> {'gpu' if dst_dev == 'cuda' else 'host'}"
                out[name] = {"piece_bytes": size, "pieces": n, "s": s, "us_per_piece": s / n * 1e6,
                             "gb_s": n * size / s / 1e9, "bytes_equal": ok}
                local.unregister(src.data_ptr())
                remote.unregister(dst.data_ptr())
    finally:
        local.close()
        remote.close()
    return out


def transfer(e: Engine, blocks: list[int], device: torch.device, reps: int) -> dict:
    """One prompt's KV blocks from this engine's pool to a peer engine's host / GPU buffer."""
    local, remote = TransferAgent(), TransferAgent()
    out = {}
    try:
        local.register(e.kv.base_address, e.kv.nbytes)
        size = len(blocks) * e.kv.block_nbytes
        src = [e.kv.block_address(b) for b in blocks]
        targets = {"host": "cpu"} | ({"gpu": device.type} if device.type == "cuda" else {})
        for name, dev in targets.items():
            dst = torch.empty(size, dtype=torch.uint8, device=dev)
            remote.register(dst.data_ptr(), size)
            addrs = [dst.data_ptr() + i * e.kv.block_nbytes for i in range(len(blocks))]
            lengths = [e.kv.block_nbytes] * len(blocks)
            s = timed(device, lambda: local.write(remote.session_id, src, addrs, lengths,
                                                  timeout=120), reps)
            want = e.kv.data[torch.tensor(blocks, device=e.kv.data.device)].reshape(-1)
            ok = torch.equal(dst.view(want.dtype).cpu(), want.cpu())
            out[name] = {"bytes": size, "s": s, "gb_s": size / s / 1e9, "bytes_equal": ok}
            remote.unregister(dst.data_ptr())
    finally:
        local.close()
        remote.close()
    return out


def goals(res: dict) -> dict:
    """Issue 25's figures: batch 1 over the floor, batches 128 and 32 in tokens/s, the 4k
    prompt's TFLOP/s at the first chunk size (those measured; NaN where not)."""
    d, nan = res["decode"], {"tok_s": float("nan"), "over_floor": float("nan")}
    first = next((v for k, v in res["prefill"].items() if k.startswith("4096/")), None)
    return {"decode_b1_over_floor": d.get("1", nan)["over_floor"],
            "decode_b128_tok_s": d.get("128", nan)["tok_s"],
            "decode_b32_tok_s": d.get("32", nan)["tok_s"],
            "prefill_4k_tflops": first["tflops"] if first else float("nan")}


def table(res: dict) -> str:
    rows = [f"{res['name']} ({res['device']}), {res['model']} {res['dtype']}", "",
            "| prefill | chunk | TTFT (s) | TFLOP/s |", "|---|---|---|---|"]
    for key, v in res["prefill"].items():
        n, chunk = key.split("/")
        rows.append(f"| {n} | {chunk} | {v['s']:.4f} | {v['tflops']:.1f} |")
    rows += ["", f"decode (CUDA graphs: {res['graphs']}, captured in {res['capture_s']:.1f} s; "
             f"engine start {res['engine_start_s']:.1f} s)", "",
             "| decode batch | ms/step | tokens/s | eager ms/step | floor ms | x floor "
             "| eager x floor |", "|---|---|---|---|---|---|---|"]
    rows += [f"| {b} | {v['ms']:.2f} | {v['tok_s']:.0f} | {v['eager_ms']:.2f} | "
             f"{v['floor_ms']:.2f} | {v['over_floor']:.2f} | {v['eager_over_floor']:.2f} |"
             for b, v in res["decode"].items()]
    for a in (res.get("attention") or {}).values():
        if not a:
            continue
        rows += ["", f"paged decode attention alone, one layer, batch {a['batch']}: "
                 f"{a['s'] * 1e6:.0f} us, {a['kv_bytes'] / 2**20:.0f} MiB of K/V, "
                 f"{a['gb_s']:.0f} GB/s"]
        if a["sweep"]:
            best = sorted(a["sweep"].items(), key=lambda kv: -kv[1])
            rows.append("  other launches (splits/block_n/warps/stages), GB/s: "
                        + ", ".join(f"{k} {v:.0f}" for k, v in best))
    rows += ["", "goals: " + ", ".join(f"{k} {v:.2f}" for k, v in res["goals"].items())]
    if "kv" not in res:
        return "\n".join(rows)
    kv = res["kv"]
    rows += ["", f"KV {kv['bytes_per_token'] / 1024:.0f} KiB/token; one layer of the prompt "
             f"({kv['layer_bytes'] / 2**20:.1f} MiB) to pinned host {kv['layer_copy_to_host_s'] * 1e3:.2f} ms "
             f"vs its prefill share {kv['layer_compute_s'] * 1e3:.2f} ms",
             "", "| transfer engine (TCP, loopback) | MiB | s | GB/s | bytes equal |", "|---|---|---|---|---|"]
    rows += [f"| GPU -> {name} | {v['bytes'] / 2**20:.0f} | {v['s']:.3f} | {v['gb_s']:.2f} | {v['bytes_equal']} |"
             for name, v in kv["transfer"].items()]
    rows += ["", "| scattered pieces (one layer of a block each) | KiB | pieces | µs per piece | GB/s | bytes equal |",
             "|---|---|---|---|---|---|"]
    rows += [f"| {name} | {v['piece_bytes'] / 1024:.0f} | {v['pieces']} | {v['us_per_piece']:.1f} | {v['gb_s']:.2f} | {v['bytes_equal']} |"
             for name, v in res["pieces"].items()]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="dummy-llama3-8b")
    p.add_argument("--layers", type=int, help="the model's first this many layers only")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--chunks", default="512,4096", help="prefill chunk sizes to compare")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="short prompts and batches")
    p.add_argument("--pieces-only", action="store_true", help="only the scattered pieces")
    p.add_argument("--out", help="also write the JSON line to this file")
    p.add_argument("--sweep", action="store_true",
                   help="time the attention kernel at other launch shapes too")
    p.add_argument("--decode-only", action="store_true", help="no prefill figures")
    p.add_argument("--no-kv", action="store_true",
                   help="the engine only: no KV copies, transfers or pieces")
    args = p.parse_args(argv)
    args.chunks = [int(c) for c in args.chunks.split(",")]
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if args.pieces_only:
        from common.kv.memory import PagedKVMemory
        from common.model.config import DUMMY_CONFIGS

        c = DUMMY_CONFIGS[args.model]  # one layer of one block, as the engine lays it out
        layer = PagedKVMemory(1, 1, 16, c.num_kv_heads, c.head_dim,
                              getattr(torch, args.dtype)).layer_nbytes
        res = {"pieces": pieces(layer, 256 if args.quick else 2048, torch.device(args.device),
                                args.reps), "date": started}
        print(json.dumps(res))
        return 0
    with torch.inference_mode():
        res = run(args)
    res["date"] = started
    res["goals"] = goals(res)
    print(table(res))
    print(json.dumps(res))
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
