"""The prefill benchmark's pure parts (benchmarks/prefill_report.py, prefill.py's argument
checks), against hand-computed values; no cluster."""
from __future__ import annotations

import random
from typing import Optional

import pytest

from benchmarks.prefill import describe, parse_args, store_mb_needed
from benchmarks.prefill_report import (
    Sample, cacheable_tokens, changed_label, goals, labelled, part_a, part_b, part_c,
    reps_for, sibling, table, total, unique_prompt,
)

BEFORE = """# TYPE crescent_prefill_compute_seconds histogram
crescent_prefill_compute_seconds_bucket{instance="prefill-0",le="+Inf"} 2.0
crescent_prefill_compute_seconds_count{instance="prefill-0"} 2.0
crescent_prefill_compute_seconds_sum{instance="prefill-0"} 1.5
# TYPE crescent_conductor_placed counter
crescent_conductor_placed_total{decode="decode-0",prefill="prefill-0"} 2.0
"""
AFTER = """# TYPE crescent_prefill_compute_seconds histogram
crescent_prefill_compute_seconds_bucket{instance="prefill-0",le="+Inf"} 2.0
crescent_prefill_compute_seconds_count{instance="prefill-0"} 2.0
crescent_prefill_compute_seconds_sum{instance="prefill-0"} 1.5
crescent_prefill_compute_seconds_bucket{instance="prefill-1",le="+Inf"} 1.0
crescent_prefill_compute_seconds_count{instance="prefill-1"} 1.0
crescent_prefill_compute_seconds_sum{instance="prefill-1"} 0.25
# TYPE crescent_conductor_placed counter
crescent_conductor_placed_total{decode="decode-0",prefill="prefill-0"} 2.0
crescent_conductor_placed_total{decode="decode-0",prefill="prefill-1"} 1.0
"""


def s(tokens: int, ttft: float, compute: Optional[float] = 0.0, cpu: float = 0.0, cached: int = 0,
      instance: str = "prefill-0") -> Sample:
    return Sample(tokens, ttft, compute, 0.0, cpu, cached, cached, instance)


def test_prompts_are_reproducible_and_in_range():
    a, b = unique_prompt(random.Random(3), 100), unique_prompt(random.Random(3), 100)
    assert a == b and len(a) == 100 and all(10 <= t < 4096 for t in a)


def test_sibling_keeps_90_percent_and_the_length():
    p = unique_prompt(random.Random(0), 1000)
    q = sibling(p, 0.9, random.Random(1))
    assert len(q) == 1000 and q[:900] == p[:900] and q[900:] != p[900:]


def test_cacheable_tokens_are_whole_blocks():
    assert cacheable_tokens(2048, 0.9) == 1840   # 1843 → 115 blocks
    assert cacheable_tokens(4096, 0.9) == 3680   # 3686 → 230 blocks
    assert cacheable_tokens(16384, 0.9) == 14736  # 14745 → 921 blocks
    assert cacheable_tokens(15, 0.9) == 0


def test_metric_scrapes():
    assert labelled(AFTER, "crescent_prefill_compute_seconds_sum") == {
        (("instance", "prefill-0"),): 1.5, (("instance", "prefill-1"),): 0.25}
    assert total(AFTER, "crescent_prefill_compute_seconds_sum") - total(
        BEFORE, "crescent_prefill_compute_seconds_sum") == 0.25
    assert total(BEFORE, "no_such_metric") == 0
    assert changed_label(BEFORE, AFTER, "crescent_conductor_placed_total", "prefill") == "prefill-1"
    assert changed_label(BEFORE, BEFORE, "crescent_conductor_placed_total", "prefill") is None


def test_more_reps_below_16k():
    assert [reps_for(n, 3) for n in (512, 1024, 2048, 4096, 8192, 16384, 32768)] == [
        48, 24, 12, 6, 3, 3, 3]


RES = {
    "layerwise": {"cold": [s(1024, 0.21, 0.15, 0.3), s(1024, 0.5, None, 0.5),
                           s(1024, 0.23, 0.14, 0.4)],
                  "warm": [s(1024, 0.023, cpu=0.1, cached=912, instance="prefill-1")]},
    "after": {"cold": [s(1024, 0.25, 0.10, 0.2), s(1024, 0.24, 0.30, 0.3),
                       s(1024, 0.30, 0.20, 0.25)],
              "warm": [s(1024, 0.05, cpu=0.1, cached=912, instance="prefill-1")]},
    "cpp2": {"cold": [s(1024, 0.115, 0.05, 0.4)], "warm": []},
}


