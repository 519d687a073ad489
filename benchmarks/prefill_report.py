"""The pure parts of benchmarks/prefill.py: prompts, metric scrapes, per-part summaries and
tables (tested in tests/benchmarks/test_prefill_bench.py without a cluster)."""
from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from typing import Callable, Optional

from prometheus_client.parser import text_string_to_metric_families

VOCAB = 4096  # dummy-bench-prefill's
BLOCK = 16
CACHED_SHARE = 0.9
# (a)'s configurations: store on (the issue's), then store off (--breakdown: decode only)
MODES = ("layerwise", "after", "layerwise-nostore", "after-nostore")


@dataclass(frozen=True)
class Sample:
    """One request as the client and the conductor saw it."""

    tokens: int
    ttft_s: float
    compute_s: Optional[float]  # the prefill's compute share (PrefillDone.prefill_seconds)
    wait_s: Optional[float]  # time it was blocked on transfers (PrefillDone.wait_s)
    cpu_s: float  # CPU seconds of the prefill (or colocated) processes meanwhile
    cached: int  # usage.prompt_tokens_details.cached_tokens
    global_hit: Optional[int]  # of those, loaded from the store (conductor counter)
    instance: str
    # None: the conductor did not count this request's PrefillDone (it came too late)
    admit_s: Optional[float] = None  # the prefill worker's admission (PrefillDone.admit_s)
    accepted_s: Optional[float] = None  # the conductor's accept → KV on the decode worker
    request_id: Optional[str] = None  # the router's (its stages: benchmarks/timeline.py)


# --------------------------------------------------------------------------- pure helpers
def unique_prompt(rng: random.Random, n: int) -> list[int]:
    """``n`` random token ids (never special: 0-9 left out): two prompts practically never
    share a block (16 tokens of 4,086 values)."""
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def sibling(prompt: list[int], share: float, rng: random.Random) -> list[int]:
    """The first ``share`` of ``prompt`` followed by new random tokens, as long as it."""
    keep = int(len(prompt) * share)
    return prompt[:keep] + unique_prompt(rng, len(prompt) - keep)


def cacheable_tokens(prompt_len: int, share: float, block: int = BLOCK) -> int:
    """Tokens of a sibling's prefix held in whole blocks: what a store hit can cover."""
    return int(prompt_len * share) // block * block


