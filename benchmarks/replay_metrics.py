"""Pure pieces of the live replay benchmark: trace scaling, per-request records, metrics.

Nothing here starts a process or touches the network, so every number the benchmark
prints can be checked in-process (tests/benchmarks/test_replay_metrics.py).

Trace scaling. The Mooncake trace counts 512-token blocks of 15k-token prompts; a 135M
model on two CPU cores serves ~500-token prompts. Dividing every length by 32 turns a
512-token block into a 16-token block (the cluster's ``block_size``) and keeps the
``hash_ids`` unchanged, so prefix sharing survives exactly: AIPerf rebuilds each prompt
from one 16-token text block per hash id (``--isl-block-size 16``).
"""
from __future__ import annotations

import json
import math
import random
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence

from traces.metrics import tail_tbt

TRACE_BLOCK_TOKENS = 512


# --------------------------------------------------------------------------- trace
def scaled_input_length(input_length: int, n_blocks: int, block_tokens: int) -> int:
    """``input_length`` scaled by ``block_tokens / 512``, kept consistent with the
    blocks: ``ceil(result / block_tokens) == n_blocks`` (the last block is partial)."""
    if n_blocks < 1:
        raise ValueError("a trace request needs at least one hash id")
    scaled = round(input_length * block_tokens / TRACE_BLOCK_TOKENS)
    return min(n_blocks * block_tokens, max((n_blocks - 1) * block_tokens + 1, scaled))


