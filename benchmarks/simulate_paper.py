"""Reproduce the Mooncake paper's simulator findings on a trace (default: the synthetic one).

Prints four tables (TTFT by policy, local vs global hit rate, overload rejections,
effective request capacity disaggregated vs colocated) and a last JSON line.
Cost model: the dummy LLaMA3-70B on 8xA800 profile (docs/simulator.md).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.scheduling import CostModel, SchedulerConfig  # noqa: E402
from traces.colocated import ColocatedConfig, simulate_colocated  # noqa: E402
from traces.loader import default_trace_path, load_trace  # noqa: E402
from traces.simulator import ClusterConfig, simulate_disaggregated  # noqa: E402

PROFILE = "llama3-70b-8xa800"
TTFT_SLO = 30.0
TBT_SLOS = (0.1, 0.2, 0.3)
NO_SLO = dict(ttft_slo_s=None, tbt_slo_s=None, admission="none")


class Clock:
    """Adds up the wall time the simulations themselves took."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def __call__(self, result):
        self.seconds += result.sim_seconds
        return result


def ttft_by_policy(trace, cost, clock: Clock) -> dict[str, float]:
    print("\n# Average TTFT by prefill policy (8P + 8D, no admission; paper: conversation, 16 nodes)")
    print(f"{'policy':20s} {'avg TTFT s':>10s} {'p90 s':>8s} {'hit local':>9s} {'hit global':>10s}")
    out = {}
    for name in ("random", "round_robin", "load_balance", "local_cache_aware", "kvcache_centric"):
        res = clock(simulate_disaggregated(trace, cost, name, SchedulerConfig(**NO_SLO),
                                           ClusterConfig(num_prefill=8, num_decode=8)))
        s = res.summary(TTFT_SLO, TBT_SLOS[0])
        out[name] = s["ttft_mean"]
        print(f"{name:20s} {s['ttft_mean']:10.2f} {s['ttft_p90']:8.2f} {s['hit_local']:9.3f} {s['hit_global']:10.3f}")
    return out


def hit_rates(trace, cost, clock: Clock) -> dict[str, float]:
    print("\n# Cache hit rate, 10 prefill instances x 3M tokens (paper synthetic: 26.5% -> 62.5%)")
    cluster = ClusterConfig(num_prefill=10, num_decode=6, prefill_cache_tokens=3_000_000)
    rows = {}
    for name in ("load_balance", "local_cache_aware", "kvcache_centric"):
        res = clock(simulate_disaggregated(trace, cost, name, SchedulerConfig(**NO_SLO), cluster))
        rows[name] = res.summary(TTFT_SLO, TBT_SLOS[0])
    print(f"local cache, cache-oblivious placement (load_balance):   {rows['load_balance']['hit_local']:.3f}")
    print(f"local cache, cache-aware placement (local_cache_aware):  {rows['local_cache_aware']['hit_local']:.3f}")
    print(f"global pool (kvcache_centric; local + fetched):          {rows['kvcache_centric']['hit_global']:.3f}")
    return {"hit_local": rows["load_balance"]["hit_local"],
            "hit_local_cache_aware": rows["local_cache_aware"]["hit_local"],
            "hit_global": rows["kvcache_centric"]["hit_global"]}


def overload(trace_path: Path, cost, clock: Clock) -> dict[str, float]:
    speed, cluster = 3.0, ClusterConfig(num_prefill=8, num_decode=1, decode_capacity_tokens=300_000)
    print(f"\n# Overload: trace at {speed:g}x, 8P + 1D with 300k decode KV tokens, TTFT 30 s "
          "(paper: 8P+8D, conversation 2x: 4183 / 3771 / 3589)")
    trace = load_trace(trace_path, speed=speed)
    print(f"{'admission':12s} {'rejected':>8s} {'at arrival':>10s} {'after prefill':>13s}")
    out = {}
    for mode in ("none", "early", "predicted"):
        cfg = SchedulerConfig(ttft_slo_s=TTFT_SLO, tbt_slo_s=TBT_SLOS[0], admission=mode)
        s = clock(simulate_disaggregated(trace, cost, "kvcache_centric", cfg, cluster)).summary(TTFT_SLO, TBT_SLOS[0])
        out[mode] = s["rejected"]
        print(f"{mode:12s} {int(s['rejected']):8d} {int(s['rejected_at_arrival']):10d} {int(s['rejected_after_prefill']):13d}")
    return {"rejected_baseline": out["none"], "rejected_early": out["early"],
            "rejected_predicted": out["predicted"]}


def capacity(trace_path: Path, cost, clock: Clock) -> dict[str, float]:
    speed = 2.0
    print(f"\n# Effective request capacity at {speed:g}x (share meeting TTFT 30 s and the TBT SLO), "
          "16 nodes each; best split / best chunk")
    trace = load_trace(trace_path, speed=speed)
    cfg = SchedulerConfig(**NO_SLO)
    disagg: dict[str, list[float]] = {}
    for p, d in ((8, 8), (10, 6), (12, 4)):
        res = clock(simulate_disaggregated(trace, cost, "kvcache_centric", cfg, ClusterConfig(p, d)))
        disagg[f"{p}P+{d}D"] = [res.summary(TTFT_SLO, t)["slo_attainment"] for t in TBT_SLOS]
    coloc: dict[str, list[float]] = {}
    for chunk in (512, 1024, 2048):
        res = clock(simulate_colocated(trace, cost, "local_cache_aware", cfg, ColocatedConfig(16, chunk)))
        coloc[f"chunk {chunk}"] = [res.summary(TTFT_SLO, t)["slo_attainment"] for t in TBT_SLOS]
    print(f"{'config':24s} " + " ".join(f"{int(t * 1000):>7d}ms" for t in TBT_SLOS))
    for label, rows in (("disagg", disagg), ("colocated", coloc)):
        for k, v in rows.items():
            print(f"{label + ' ' + k:24s} " + " ".join(f"{x:9.3f}" for x in v))
    out = {}
    for i, t in enumerate(TBT_SLOS):
        ms = int(round(t * 1000))
        out[f"capacity_disagg_{ms}ms"] = max(v[i] for v in disagg.values())
        out[f"capacity_colocated_{ms}ms"] = max(v[i] for v in coloc.values())
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", type=Path, default=default_trace_path())
    args = ap.parse_args(argv)
    if not args.trace.exists():
        print(f"trace not found: {args.trace}")
        return 2
    cost, clock = CostModel.profile(PROFILE), Clock()
    trace = load_trace(args.trace)
    ttft = ttft_by_policy(trace, cost, clock)
    result = {f"ttft_{k}": v for k, v in ttft.items() if k != "round_robin"}
    result["ttft_load_balance"] = ttft["load_balance"]
    result.update(hit_rates(trace, cost, clock))
    result.update(overload(args.trace, cost, clock))
    result.update(capacity(args.trace, cost, clock))
    result["sim_seconds"] = clock.seconds
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
