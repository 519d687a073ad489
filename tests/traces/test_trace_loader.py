"""Trace loader: the shared synthetic trace (skipped when absent) and a hand-written one."""
from __future__ import annotations

import math
from pathlib import Path

import pytest

from traces.loader import expand_block_keys, load_trace, trace_stats

REPO = Path(__file__).resolve().parents[2]
TRACE = Path(REPO) / ".." / "shared" / "traces" / "synthetic_trace.jsonl"


def test_handwritten_trace(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}\n\n'
                    '{"timestamp": 2000, "input_length": 512, "output_length": 1, "hash_ids": [0]}\n')
    reqs = load_trace(path, speed=2.0)
    assert [(r.index, r.arrival_s, r.hash_ids) for r in reqs] == [(0, 0.0, (0, 1)), (1, 1.0, (0,))]
    assert trace_stats(reqs)["reuse_unbounded"] == pytest.approx(1 / 3)
    assert len(load_trace(path, limit=1)) == 1


def test_expand_block_keys() -> None:
    assert expand_block_keys((7, 9), 256) == [(7, 0), (7, 1), (9, 0), (9, 1)]
    with pytest.raises(ValueError):
        expand_block_keys((1,), 300)


@pytest.mark.skipif(not TRACE.exists(), reason="shared synthetic trace absent")
def test_synthetic_trace_subset() -> None:
    reqs = load_trace(TRACE, limit=200)
    assert len(reqs) == 200
    assert reqs[0].input_length == 40160 and reqs[0].hash_ids[:3] == (0, 1, 2)
    assert all(len(r.hash_ids) == math.ceil(r.input_length / 512) for r in reqs)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