def labelled(text: str, sample: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Prometheus text → {sorted label pairs: value} of one sample name (e.g. ``_sum``)."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def total(text: str, sample: str) -> float:
    return sum(labelled(text, sample).values())


def changed_label(before: str, after: str, sample: str, label: str) -> Optional[str]:
    """The value of ``label`` whose ``sample`` grew between two scrapes (one request)."""
    old = labelled(before, sample)
    for key, value in labelled(after, sample).items():
        if value > old.get(key, 0.0):
            return dict(key).get(label)
    return None


def reps_for(n: int, reps: int) -> int:
    """Requests per configuration at ``n`` tokens: more below 16k, where they are cheap
    and noisiest relative to their compute (8x at 1k, 2x at 4k: a 1k median of 6 moved by
    5-10 ms between two runs, which is 5-10 % of its compute)."""
    return reps * max(1, 16384 // n // 2)


def median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def difference(a: Optional[float], *bs: Optional[float]) -> Optional[float]:
    """``a`` minus every one of ``bs`` (None if any is missing)."""
    if a is None or any(b is None for b in bs):
        return None
    return a - sum(bs)  # type: ignore[arg-type]


def pct(a: Optional[float], b: Optional[float]) -> Optional[float]:
    r = ratio(a, b)
    return None if r is None else 100 * r


def fmt(v: Optional[float], spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def med(samples: list[Sample], n: int, field: str) -> Optional[float]:
    """Median of ``field`` over the samples of ``n`` tokens that have it."""
    return median([getattr(s, field) for s in samples
                   if s.tokens == n and getattr(s, field) is not None])


# --------------------------------------------------------------------------- parts
def part_a(res: dict[str, dict[str, list[Sample]]], lengths: list[int]) -> list[dict]:
    """Per length and mode run: medians of TTFT, the prefill's compute share and wait, and
    prefill CPU. Compute alone = the after-prefill prefill's compute share (no KV moves
    while it computes). Extra = TTFT − compute alone (also in % of it); CPU in % more than
    the after-prefill prefill's. The extra, roughly split (medians do not add exactly):
    ``on_core_s`` = own compute − compute alone (KV work on the compute core: copies,
    messages, the GIL) + ``wait_s`` (blocked on transfers) + ``outside_s`` = TTFT − own
    compute − wait (router, conductor, reservation, admission, first-token hops). Of the
    outside: ``admit_s``, the prefill worker's admission (store lookups, blocks, whole
    blocks read from the store), and ``around_s`` = TTFT − the conductor's accept → KV on
    the decode worker (the client, router and conductor before it, the first token's
    hops after)."""
    rows = []
    for n in lengths:
        alone = med(res["after"]["cold"], n, "compute_s")
        after_cpu = med(res["after"]["cold"], n, "cpu_s")
        for mode in [m for m in MODES if m in res]:
            cold = res[mode]["cold"]
            ttft, cpu = med(cold, n, "ttft_s"), med(cold, n, "cpu_s")
            extra = None if ttft is None or alone is None else ttft - alone
            compute, wait = med(cold, n, "compute_s"), med(cold, n, "wait_s")
            rows.append({"tokens": n, "mode": mode, "ttft_s": ttft, "compute_alone_s": alone,
                         "compute_s": compute, "wait_s": wait,
                         "on_core_s": difference(compute, alone),
                         "outside_s": difference(ttft, compute, wait),
                         "admit_s": med(cold, n, "admit_s"),
                         "around_s": difference(ttft, med(cold, n, "accepted_s")),
                         "cpu_s": cpu, "extra_s": extra, "extra_pct": pct(extra, alone),
                         "cpu_vs_after_pct": pct(None if cpu is None or after_cpu is None
                                                 else cpu - after_cpu, after_cpu)})
    return rows


def part_b(res: dict[str, dict[str, list[Sample]]], lengths: list[int]) -> list[dict]:
    """Per length: one worker's TTFT (the layer-wise cluster's cold prompts) vs a 2-stage
    group's, and the CPU both spent (the group's: both stages)."""
    rows = []
    for n in lengths:
        one = med(res["layerwise"]["cold"], n, "ttft_s")
        two = med(res["cpp2"]["cold"], n, "ttft_s")
        rows.append({"tokens": n, "one_worker_ttft_s": one, "two_stages_ttft_s": two,
                     "two_stages_head_compute_s": med(res["cpp2"]["cold"], n, "compute_s"),
                     "two_stages_head_wait_s": med(res["cpp2"]["cold"], n, "wait_s"),
                     "one_worker_cpu_s": med(res["layerwise"]["cold"], n, "cpu_s"),
                     "two_stages_cpu_s": med(res["cpp2"]["cold"], n, "cpu_s"),
                     "speedup": ratio(one, two)})
    return rows


def part_c(res: dict[str, dict[str, list[Sample]]], lengths: list[int]) -> list[dict]:
    """Per length and mode: cold P vs its 90 % sibling P' served from the store."""
    rows = []
    for n in lengths:
        for mode in ("layerwise", "after"):
            cold, warm = res[mode]["cold"], res[mode]["warm"]
            rows.append({"tokens": n, "mode": mode, "cold_ttft_s": med(cold, n, "ttft_s"),
                         "warm_ttft_s": med(warm, n, "ttft_s"),
                         "warm_wait_s": med(warm, n, "wait_s"),
                         "warm_compute_s": med(warm, n, "compute_s"),
                         "warm_admit_s": med(warm, n, "admit_s"),
                         "warm_around_s": difference(med(warm, n, "ttft_s"),
                                                     med(warm, n, "accepted_s")),
                         "cached": med(warm, n, "cached"), "global_hit": med(warm, n, "global_hit"),
                         "cacheable": cacheable_tokens(n, CACHED_SHARE),
                         "speedup": ratio(med(cold, n, "ttft_s"), med(warm, n, "ttft_s")),
                         "cpu_speedup": ratio(med(cold, n, "cpu_s"), med(warm, n, "cpu_s"))})
    return rows


def table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """Right-aligned columns ``(key, header, format spec)``; None prints as "-"."""
    body = [[h for _, h, _ in cols]] + [[fmt(r[k], f) if not isinstance(r[k], str) else r[k]
                                         for k, _, f in cols] for r in rows]
    widths = [max(len(line[i]) for line in body) for i in range(len(cols))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in body)


def goals(a: list[dict], b: list[dict], c: list[dict]) -> dict[str, Optional[float]]:
    """The issue's goals as numbers: the largest layer-wise extra (% of compute; goal
    <= 10) and after-prefill extra, the CPP speedup (goal >= 1.6), the smallest store-hit
    speedup of each mode (goal >= 5)."""
    def worst(rows: list[dict], key: str, pick: Callable[[list[float]], float],
              **match: str) -> Optional[float]:
        xs = [r[key] for r in rows if r[key] is not None
              and all(r.get(k) == v for k, v in match.items())]
        return pick(xs) if xs else None
    return {"a_layerwise_max_extra_pct": worst(a, "extra_pct", max, mode="layerwise"),
            "a_after_max_extra_pct": worst(a, "extra_pct", max, mode="after"),
            "b_min_speedup": worst(b, "speedup", min),
            "c_layerwise_min_speedup": worst(c, "speedup", min, mode="layerwise"),
            "c_after_min_speedup": worst(c, "speedup", min, mode="after")}