def conversation_slice(rows: Sequence[dict], n: int) -> list[dict]:
    """The first ``n`` requests, in trace order, of the conversations that start first.

    A conversation is the set of requests sharing a first block (``hash_ids[0]``): the
    trace's later turns re-send the earlier ones as prefix. A plain window of consecutive
    requests shares almost nothing (Poisson arrivals interleave ~2,000 conversations);
    taking whole conversations keeps the reuse that the trace has over its full length.
    """
    if n < 1:
        raise ValueError("need at least one request")
    members: dict[int, list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        members[row["hash_ids"][0]].append(i)
    chosen: list[int] = []
    for i, row in enumerate(rows):
        if len(chosen) >= n:
            break
        group = members[row["hash_ids"][0]]
        if group[0] == i:
            chosen += group
    return [rows[i] for i in sorted(chosen)[:n]]


def poisson_arrivals_ms(n: int, rate: float, seed: int) -> list[int]:
    """``n`` Poisson arrival times (ms, the first at 0) at ``rate`` requests/s."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(round(t * 1000))
    return out


def stretched_arrivals_ms(timestamps_ms: Sequence[float], rate: float) -> list[int]:
    """The trace's own arrival pattern, stretched so ``n`` requests span ``(n-1)/rate`` s."""
    if rate <= 0:
        raise ValueError("rate must be positive")
    t0, span = timestamps_ms[0], timestamps_ms[-1] - timestamps_ms[0]
    target = (len(timestamps_ms) - 1) / rate * 1000
    if span <= 0:
        return [0] * len(timestamps_ms)
    return [round((t - t0) * target / span) for t in timestamps_ms]


def scale_trace(rows: Sequence[dict], rate: float, seed: int, block_tokens: int = 16,
                max_output: int = 80, arrivals: str = "poisson") -> list[dict]:
    """Mooncake rows → rows AIPerf replays with ``--isl-block-size block_tokens``."""
    if arrivals == "poisson":
        times = poisson_arrivals_ms(len(rows), rate, seed)
    elif arrivals == "trace":
        times = stretched_arrivals_ms([r["timestamp"] for r in rows], rate)
    else:
        raise ValueError(f"arrivals must be 'poisson' or 'trace', got {arrivals!r}")
    out = []
    for row, t in zip(rows, times):
        ids = list(row["hash_ids"])
        out.append({"timestamp": t,
                    "input_length": scaled_input_length(row["input_length"], len(ids),
                                                        block_tokens),
                    "output_length": max(1, min(int(row["output_length"]), max_output)),
                    "hash_ids": ids})
    return out


def slice_stats(rows: Sequence[dict]) -> dict[str, float]:
    """Mean input/output length and the share of prompt blocks seen earlier in the slice
    (what an unbounded prefix cache could reuse)."""
    seen: set[int] = set()
    reused = total = 0
    for row in rows:
        for h in row["hash_ids"]:
            reused += h in seen
            seen.add(h)
        total += len(row["hash_ids"])
    n = max(len(rows), 1)
    return {"requests": len(rows),
            "mean_input": sum(r["input_length"] for r in rows) / n,
            "mean_output": sum(r["output_length"] for r in rows) / n,
            "block_reuse": reused / total if total else 0.0,
            "duration_s": (rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000 if rows else 0.0}


# --------------------------------------------------------------------------- records
@dataclass(frozen=True)
class RequestResult:
    """One request as AIPerf saw it. Times in seconds; ``error_code`` None on success."""

    ttft_s: Optional[float] = None
    e2e_s: Optional[float] = None
    itl_s: Optional[float] = None
    gaps_s: tuple[float, ...] = ()
    output_tokens: int = 0  # AIPerf's count: the streamed text, tokenized again
    generated_tokens: Optional[int] = None  # the server's count (usage.completion_tokens)
    error_code: Optional[int] = None
    error: str = ""
    start_s: Optional[float] = None  # wall clock (AIPerf's request_start_ns), if known
    end_s: Optional[float] = None

    @property
    def ok(self) -> bool:
        return self.error_code is None and not self.error and self.ttft_s is not None

    @property
    def tbt_s(self) -> float:
        return tail_tbt(self.gaps_s)


def _seconds(metrics: dict, name: str) -> Optional[float]:
    m = metrics.get(name)
    if m is None:
        return None
    scale = {"ms": 1e-3, "ns": 1e-9, "s": 1.0, "sec": 1.0}.get(m.get("unit", "ms"))
    if scale is None:
        raise ValueError(f"{name}: unknown unit {m.get('unit')!r}")
    value = m["value"]
    if isinstance(value, list):
        return None
    return float(value) * scale


def parse_record(rec: dict[str, Any]) -> RequestResult:
    """One line of AIPerf's ``profile_export.jsonl`` (``--export-level records``)."""
    metrics = rec.get("metrics") or {}
    meta = rec.get("metadata") or {}
    when = {f"{k}_s": meta[f"request_{k}_ns"] * 1e-9 for k in ("start", "end")
            if meta.get(f"request_{k}_ns") is not None}
    err = rec.get("error")
    if err:
        code = err.get("code")
        return RequestResult(error_code=int(code) if code is not None else -1,
                             error=str(err.get("type") or err.get("message") or "error"),
                             **when)
    gaps = metrics.get("inter_chunk_latency", {})
    scale = 1e-3 if gaps.get("unit", "ms") == "ms" else 1.0
    out = metrics.get("output_token_count") or metrics.get("output_sequence_length") or {}
    usage = metrics.get("usage_completion_tokens") or {}
    return RequestResult(ttft_s=_seconds(metrics, "time_to_first_token"),
                         e2e_s=_seconds(metrics, "request_latency"),
                         itl_s=_seconds(metrics, "inter_token_latency"),
                         gaps_s=tuple(float(g) * scale for g in gaps.get("value", [])),
                         output_tokens=int(out.get("value", 0)),
                         generated_tokens=int(usage["value"]) if "value" in usage else None,
                         **when)


# --------------------------------------------------------------------------- metrics
def percentile(xs: Iterable[float], q: float) -> Optional[float]:
    """The ``q``-th percentile (0..100), linear between order statistics (numpy's
    default); None for no data."""
    s = sorted(xs)
    if not s:
        return None
    if not 0 <= q <= 100:
        raise ValueError("q must be in [0, 100]")
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def goodput(results: Sequence[RequestResult], ttft_slo_s: float, tbt_slo_s: float) -> int:
    """Requests that succeeded with TTFT <= ``ttft_slo_s`` and TBT <= ``tbt_slo_s``."""
    return sum(1 for r in results
               if r.ok and r.ttft_s <= ttft_slo_s and r.tbt_s <= tbt_slo_s)


def output_throughput(results: Sequence[RequestResult],
                      server_count: bool = False) -> Optional[float]:
    """Output tokens of the completed requests per second of the replay: from the first
    request's start to the last one's end (every request, failed ones included); None
    without AIPerf's timestamps. AIPerf counts a request's tokens by tokenizing its text
    again, which gives fewer than were generated wherever the sampled tokens are not the
    text's own tokenization (1-3 % of a sampled answer, in different measure for
    different servers' samples); ``server_count`` counts what the server says it
    generated (None where a completed request lacks it)."""
    starts = [r.start_s for r in results if r.start_s is not None]
    ends = [r.end_s for r in results if r.end_s is not None]
    if not starts or not ends or max(ends) <= min(starts):
        return None
    ok = [r for r in results if r.ok]
    if server_count and any(r.generated_tokens is None for r in ok):
        return None
    tokens = sum((r.generated_tokens or 0) if server_count else r.output_tokens for r in ok)
    return tokens / (max(ends) - min(starts))


@dataclass
class Summary:
    """The benchmark's row for one (configuration, rate)."""

    requests: int
    completed: int
    rejected_429: int
    errors: int
    goodput: int
    values: dict[str, Optional[float]] = field(default_factory=dict)
    error_kinds: dict[str, int] = field(default_factory=dict)  # "429", "500", or a type

    def to_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "completed": self.completed,
                "rejected_429": self.rejected_429, "errors": self.errors,
                "goodput": self.goodput, **self.values, "error_kinds": self.error_kinds}


def summarize(results: Sequence[RequestResult], ttft_slo_s: float,
              tbt_slo_s: float) -> Summary:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    itl = [r.itl_s for r in ok if r.itl_s is not None]
    tbt = [r.tbt_s for r in ok if r.gaps_s]
    values: dict[str, Optional[float]] = {}
    for name, xs in (("ttft", ttft), ("e2e", e2e), ("tbt", tbt)):
        for q in (50, 90, 99):
            values[f"{name}_p{q}_s"] = percentile(xs, q)
    values["itl_mean_s"] = sum(itl) / len(itl) if itl else None
    values["itl_p50_s"] = percentile(itl, 50)
    values["output_tokens_mean"] = (sum(r.output_tokens for r in ok) / len(ok)) if ok else None
    values["output_tokens_per_s"] = output_throughput(results)
    values["generated_tokens_per_s"] = output_throughput(results, server_count=True)
    n429 = sum(1 for r in results if r.error_code == 429)
    kinds = Counter(str(r.error_code) if r.error_code not in (None, -1) else r.error
                    for r in results if not r.ok)
    return Summary(requests=len(results), completed=len(ok), rejected_429=n429,
                   errors=len(results) - len(ok) - n429,
                   goodput=goodput(results, ttft_slo_s, tbt_slo_s), values=values,
                   error_kinds=dict(sorted(kinds.items())))


# --------------------------------------------------------------------------- /metrics
def metric_totals(text: str) -> dict[str, float]:
    """Prometheus text → {sample name: value summed over label sets}."""
    totals: Counter[str] = Counter()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            totals[name] += float(value)
        except ValueError:
            continue
    return dict(totals)


def ratio(num: Optional[float], den: Optional[float]) -> Optional[float]:
    return num / den if num is not None and den else None


# --------------------------------------------------------------------------- profiles
_LINE_NO = re.compile(r":\d+\)$")


def server_side(router: str, conductor: str) -> dict[str, Optional[float]]:
    """Prefix hits, predicted vs actual TTFT and KV transfer times from /metrics."""
    r, c = metric_totals(router), metric_totals(conductor)
    pred = ratio(c.get("crescent_conductor_predicted_ttft_seconds_sum"),
                 c.get("crescent_conductor_predicted_ttft_seconds_count"))
    actual = ratio(c.get("crescent_conductor_actual_prefill_ttft_seconds_sum"),
                   c.get("crescent_conductor_actual_prefill_ttft_seconds_count"))
    return {
        "prefix_hit": ratio(r.get("crescent_router_cached_prompt_tokens_total"),
                            r.get("crescent_router_prompt_tokens_total")),
        "global_hit": ratio(c.get("crescent_global_cache_hit_tokens_total"),
                            c.get("crescent_prompt_tokens_total")),
        "pred_ttft_mean_s": pred, "actual_prefill_ttft_mean_s": actual,
        # Per-request predictions are not exposed; this is the error of the means.
        "pred_ttft_rel_err_of_means": ratio(pred - actual, actual)
        if pred is not None and actual else None,
        "kv_transfer_mean_s": ratio(c.get("crescent_conductor_kv_transfer_seconds_sum"),
                                    c.get("crescent_conductor_kv_transfer_seconds_count")),
    }


def prediction_errors(debug_ttft: str) -> dict[str, Optional[float]]:
    """Per-request predicted vs actual TTFT from the conductor's /debug/ttft: the median
    relative error (predicted − actual) / actual, the median and the 90th percentile of
    its absolute value, and the share of requests predicted within 25 %. "Actual" is
    accept → KV on the decode worker."""
    names = {"pred_median_rel_err": "median_rel_error",
             "pred_median_abs_rel_err": "median_abs_rel_error",
             "pred_p90_abs_rel_err": "p90_abs_rel_error", "pred_within_25pct": "within_25pct"}
    try:
        summary = json.loads(debug_ttft)["summary"]
    except (ValueError, KeyError, TypeError):
        summary = {}
    return {ours: summary.get(theirs) for ours, theirs in names.items()}


def top_self_functions(collapsed: str, k: int = 10,
                       within: Sequence[str] = ()) -> list[tuple[str, float]]:
    """Collapsed stacks (py-spy ``--format raw``: ``frame;frame;leaf count``) → the ``k``
    leaf functions with the largest share of samples, largest first (ties by name).

    A frame ``func (file.py:12)`` counts as ``func (file.py)``: lines of one function add
    up. With ``within`` (path fragments), a stack counts for its deepest frame whose text
    contains one of them (where our code spends the time, library calls included), or for
    ``(elsewhere)`` when none does.
    """
    leaves: Counter[str] = Counter()
    total = 0
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if within:
            frames = [f for f in frames if any(w in f for w in within)] or ["(elsewhere)"]
        leaves[_LINE_NO.sub(")", frames[-1])] += int(count)
        total += int(count)
    ranked = sorted(leaves.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
    return [(name, n / total) for name, n in ranked]
