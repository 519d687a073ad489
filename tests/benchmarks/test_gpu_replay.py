"""benchmarks/gpu_replay.py's pure parts: prompts from trace rows, the answers compared
across paths, the KV bytes read from the conductor's metrics, its arguments."""
from __future__ import annotations

import pytest

from benchmarks.gpu_replay import (
    FIRST_ID, Answer, PathRun, block_run, differing, kv_bytes, parse_args, prompt_ids,
)
from benchmarks.replay_metrics import RequestResult


def test_rows_sharing_hash_ids_share_their_prompts_prefix() -> None:
    a = prompt_ids({"hash_ids": [7, 8, 9], "input_length": 40}, 16, 4096, seed=0)
    b = prompt_ids({"hash_ids": [7, 8, 5], "input_length": 48}, 16, 4096, seed=0)
    assert len(a) == 40 and len(b) == 48
    assert a[:32] == b[:32] and a[32:40] != b[32:40]
    assert all(FIRST_ID <= t < 4096 for t in a + b)
    assert block_run(7, 16, 4096, seed=0) == a[:16]
    assert block_run(7, 16, 4096, seed=1) != a[:16]  # the seed names another prompt set


def answer(index: int, text: str, ok: bool = True) -> Answer:
    result = RequestResult(ttft_s=0.1, error="" if ok else "HTTP 500")
    return Answer(index, result, text)


def test_differing_counts_answers_both_paths_completed() -> None:
    first = PathRun("same-host", [answer(0, "a"), answer(1, "b"), answer(2, "c", ok=False)])
    other = PathRun("tcp", [answer(0, "a"), answer(1, "x"), answer(2, "z")])
    failed = PathRun("tcp", [answer(0, "q", ok=False)])
    assert differing([first, other]) == 1  # request 2 failed on the first path
    assert differing([first, failed]) == 0
    assert differing([first, other, other]) == 2


def test_kv_bytes_sums_workers_by_flow_and_path() -> None:
    text = "\n".join([
        "# TYPE crescent_worker_kv_bytes gauge",
        'crescent_worker_kv_bytes{instance="prefill-0",flow="decode",path="shm"} 10.0',
        'crescent_worker_kv_bytes{instance="prefill-1",flow="decode",path="shm"} 5.0',
        'crescent_worker_kv_bytes{instance="prefill-1",flow="store_read",path="shm"} 2.0',
        "# TYPE crescent_other gauge",
        'crescent_other{flow="decode",path="shm"} 99.0', ""])
    assert kv_bytes(text) == {"decode/shm": 15.0, "store_read/shm": 2.0}


def test_defaults_follow_the_device() -> None:
    gpu, cpu = parse_args(["--device", "cuda"]), parse_args([])
    assert (gpu.model, gpu.dtype, gpu.block_tokens) == ("dummy-llama3-8b", "bfloat16", 64)
    assert (cpu.model, cpu.dtype, cpu.block_tokens) == ("dummy-bench-prefill", "float32", 16)
    assert cpu.path_list == ["same-host", "tcp"]
    for bad in (["--model", "smollm2-135m"], ["--paths", "nvlink"], ["--rate", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
