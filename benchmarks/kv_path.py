"""Prefill → decode KV path benchmark: shared memory vs the transfer engine vs memcpy.

``python benchmarks/kv_path.py`` (~1 minute). Two real processes: this one plays the
prefill worker (private paged KV, random contents), a child plays the decode worker (paged
KV in a /dev/shm segment, registered with its own transfer engine). Each round streams one
request's KV with the production ``KVStream``: SmolLM2-135M shapes (30 layers, 3 KV heads,
head_dim 64, block 16), a ~490-token prompt (31 blocks, scattered block ids on both sides),
layer by layer, in prefill chunks of 512 tokens (the default) and of 64. Per round, paths
interleaved:

- ``transfer_engine``: Mooncake transfer engine, TCP loopback into the child's engine;
- ``shm``: the decode segment mapped here, one job per layer, one memmove per piece
  (common/kv/shm_kv.py, what the prefill worker runs);
- ``shm_tensor``: the same mapping, two tensor ops per layer (index_select into a buffer,
  index_copy_ into the mapping): the alternative shm_kv.py does not use, for the record;
- ``shm_one_job``: the shm path's memmoves of all layers in one job (no pipelining): the
  copy alone; ``shm_one_job_hot``: the same with each layer's source just written (as
  after the engine computed it), copies timed only;
- ``memcpy``: one torch copy of the same number of bytes, contiguous, into the same
  mapping, on the same one-thread stream executor: the ceiling.

Every streamed request is checked byte for byte through the mapping. Reports median GB/s
(first write queued → last write done on the stream thread), ms per request (median and
best), CPU ms per request of both processes together (on a 2-core host the transfer
engine's cost is CPU the model would have used), and for the streams also the time until
``KVStream.wait`` returned (what the prefill worker sees: includes waking its event loop).
Prints a table, then one JSON line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.kv.memory import KV_DTYPES, PagedKVMemory  # noqa: E402
from common.kv.shm_kv import PeerKV, segment_path  # noqa: E402
from common.transfer import TransferAgent  # noqa: E402
from services.prefill.streaming import KVStream  # noqa: E402

SHAPE = dict(num_layers=30, block_size=16, num_kv_heads=3, head_dim=64)
PROMPT = 490
PATHS = ("transfer_engine", "shm", "shm_tensor", "shm_one_job", "shm_one_job_hot", "memcpy")


class TensorPeer:
    """``PeerKV`` with tensor copies: index_select into a reused buffer, index_copy_."""

    def __init__(self, peer: PeerKV, local: PagedKVMemory) -> None:
        self.peer, self.local = peer, local
        self.src = local.data.view(local.num_blocks * local.num_layers, -1)
        self.buf = torch.empty(0, dtype=local.dtype)

    def write_layer(self, local: list[int], remote: list[int], layer: int) -> int:
        torch.set_num_threads(1)
        nl = self.local.num_layers
        lo = torch.tensor(local) * nl + layer
        rm = torch.tensor(remote) * nl + layer
        n = len(local) * self.src.shape[1]
        if self.buf.numel() < n:
            self.buf = torch.empty(n, dtype=self.local.dtype)
        buf = self.buf[:n].view(len(local), -1)
        torch.index_select(self.src, 0, lo, out=buf)
        self.peer.rows.index_copy_(0, rm, buf)
        return n * buf.element_size()


def child(decode_blocks: int, dtype: str) -> None:
    """The decode side: shared KV memory + a transfer engine; lives until stdin closes."""
    kv = PagedKVMemory(decode_blocks, **SHAPE, dtype=KV_DTYPES[dtype],
                       shm_path=segment_path("bench-decode"))
    agent = TransferAgent()
    agent.register(kv.base_address, kv.nbytes)
    print(json.dumps({"session": agent.session_id, "base": kv.base_address,
                      "shm_path": kv.shm_path, "pid": os.getpid()}), flush=True)
    try:
        sys.stdin.read()
    finally:
        agent.close()
        kv.close()


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child",
             "--decode-blocks", str(args.decode_blocks), "--kv-dtype", args.kv_dtype],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("decode child did not start")
        self.remote = json.loads(line)
        self.kv = PagedKVMemory(args.prefill_blocks, **SHAPE, dtype=KV_DTYPES[args.kv_dtype])
        self.kv.data.copy_(torch.randn(self.kv.shape, generator=torch.Generator().manual_seed(1)))
        self.agent = TransferAgent()
        self.agent.register(self.kv.base_address, self.kv.nbytes)
        self.peer = PeerKV(self.remote["shm_path"], self.kv)
        self.tensor_peer = TensorPeer(self.peer, self.kv)
        self.loop = asyncio.new_event_loop()  # one loop, as in a worker
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kv-stream")
        self.pids = (os.getpid(), self.remote["pid"])
        self.rng = random.Random(7)
        self.waited: dict[str, list[float]] = {}

    def blocks(self) -> tuple[list[int], list[int]]:
        n = -(-PROMPT // SHAPE["block_size"])
        return (self.rng.sample(range(self.args.prefill_blocks), n),
                self.rng.sample(range(self.args.decode_blocks), n))

    def cpu(self) -> float:
        return sum(cpu_seconds(pid) for pid in self.pids)

    def stream(self, path: str, chunk: int) -> tuple[int, float, float]:
        """One request's KV over ``path``: bytes, seconds (first queued → last done) and
        CPU seconds of both processes meanwhile."""
        local, remote = self.blocks()
        shm = {"shm": self.peer, "shm_tensor": self.tensor_peer}.get(path)
        c0 = self.cpu()
        s = KVStream(self.agent, self.pool, self.kv, local, remote, self.remote["session"],
                     self.remote["base"], shm=shm)  # type: ignore[arg-type]
        t0 = time.perf_counter()
        for start in range(0, PROMPT, chunk):
            for layer in range(SHAPE["num_layers"]):
                s.on_layer(layer, start, min(start + chunk, PROMPT))
        last = self.pool.submit(time.perf_counter)  # FIFO: runs when every write is done
        nbytes = self.loop.run_until_complete(s.wait(30.0))
        cpu = self.cpu() - c0
        self.waited.setdefault(path, []).append(s.seconds)  # + waking the event loop
        seconds = last.result() - t0
        if not torch.equal(self.peer.blocks[remote], self.kv.data.view(self.kv.num_blocks, -1)[local]):
            raise AssertionError(f"{path}: the decode side does not hold the prefill's bytes")
        self.peer.blocks[remote] = 0  # the next round must write them again
        return nbytes, seconds, cpu

    def memcpy(self, nbytes: int) -> tuple[int, float, float]:
        """The same number of bytes, one contiguous torch copy on the stream thread."""
        elems = nbytes // self.kv.data.element_size()
        src = self.kv.data.view(-1)
        dst = self.peer.rows.view(-1)
        a = self.rng.randrange(0, src.numel() - elems)
        b = self.rng.randrange(0, dst.numel() - elems)

        def job() -> float:
            torch.set_num_threads(1)  # one thread, like the memmoves
            t = time.perf_counter()
            dst[b:b + elems].copy_(src[a:a + elems])
            return time.perf_counter() - t
        c0 = self.cpu()
        seconds = self.pool.submit(job).result()
        return nbytes, seconds, self.cpu() - c0

    def memcpy_pieces(self, hot: bool) -> tuple[int, float, float]:
        """The shm path's memmoves, every layer in one job: the copy alone, without
        layer-by-layer pipelining. ``hot``: each layer's source pieces are written just
        before they are copied, as the engine does right before ``on_layer``; only the
        copies are timed."""
        local, remote = self.blocks()
        idx = torch.tensor(local)

        def job() -> tuple[int, float]:
            n, seconds = 0, 0.0
            for layer in range(SHAPE["num_layers"]):
                if hot:
                    self.kv.data[idx, layer] = self.kv.data[idx, layer]
                t = time.perf_counter()
                n += self.peer.write_layer(local, remote, layer)
                seconds += time.perf_counter() - t
            return n, seconds
        c0 = self.cpu()
        nbytes, seconds = self.pool.submit(job).result()
        return nbytes, seconds, self.cpu() - c0

    def run(self, chunk: int) -> dict[str, dict[str, float]]:
        nbytes = self.stream("shm", chunk)[0]  # warm-up (maps, faults, thread)
        self.stream("transfer_engine", chunk)
        fns: dict[str, Callable[[], tuple[int, float, float]]] = {
            "transfer_engine": lambda: self.stream("transfer_engine", chunk),
            "shm": lambda: self.stream("shm", chunk),
            "shm_tensor": lambda: self.stream("shm_tensor", chunk),
            "shm_one_job": lambda: self.memcpy_pieces(hot=False),
            "shm_one_job_hot": lambda: self.memcpy_pieces(hot=True),
            "memcpy": lambda: self.memcpy(nbytes),
        }
        self.waited.clear()
        secs: dict[str, list[float]] = {p: [] for p in PATHS}
        cpu: dict[str, float] = {p: 0.0 for p in PATHS}
        for _ in range(self.args.rounds):
            for p in PATHS:
                n, sec, c = fns[p]()
                assert n == nbytes, (p, n, nbytes)
                secs[p].append(sec)
                cpu[p] += c
        out = {}
        for p in PATHS:
            med = statistics.median(secs[p])
            waited = self.waited.get(p)
            out[p] = {"gbps": nbytes / med / 1e9, "ms": med * 1e3, "min_ms": min(secs[p]) * 1e3,
                      "cpu_ms": cpu[p] / self.args.rounds * 1e3, "mb": nbytes / 1e6,
                      "wait_ms": statistics.median(waited) * 1e3 if waited else float("nan")}
        return out

    def close(self) -> None:
        self.loop.close()
        self.peer.close()
        self.pool.shutdown()
        self.agent.close()
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--kv-dtype", default="float32", choices=sorted(KV_DTYPES))
    ap.add_argument("--prefill-blocks", type=int, default=256)
    ap.add_argument("--decode-blocks", type=int, default=1024)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.decode_blocks, args.kv_dtype)
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    bench = Bench(args)
    try:
        results = {chunk: bench.run(chunk) for chunk in (512, 64)}
    finally:
        bench.close()
    print(f"KV prefill → decode, SmolLM2-135M shapes, {PROMPT}-token prompt, {args.kv_dtype}, "
          f"{args.rounds} rounds, torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs")
    print(f"load average before: {load0}")
    print(f"{'chunk':>6} {'path':<16}{'MB/req':>8}{'ms/req':>9}{'min ms':>8}{'GB/s':>8}"
          f"{'vs memcpy':>11}{'CPU ms/req':>12}{'wait() ms':>11}")
    summary: dict[str, float] = {}
    for chunk, res in results.items():
        for p in PATHS:
            r = res[p]
            ratio = res["memcpy"]["gbps"] / r["gbps"]
            print(f"{chunk:>6} {p:<16}{r['mb']:>8.1f}{r['ms']:>9.2f}{r['min_ms']:>8.2f}"
                  f"{r['gbps']:>8.2f}{ratio:>10.2f}x{r['cpu_ms']:>12.1f}{r['wait_ms']:>11.2f}")
            summary[f"c{chunk}_{p}_gbps"] = round(r["gbps"], 3)
            summary[f"c{chunk}_{p}_cpu_ms"] = round(r["cpu_ms"], 1)
        summary[f"c{chunk}_shm_vs_memcpy"] = round(res["memcpy"]["gbps"] / res["shm"]["gbps"], 2)
        summary[f"c{chunk}_shm_vs_te"] = round(res["shm"]["gbps"] / res["transfer_engine"]["gbps"], 2)
    summary["mb_per_request"] = round(results[512]["shm"]["mb"], 2)
    summary["load_average"] = os.getloadavg()[0]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
