"""The GPU engine's Triton kernels and graphed decode step, checked on the CPU: the batch
ladder here, and the kernels against the torch path in Triton's interpreter
(tests/model/triton_interpreter_cases.py, run in a child process with TRITON_INTERPRET=1,
since the interpreter is chosen when triton is imported and other tests import it
without). tests/model/test_cuda_graphs.py runs the same kernels on a GPU.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.engine.cuda_graphs import batch_ladder, padded_size
from common.model import triton_ops

CASES = os.path.join(os.path.dirname(__file__), "triton_interpreter_cases.py")


def test_batch_ladder_and_padding() -> None:
    assert batch_ladder(1) == [1]
    assert batch_ladder(6) == [1, 2, 4, 6]
    assert batch_ladder(8) == [1, 2, 4, 8]
    assert batch_ladder(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_ladder(30) == [1, 2, 4, 8, 16, 24, 30]
    ladder = batch_ladder(128)
    assert [padded_size(ladder, n) for n in (1, 2, 3, 5, 9, 17, 120, 128)] == \
        [1, 2, 4, 8, 16, 24, 120, 128]
    with pytest.raises(ValueError, match="exceed"):
        padded_size(ladder, 129)
    with pytest.raises(ValueError):
        batch_ladder(0)


@pytest.mark.skipif(not triton_ops.available(), reason="the triton package is not installed")
def test_kernels_in_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-rs", CASES], env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "19 passed" in run.stdout and "skipped" not in run.stdout, run.stdout[-2000:]