def test_part_a_extra_over_the_after_prefill_compute():
    rows = {r["mode"]: r for r in part_a(RES, [1024])}
    assert set(rows) == {"layerwise", "after"}  # no --breakdown clusters
    lw, after = rows["layerwise"], rows["after"]
    assert lw["compute_alone_s"] == after["compute_alone_s"] == 0.20
    assert lw["ttft_s"] == 0.23
    assert round(lw["compute_s"], 9) == 0.145  # the sample without one is left out
    assert round(lw["extra_s"], 9) == 0.03 and round(lw["extra_pct"], 6) == 15.0
    assert round(after["extra_s"], 9) == 0.05 and round(after["extra_pct"], 6) == 25.0
    assert round(lw["cpu_vs_after_pct"], 6) == 60.0 and after["cpu_vs_after_pct"] == 0.0
    # the split: own compute over compute alone, and the rest outside compute and wait
    assert round(lw["on_core_s"], 9) == -0.055 and after["on_core_s"] == 0.0
    assert round(lw["outside_s"], 9) == 0.085 and round(after["outside_s"], 9) == 0.05


def test_part_b_and_c_ratios_and_goals():
    (b,) = part_b(RES, [1024])
    assert round(b["speedup"], 9) == 2.0 and b["two_stages_cpu_s"] == 0.4
    c = {r["mode"]: r for r in part_c(RES, [1024])}
    assert round(c["layerwise"]["speedup"], 9) == 10.0 and c["layerwise"]["cached"] == 912
    assert c["layerwise"]["cacheable"] == 912 and round(c["after"]["speedup"], 9) == 5.0
    g = goals(part_a(RES, [1024]), [b], list(c.values()))
    assert round(g["a_layerwise_max_extra_pct"], 6) == 15.0
    assert round(g["a_after_max_extra_pct"], 6) == 25.0
    assert round(g["b_min_speedup"], 9) == 2.0
    assert round(g["c_layerwise_min_speedup"], 9) == 10.0
    assert round(g["c_after_min_speedup"], 9) == 5.0


def test_empty_cells_print_as_dashes():
    rows = part_c({"layerwise": {"cold": [], "warm": []}, "after": {"cold": [], "warm": []}},
                  [4096])
    assert rows[0]["speedup"] is None
    assert goals([], [], rows)["c_layerwise_min_speedup"] is None
    text = table(rows, [("tokens", "tokens", "d"), ("mode", "mode", ""),
                        ("speedup", "speedup", ".2f")])
    assert text.splitlines() == ["tokens       mode  speedup",
                                 "  4096  layerwise        -",
                                 "  4096      after        -"]


def test_a_store_too_small_for_the_run_is_refused_up_front(capsys):
    """Eviction would hide a prompt P from the wait before its sibling P' (the GPU run of
    2026-11-26 waited 30 s for blocks an 8 GiB store could not hold, and on 2026-11-27 a
    12 GiB one evicted at its 0.9 watermark): the run refuses to start, naming what it
    needs; the CPU defaults fit."""
    gpu = ["--device", "cuda", "--model", "dummy-llama3-8b", "--dtype", "bfloat16", "--reps", "2"]
    need = store_mb_needed(parse_args(gpu + ["--segment-mb", "100000"]))
    # ~95k tokens of 128 KiB each (a warm-up step per length on a GPU), over 0.9
    assert 12288 < need <= 14336  # what gpu_device.sh gives
    with pytest.raises(SystemExit):
        parse_args(gpu + ["--segment-mb", "12288"])
    assert f"{need} MiB of dummy-llama3-8b KV" in capsys.readouterr().err
    assert store_mb_needed(parse_args([])) <= 640  # the default --segment-mb


def test_the_default_model_has_the_narrow_ones_kv_and_its_shape_is_named():
    """The issue-sized default moves the same KV per token as the narrow model of runs
    A-I; the report's header names the shape it ran."""
    assert describe(parse_args([])) == (
        "4 layers, hidden 1024, intermediate 2048, 2 heads / 2 KV heads x 64, float32 on cpu "
        "(4 KiB KV/token)")
    assert describe(parse_args(["--model", "dummy-bench-prefill"])).startswith(
        "4 layers, hidden 256, intermediate 512, 2 heads / 2 KV heads x 64")
    assert describe(parse_args(["--model", "/models/x.gguf"])) == "float32 on cpu"


def test_kv_path_transfer_engine_takes_shared_memory_out_everywhere(tmp_path):
    """``--kv-path transfer_engine``: the cluster config sends KV to decode over the engine
    and gives the store no segment file, so store reads and writes take it too."""
    from benchmarks.prefill_clusters import Run

    run = Run("layerwise", 0, tmp_path, parse_args(["--kv-path", "transfer_engine"]))
    run.http.close()
    cfg = run.cluster.config
    assert cfg.kv_path == "transfer_engine" and not cfg.store.shm_dir
    other = Run("after", 1, tmp_path, parse_args([]))
    other.http.close()
    default = other.cluster.config
    assert default.kv_path == "auto" and default.store.shm_dir == "/dev/shm"
