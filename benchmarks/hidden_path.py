"""Hidden states between pipeline stages: shared memory vs the transfer engine vs ZeroMQ.

``python benchmarks/hidden_path.py`` (~1 minute). One stage hands a ``[tokens, hidden]``
tensor (hidden 2048, float32 by default) to the next on the same host; sizes 64 KiB to
64 MiB. Per size and round, paths interleaved, each round timed from the send to the
receiver holding its own tensor:

- ``shm``: ``HiddenSender`` (mode "shm") memmoves into the receiver's ``HiddenInbox``
  file; ``HiddenInbox.read`` copies it out (services/prefill/hidden.py, what a stage runs);
- ``transfer_engine``: the same inbox, mode "transfer_engine": a copy into the sender's
  registered staging buffer, the Mooncake transfer engine over TCP loopback, the same read;
- ``shm_out``: the shm path reading into a tensor the receiver reuses (``read(out=)``),
  without the page faults of a fresh tensor;
- ``zmq``: the obvious alternative, the bytes inline in one message over a PUSH/PULL tcp
  socket on loopback (sent without a copy; the received frame is the tensor, no copy);
- ``clone``: one ``torch.clone`` of the tensor: the floor of any path that copies once.

Both ends live in this process (two transfer engines, two sockets, the file mapped twice),
so the numbers are the paths' own cost, not a scheduler's; every received tensor is
checked bit for bit. Prints median ms and GB/s per size and path, the ratios to shm and
the fastest path per size, then one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import zmq

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from common.host import host_id  # noqa: E402
from services.prefill.hidden import HiddenInbox, HiddenSender  # noqa: E402
from common.transfer import TransferAgent  # noqa: E402

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "4MiB": 4 << 20, "16MiB": 16 << 20,
         "64MiB": 64 << 20}
PATHS = ("shm", "transfer_engine", "zmq", "shm_out", "clone")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
SLOTS = 2


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.dtype = DTYPES[args.dtype]
        self.hidden = args.hidden
        self.sender_agent, self.receiver_agent = TransferAgent(), TransferAgent()
        self.inbox = HiddenInbox(self.receiver_agent, "bench", SLOTS, max(SIZES.values()))
        route = self.inbox.route
        self.senders = {p: HiddenSender(self.sender_agent, route, p, host_id())
                        for p in ("shm", "transfer_engine")}
        assert [s.path for s in self.senders.values()] == ["shm", "transfer_engine"]
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        port = self.pull.bind_to_random_port("tcp://127.0.0.1")
        self.push = self.ctx.socket(zmq.PUSH)
        for sock in (self.pull, self.push):
            sock.setsockopt(zmq.LINGER, 0)
        self.push.connect(f"tcp://127.0.0.1:{port}")
        self.slot = 0
        self.out = torch.zeros(max(SIZES.values()) // (self.hidden * self.dtype.itemsize),
                               self.hidden, dtype=self.dtype)  # faulted in once

    def one(self, path: str, x: torch.Tensor) -> tuple[float, torch.Tensor]:
        """Seconds from the send to the receiver holding its tensor, and that tensor."""
        tokens = x.shape[0]
        self.slot = (self.slot + 1) % SLOTS
        t0 = time.perf_counter()
        if path == "zmq":
            self.push.send(x.view(torch.uint8).numpy(), copy=False)
            frame = self.pull.recv(copy=False)
            y = torch.frombuffer(frame.buffer, dtype=self.dtype).view(tokens, self.hidden)
        elif path == "clone":
            y = x.clone()
        else:
            self.senders[path.removesuffix("_out")].send(self.slot, x, timeout_s=30)
            out = self.out[:tokens] if path == "shm_out" else None
            y = self.inbox.read(self.slot, tokens, self.hidden, self.dtype, out=out)
        return time.perf_counter() - t0, y

    def run(self, nbytes: int, rounds: int) -> dict[str, list[float]]:
        tokens = nbytes // (self.hidden * self.dtype.itemsize)
        gen = torch.Generator().manual_seed(nbytes)
        secs: dict[str, list[float]] = {p: [] for p in PATHS}
        for r in range(rounds + 1):  # round 0 warms up (faults, staging, connections)
            x = torch.randn(tokens, self.hidden, generator=gen).to(self.dtype)
            for p in PATHS:
                sec, y = self.one(p, x)
                if not torch.equal(y.view(torch.uint8), x.view(torch.uint8)):
                    raise AssertionError(f"{p}: the receiver does not hold the sent bytes")
                if r:
                    secs[p].append(sec)
        return secs

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
        self.inbox.close()
        self.push.close()
        self.pull.close()
        self.ctx.term()
        self.sender_agent.close()
        self.receiver_agent.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (1: a stage owns one core; 2 stalls on a busy host)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load0 = " ".join(f"{x:.2f}" for x in os.getloadavg())
    bench = Bench(args)
    try:
        results = {name: bench.run(n, args.rounds) for name, n in SIZES.items()}
    finally:
        bench.close()
    print(f"hidden states stage → stage, one host, [tokens, {args.hidden}] {args.dtype}, "
          f"median of {args.rounds} rounds, torch threads {torch.get_num_threads()}, "
          f"{os.cpu_count()} CPUs; load average before: {load0}")
    print(f"{'size':>6} {'path':<16}{'ms':>9}{'min ms':>9}{'GB/s':>8}{'vs shm':>8}")
    summary: dict[str, object] = {}
    for name, secs in results.items():
        med = {p: statistics.median(secs[p]) for p in PATHS}
        for p in PATHS:
            print(f"{name:>6} {p:<16}{med[p] * 1e3:>9.3f}{min(secs[p]) * 1e3:>9.3f}"
                  f"{SIZES[name] / med[p] / 1e9:>8.2f}{med[p] / med['shm']:>7.2f}x")
            summary[f"{name}_{p}_ms"] = round(med[p] * 1e3, 3)
        fastest = min(("shm", "transfer_engine", "zmq"), key=med.__getitem__)
        print(f"{'':>6} fastest: {fastest}")
        summary[f"{name}_te_vs_shm"] = round(med["transfer_engine"] / med["shm"], 2)
        summary[f"{name}_zmq_vs_shm"] = round(med["zmq"] / med["shm"], 2)
        summary[f"{name}_fastest"] = fastest
    summary["load_average"] = os.getloadavg()[0]
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
