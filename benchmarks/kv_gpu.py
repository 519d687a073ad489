"""GPU KV on one host (issue 26): prefill → decode and to and from the store, every path
side by side in one run, between two processes.

``python benchmarks/kv_gpu.py [--tokens 4096] [--prefill PREFILL_JSON] [--out PATH]``
(~1 minute on an H100/H200; ``--device cpu`` runs the host paths here as a check).

A second process plays the decode worker and the store node: it holds a paged KV memory
of dummy-llama3-8b's shape (bfloat16, 128 KiB per token) on the GPU, exports it through
CUDA IPC (``common/kv/cuda_ipc.py``), creates a store segment in /dev/shm as a store node
does, and registers both with its transfer engine. This process holds the prefill's KV
and moves one prompt of ``--tokens`` tokens (scattered blocks on both sides):

- prefill → decode: whole blocks and layer by layer (one call per layer, as layer-wise
  streaming does), through CUDA IPC (``PeerKVCuda``) and through the transfer engine over
  TCP (today's path);
- store writes and reads (``RangeMover``, whole blocks and per layer): through the segment
  registered as pinned memory (``common/store/pinned.py``) and through the transfer engine.

Every path's bytes are checked equal at the destination. ``--prefill`` folds in what
``benchmarks/prefill.py --device cuda`` measured on live clusters (its JSON line): the
cached-prefix speedups and the largest layer-wise / after-prefill TTFT ratio. Prints a
table, then one JSON line whose ``goals`` hold issue 26's figures.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.gpu import timed  # noqa: E402
from common.host import host_id  # noqa: E402
from common.kv.cuda_ipc import PeerKVCuda, export  # noqa: E402
from common.kv.memory import KV_DTYPES, PagedKVMemory  # noqa: E402
from common.model.config import DUMMY_CONFIGS  # noqa: E402
from common.store.plans import GetPlan, Location, NodeRef, PutPlan, Replicas  # noqa: E402
from common.store.ranges import RangeMover  # noqa: E402
from common.store.shm import Segment, owned_path  # noqa: E402
from common.transfer import TransferAgent  # noqa: E402

BLOCK = 16


def kv_memory(args: argparse.Namespace, blocks: int) -> PagedKVMemory:
    c = DUMMY_CONFIGS[args.model]
    return PagedKVMemory(blocks, c.num_layers, BLOCK, c.num_kv_heads, c.head_dim,
                         KV_DTYPES[args.dtype], args.device)


def peer_process(args: argparse.Namespace, conn) -> None:
    """The decode worker and the store node: answers "sum" requests until "stop"."""
    kv = kv_memory(args, args.peer_blocks)
    agent = TransferAgent()
    agent.register(kv.base_address, kv.nbytes)
    path = owned_path(args.shm_dir, "store", "bench")
    seg = Segment(args.segment_bytes, path, create=True)
    agent.register(seg.base, seg.nbytes)
    conn.send({"ipc": export(kv), "session": agent.session_id, "kv_base": kv.base_address,
               "segment": path, "segment_base": seg.base})
    flat = kv.data.view(-1).view(torch.uint8)
    while True:
        msg = conn.recv()
        if msg == "stop":
            break
        if msg == "zero":
            kv.data.zero_()
            conn.send(checksum(flat.view(kv.num_blocks, -1), [0]))  # (synchronizes)
            continue
        conn.send(checksum(flat.view(kv.num_blocks, -1), msg))  # of these blocks
    seg.close(unlink=True)


def checksum(rows: torch.Tensor, blocks: list[int]) -> list[int]:
    """Per block (a row of bytes), a sum of its 32-bit words weighted by position mod 251:
    any moved, swapped or missing byte changes it. One block at a time (no large temp)."""
    words = rows.view(torch.int32)
    w = torch.arange(words.shape[1], device=rows.device) % 251 + 1
    return [int((words[b].to(torch.int64) * w).sum()) for b in blocks]


def run(args: argparse.Namespace) -> dict:
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=peer_process, args=(args, there), daemon=True)
    proc.start()
    try:
        info = here.recv()
        return measure(args, info, here)
    finally:
        here.send("stop")
        proc.join(30)


def measure(args: argparse.Namespace, info: dict, conn) -> dict:
    n_blocks = args.tokens // BLOCK
    kv = kv_memory(args, args.local_blocks)
    kv.data.normal_()
    g = torch.Generator().manual_seed(0)
    local = torch.randperm(args.local_blocks, generator=g)[:n_blocks].tolist()
    remote = torch.randperm(args.peer_blocks, generator=g)[:n_blocks].tolist()
    flat = kv.data.view(-1).view(torch.uint8)
    want = checksum(flat.view(kv.num_blocks, -1), local)
    nbytes = n_blocks * kv.block_nbytes
    agent = TransferAgent()
    agent.register(kv.base_address, kv.nbytes)
    res: dict = {"tokens": args.tokens, "bytes": nbytes, "p2d": {}, "store": {}}

    def check_peer() -> bool:
        """The decode side's blocks hold the prefill's bytes; then zeroed for the next."""
        conn.send(remote)
        ok = conn.recv() == want
        conn.send("zero")
        conn.recv()
        return ok

    # ---- prefill → decode
    paths: dict[str, tuple[Callable[[], object], Callable[[], object]]] = {}
    if info["ipc"]:
        try:
            peer = PeerKVCuda.open(info["ipc"], kv)

            def ipc_layers() -> None:  # as a layer-wise stream: rows once, a launch a layer
                src, dst = peer.rows(local, remote)
                for layer in range(kv.num_layers):
                    done = peer.launch(src, dst, range(layer, layer + 1))
                done.synchronize()
            paths["cuda_ipc"] = (lambda: peer.write_blocks(local, remote), ipc_layers)
        except (RuntimeError, ValueError) as exc:
            res["p2d"]["cuda_ipc"] = {"error": repr(exc)}
    rb = kv.block_nbytes

    def te_blocks() -> None:
        agent.write(info["session"], [kv.block_address(b) for b in local],
                    [info["kv_base"] + r * rb for r in remote], [rb] * n_blocks)

    def te_layers() -> None:
        for layer in range(kv.num_layers):
            agent.write(info["session"], [kv.layer_address(b, layer) for b in local],
                        [info["kv_base"] + r * rb + layer * kv.layer_nbytes for r in remote],
                        [kv.layer_nbytes] * n_blocks)
    paths["transfer_engine"] = (te_blocks, te_layers)
    for name, (blocks_fn, layers_fn) in paths.items():
        reps = args.reps if name != "transfer_engine" else 1
        row: dict = {}
        for mode, fn in (("blocks", blocks_fn), ("layers", layers_fn)):
            try:
                s = timed(torch.device(args.device), fn, reps)
                row[mode] = {"s": s, "gbps": nbytes / s / 1e9, "equal": check_peer()}
            except Exception as exc:  # one path's failure must not hide the others
                row[mode] = {"error": repr(exc), "gbps": 0.0, "equal": False}
        res["p2d"][name] = row

    # ---- the store: whole blocks and per layer, written then read back elsewhere
    node = NodeRef("bench", info["session"], info["segment_base"], args.segment_bytes,
                   info["segment"], 1, "127.0.0.1", host_id())
    keys = [f"{i:064x}" for i in range(n_blocks)]
    offsets = torch.randperm(args.segment_bytes // rb, generator=g)[:n_blocks].tolist()
    replicas = [Replicas([Location("bench", o * rb)]) for o in offsets]
    back = [b for b in range(args.local_blocks) if b not in set(local)][:n_blocks]
    movers = {"transfer_engine": RangeMover(agent, args.shm_dir, use_shm=False)}
    if kv.data.is_cuda:
        movers["pinned"] = RangeMover(None, args.shm_dir, device_memory=kv.device_bytes)
    else:
        movers["shm"] = RangeMover(None, args.shm_dir)
    for name, mover in movers.items():
        reps = args.reps if name != "transfer_engine" else 1
        far = time.time() + 600

        def put(per_layer: bool) -> None:
            plan = PutPlan(rb, keys, list(range(n_blocks)), replicas, [node], far)
            for items in store_calls(kv, local, per_layer):
                mover.write(plan, items)

        def get(per_layer: bool) -> None:
            plan = GetPlan(rb, keys, replicas, [node], far)
            for items in store_calls(kv, back, per_layer):
                mover.read(plan, items)

        row = {}
        for mode, per_layer in (("blocks", False), ("layers", True)):
            try:
                w = timed(torch.device(args.device), lambda: put(per_layer), reps)
                kv.data[torch.tensor(back, device=kv.data.device)] = 0
                r = timed(torch.device(args.device), lambda: get(per_layer), reps)
                got = checksum(flat.view(kv.num_blocks, -1), back)
                row[mode] = {"write_s": w, "write_gbps": nbytes / w / 1e9, "read_s": r,
                             "read_gbps": nbytes / r / 1e9, "equal": got == want,
                             "moved": mover.moved()}
            except Exception as exc:  # one path's failure must not hide the others
                row[mode] = {"error": repr(exc), "write_gbps": 0.0, "read_gbps": 0.0,
                             "equal": False}
        if name == "pinned":  # a stored prefix as a GPU prefill loads it layer-wise
            row["launched"] = launched_reads(args, kv, mover, node, keys, local, back, rb,
                                             want, reps)
        res["store"][name] = row
        mover.close()
    return res


def launched_reads(args: argparse.Namespace, kv: PagedKVMemory, mover: RangeMover,
                   node: NodeRef, keys: list[str], local: list[int], back: list[int],
                   rb: int, want: Any, reps: int) -> dict:
    """Every layer's read queued at once (``RangeMover.launch_reads``: 2D DMA into staging
    and a scatter per layer), from objects the store placed one after another (as it
    places one put's), into scattered blocks; timed until the lane confirms the last."""
    far = time.time() + 600
    slots = [Replicas([Location("bench", i * rb)]) for i in range(len(keys))]
    lane = ThreadPoolExecutor(1)
    try:
        mover.write(PutPlan(rb, keys, list(range(len(keys))), slots, [node], far),
                    store_calls(kv, local, False)[0])
        kv.data[torch.tensor(back, device=kv.data.device)] = 0

        def get() -> None:
            reads = mover.launch_reads(GetPlan(rb, keys, slots, [node], far),
                                       [b * kv.num_layers for b in back], 0, kv.layer_nbytes,
                                       kv.num_layers, lane)
            assert reads is not None, "launched reads refused"
            reads.done.result()
        r = timed(torch.device(args.device), get, reps)
        got = checksum(kv.data.view(-1).view(torch.uint8).view(kv.num_blocks, -1), back)
        nbytes = len(keys) * rb
        return {"read_s": r, "read_gbps": nbytes / r / 1e9, "equal": got == want}
    except Exception as exc:
        return {"error": repr(exc), "read_gbps": 0.0, "equal": False}
    finally:
        lane.shutdown()


def store_calls(kv: PagedKVMemory, blocks: list[int], per_layer: bool) -> list[list]:
    """The items of each store call moving ``blocks`` (object i ↔ block i): whole blocks in
    one call, or one call per layer as a layer-wise prefill makes them."""
    if not per_layer:
        return [[(i, kv.block_address(b), 0, kv.block_nbytes) for i, b in enumerate(blocks)]]
    ln = kv.layer_nbytes
    return [[(i, kv.layer_address(b, layer), layer * ln, ln) for i, b in enumerate(blocks)]
            for layer in range(kv.num_layers)]


def prefill_goals(path: Optional[str]) -> dict:
    """From benchmarks/prefill.py's JSON line: store-hit speedups (layer-wise, the default)
    at 4k and 16k, and the largest layer-wise / after-prefill TTFT ratio over lengths."""
    if not path:
        return {}
    lines = [ln for ln in open(path).read().splitlines() if ln.startswith("{")]
    if not lines:
        return {}
    data = json.loads(lines[-1])
    speed = {(r["tokens"], r["mode"]): r["speedup"] for r in data["c"]}
    ttft = {(r["tokens"], r["mode"]): r["ttft_s"] for r in data["a"]}
    ratios = [ttft[(n, "layerwise")] / ttft[(n, "after")] for n in sorted({n for n, _ in ttft})
              if ttft.get((n, "layerwise")) and ttft.get((n, "after"))]
    failed = sum(len(v) for v in data.get("failed", {}).values())
    return {"cached_16k_speedup": speed.get((16384, "layerwise")),
            "cached_4k_speedup": speed.get((4096, "layerwise")),
            "cached_16k_speedup_after": speed.get((16384, "after")),
            "cached_4k_speedup_after": speed.get((4096, "after")),
            "layerwise_over_after_max": max(ratios) if ratios else None,
            "layerwise_over_after": ratios, "prefill_failed_requests": failed}


def prefill_rows(path: Optional[str]) -> Optional[dict]:
    """benchmarks/prefill.py's medians (its JSON line less the samples), to keep with the
    goals drawn from them."""
    lines = [ln for ln in open(path).read().splitlines() if ln.startswith("{")] if path else []
    if not lines:
        return None
    data = json.loads(lines[-1])
    return {k: v for k, v in data.items() if k != "samples"}


def goals(res: dict) -> dict:
    fast = "cuda_ipc" if "cuda_ipc" in res["p2d"] else "transfer_engine"
    store = "pinned" if "pinned" in res["store"] else "shm"
    s = res["store"][store]["blocks"]
    return {"p2d_gbps": res["p2d"][fast]["blocks"]["gbps"],
            "p2d_layers_gbps": res["p2d"][fast]["layers"]["gbps"],
            "store_write_gbps": s["write_gbps"], "store_read_gbps": s["read_gbps"],
            "store_layers_write_gbps": res["store"][store]["layers"]["write_gbps"],
            "store_layers_read_gbps": res["store"][store]["layers"]["read_gbps"],
            "store_launched_read_gbps": res["store"][store].get("launched", {}).get("read_gbps"),
            "tcp_p2d_gbps": res["p2d"]["transfer_engine"]["blocks"]["gbps"],
            "tcp_store_write_gbps": res["store"]["transfer_engine"]["blocks"]["write_gbps"],
            "tcp_store_read_gbps": res["store"]["transfer_engine"]["blocks"]["read_gbps"],
            **prefill_goals(res.get("prefill_json"))}


def table(res: dict) -> str:
    rows = [f"{res['name']}: one prompt of {res['tokens']} tokens, "
            f"{res['bytes'] / 2**20:.0f} MiB of KV, scattered blocks both sides",
            "", "| prefill → decode | whole blocks GB/s | per layer GB/s | bytes equal |",
            "|---|---|---|---|"]
    rows += [f"| {name} | {v['blocks']['gbps']:.1f} | {v['layers']['gbps']:.1f} | "
             f"{v['blocks']['equal'] and v['layers']['equal']} |"
             for name, v in res["p2d"].items()]
    rows += ["", "| store | write GB/s (blocks / layers) | read GB/s (blocks / layers) | "
             "bytes equal |", "|---|---|---|---|"]
    rows += [f"| {name} | {v['blocks']['write_gbps']:.1f} / {v['layers']['write_gbps']:.1f} | "
             f"{v['blocks']['read_gbps']:.1f} / {v['layers']['read_gbps']:.1f} | "
             f"{v['blocks']['equal'] and v['layers']['equal']} |"
             for name, v in res["store"].items()]
    launched = res["store"].get("pinned", {}).get("launched")
    if launched is not None:
        rows.append(f"| pinned, every layer launched at once (2D DMA) | - | "
                    f"{launched['read_gbps']:.1f} | {launched['equal']} |")
    rows += ["", "goals: " + ", ".join(
        f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
        for k, v in res["goals"].items())]
    return "\n".join(rows)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--model", default="dummy-llama3-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--prefill", default=None, help="benchmarks/prefill.py's output (JSON line)")
    p.add_argument("--out", default=None, help="also write the JSON here")
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--merge", default=None, metavar="KV_JSON",
                   help="measure nothing: this run's JSON with --prefill's goals folded in")
    args = p.parse_args(argv)
    if args.merge:
        res = json.loads(open(args.merge).read().splitlines()[-1])
        res["prefill_json"] = args.prefill
        res["goals"] = goals(res)
        res["prefill"] = prefill_rows(args.prefill)
        return report(res, args.out)
    n = args.tokens // BLOCK
    args.local_blocks, args.peer_blocks = 2 * n + 64, n + 64
    c = DUMMY_CONFIGS[args.model]
    block_nbytes = (2 * c.num_layers * BLOCK * c.num_kv_heads * c.head_dim
                    * KV_DTYPES[args.dtype].itemsize)
    args.segment_bytes = (n + 64) * block_nbytes
    args.shm_dir = args.shm_dir if os.path.isdir(args.shm_dir) else tempfile.mkdtemp()
    started = datetime.now(timezone.utc)
    res = run(args)
    res["prefill_json"] = args.prefill
    res["name"] = (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else f"cpu ({os.cpu_count()} cores)")
    res["goals"] = goals(res)
    res |= {"bench": "kv_gpu", "started": started.isoformat(timespec="seconds"),
            "device": args.device, "model": args.model, "dtype": args.dtype}
    return report(res, args.out)


def report(res: dict, out: Optional[str]) -> int:
    print(table(res))
    line = json.dumps(res)
    print(line)
    if out:
        with open(out, "w") as f:
            f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
