"""benchmarks/gpu.py runs here too (the CPU, a tiny dummy), so the script a lent GPU
machine runs is not first tried there: its table, its JSON line, bytes that arrive equal."""
from __future__ import annotations

import json

import pytest

from benchmarks import gpu


def test_gpu_bench_runs_on_the_cpu(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu.main(["--device", "cpu", "--model", "dummy-tiny", "--dtype", "float32",
                     "--quick", "--chunks", "64,256", "--reps", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    res = json.loads(out[-1])
    assert set(res["prefill"]) == {"256/64", "256/256", "1024/64", "1024/256"}
    assert all(v["s"] > 0 for v in res["prefill"].values())
    assert set(res["decode"]) == {"1", "8"}
    assert res["kv"]["bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # layers, K and V, KV heads, head dim, float32
    assert res["kv"]["transfer"]["host"]["bytes_equal"]
    assert res["pieces"]["host -> host"]["bytes_equal"]
    assert any(line.startswith("| decode batch") for line in out)
