"""Loader for Mooncake JSONL traces.

Each line: ``{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [...]}``, ``hash_ids`` being chained prefix-block ids of 512-token blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import orjson

TRACE_BLOCK_TOKENS = 512


@dataclass(frozen=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def default_trace_path(repo: Union[str, Path, None] = None) -> Path:
    """``<repo>/../shared/traces/synthetic_trace.jsonl`` (repo defaults to this checkout)."""
    root = Path(repo) if repo is not None else Path(__file__).resolve().parents[1]
    return root / ".." / "shared" / "traces" / "synthetic_trace.jsonl"


def load_trace(
    path: Union[str, Path],
    limit: Optional[int] = None,
    speed: float = 1.0,
) -> list[TraceRequest]:
    """Read a trace; ``limit`` keeps the first N requests, ``speed`` compresses time."""
    if speed <= 0:
        raise ValueError("speed must be positive")
    out: list[TraceRequest] = []
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            if limit is not None and len(out) >= limit:
                break
            row = orjson.loads(line)
            out.append(TraceRequest(
                index=len(out),
                arrival_s=float(row["timestamp"]) / 1000.0 / speed,
                input_length=int(row["input_length"]),
                output_length=int(row["output_length"]),
                hash_ids=tuple(int(h) for h in row["hash_ids"]),
            ))
    return out


def expand_block_keys(hash_ids: tuple[int, ...], block_size: int) -> list[tuple[int, int]]:
    """Map 512-token trace blocks to keys of ``block_size``-token blocks (512 % size == 0).

    Sub-block j of trace block h gets key (h, j); prefix sharing is preserved exactly.
    """
    if TRACE_BLOCK_TOKENS % block_size:
        raise ValueError("block_size must divide 512")
    per = TRACE_BLOCK_TOKENS // block_size
    return [(h, j) for h in hash_ids for j in range(per)]


def trace_stats(reqs: list[TraceRequest]) -> dict[str, float]:
    """Request count, duration, mean input/output, and the unbounded-cache block reuse."""
    seen: set[int] = set()
    reused = total = 0
    for r in reqs:
        for h in r.hash_ids:
            reused += h in seen
            seen.add(h)
        total += len(r.hash_ids)
    n = max(len(reqs), 1)
    return {
        "requests": float(len(reqs)),
        "duration_s": reqs[-1].arrival_s - reqs[0].arrival_s if reqs else 0.0,
        "mean_input": sum(r.input_length for r in reqs) / n,
        "mean_output": sum(r.output_length for r in reqs) / n,
        "reuse_unbounded": reused / max(total, 1),
    }
