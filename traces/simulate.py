"""``crescent simulate``: replay a Mooncake trace through the real scheduling policies."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

from common.scheduling import SCHEDULERS, CostModel, SchedulerConfig
from traces.colocated import ColocatedConfig, simulate_colocated
from traces.loader import default_trace_path, load_trace, trace_stats
from traces.metrics import SimResult, plot_results
from traces.simulator import DECODE_TIME_MODES, ClusterConfig, simulate_disaggregated


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="crescent simulate", description=__doc__)
    p.add_argument("--trace", type=Path, default=default_trace_path())
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--speed", type=float, default=1.0, help="replay speed-up")
    p.add_argument("--mode", choices=("disagg", "colocated"), default="disagg")
    p.add_argument("--scheduler", choices=sorted(SCHEDULERS), default="kvcache_centric")
    p.add_argument("--admission", choices=("none", "early", "predicted"), default="none")
    p.add_argument("--profile", default="llama3-70b-8xa800",
                   help="named cost profile or a coefficients JSON file")
    p.add_argument("--prefill", type=int, default=8, help="prefill instances (disagg)")
    p.add_argument("--decode", type=int, default=8, help="decode instances (disagg)")
    p.add_argument("--instances", type=int, default=16, help="instances (colocated)")
    p.add_argument("--chunk", type=int, default=512, help="chunked-prefill budget (colocated)")
    p.add_argument("--cache-tokens", type=int, default=3_000_000, help="per prefill instance")
    p.add_argument("--pool-tokens", type=int, default=None, help="global pool (default: sum)")
    p.add_argument("--decode-capacity-tokens", type=int, default=None)
    p.add_argument("--decode-max-batch", type=int, default=None,
                   help="fixed max batch per decode instance (default: KV memory only)")
    p.add_argument("--handoff", choices=("assigned", "any"), default="assigned",
                   help="after prefill: the decode instance chosen at arrival, or any with room")
    p.add_argument("--decode-time", choices=DECODE_TIME_MODES, default="empirical",
                   help="decode duration used by prediction-based admission")
    p.add_argument("--decode-slowdown", type=float, default=1.0,
                   help="decode steps this many times slower than the profile's")
    p.add_argument("--threshold", type=float, default=2.0, help="kvcache_balancing_threshold")
    p.add_argument("--ttft-slo", type=float, default=30.0)
    p.add_argument("--tbt-slo", type=float, default=0.1)
    p.add_argument("--no-slo-admission", action="store_true",
                   help="never reject at arrival (measure the raw distributions)")
    p.add_argument("--plot-dir", type=Path, default=None)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON line")
    return p


def run_from_args(args: argparse.Namespace) -> tuple[SimResult, dict[str, float]]:
    trace = load_trace(args.trace, limit=args.limit, speed=args.speed)
    cost = CostModel.profile(args.profile)
    if args.decode_slowdown != 1.0:
        cost = cost.with_decode_slowdown(args.decode_slowdown)
    admit = not args.no_slo_admission
    cfg = SchedulerConfig(
        kvcache_balancing_threshold=args.threshold,
        ttft_slo_s=args.ttft_slo if admit else None,
        tbt_slo_s=args.tbt_slo if admit else None,
        admission=args.admission,
    )
    if args.mode == "disagg":
        cluster = ClusterConfig(args.prefill, args.decode, args.cache_tokens, args.pool_tokens,
                                args.decode_capacity_tokens, args.decode_max_batch, args.handoff)
        res = simulate_disaggregated(trace, cost, args.scheduler, cfg, cluster, args.decode_time)
    else:
        col = ColocatedConfig(args.instances, args.chunk, args.decode_capacity_tokens)
        res = simulate_colocated(trace, cost, args.scheduler, cfg, col)
    return res, res.summary(args.ttft_slo, args.tbt_slo)


def format_summary(name: str, summary: dict[str, float]) -> str:
    lines = [f"== {name}"]
    for key, val in summary.items():
        lines.append(f"  {key:24s} {val:12.4f}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    if not args.trace.exists():
        print(f"trace not found: {args.trace}")
        return 2
    res, summary = run_from_args(args)
    summary["sim_seconds"] = res.sim_seconds
    if args.json:
        print(json.dumps({"name": res.name, **summary}))
    else:
        stats = trace_stats(load_trace(args.trace, limit=args.limit, speed=args.speed))
        print(f"trace {args.trace}: " + ", ".join(f"{k}={v:.3f}" for k, v in stats.items()))
        print(format_summary(res.name, summary))
    if args.plot_dir is not None:
        for path in plot_results([res], args.plot_dir, prefix=res.name.replace("/", "_")):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
