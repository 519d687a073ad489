"""common/memtrace.py: off without the environment variable, a baseline at the first
signal and the growth sites at the next."""
from __future__ import annotations

import asyncio
import os
import signal
import tracemalloc
from pathlib import Path

import pytest

from common import memtrace


def test_off_unless_asked() -> None:
    assert memtrace.frames_from_env({}) is None
    assert memtrace.frames_from_env({memtrace.ENV_FRAMES: "0"}) is None
    assert memtrace.start("prefill-0", {}) is None
    assert not tracemalloc.is_tracing()
    assert memtrace.frames_from_env({memtrace.ENV_FRAMES: " 7 "}) == 7
    for bad in ("x", "-1", "101"):
        with pytest.raises(ValueError):
            memtrace.frames_from_env({memtrace.ENV_FRAMES: bad})


def test_rss_of_this_process_and_a_gone_one() -> None:
    assert memtrace.rss_mb() > 1.0
    assert memtrace.rss_mb(2 ** 22 + 1) is None


KEPT: list[bytes] = []


def grow() -> None:
    for _ in range(200):
        KEPT.append(bytes(4096))  # the growth site: this line


def test_signals_write_the_growth_site(tmp_path: Path) -> None:
    env = {memtrace.ENV_FRAMES: "4", memtrace.ENV_DIR: str(tmp_path / "traces")}
    trace = memtrace.start("decode-1", env)
    try:
        loop = asyncio.new_event_loop()
        memtrace.install(trace, loop)

        async def two_signals() -> None:
            os.kill(os.getpid(), signal.SIGUSR2)  # the baseline
            await asyncio.sleep(0.05)
            grow()
            os.kill(os.getpid(), signal.SIGUSR2)  # the report
            await asyncio.sleep(0.05)

        loop.run_until_complete(two_signals())
        loop.remove_signal_handler(signal.SIGUSR2)
        loop.close()
    finally:
        tracemalloc.stop()
        KEPT.clear()
    text = (tmp_path / "traces" / "decode-1.tracemalloc.txt").read_text()
    by_line = text.split("top 10 by line:\n")[1].splitlines()
    line = grow.__code__.co_firstlineno + 2
    assert by_line[0].endswith(f"test_memtrace.py:{line}")  # the largest growth first
    assert int(by_line[0].split()[2]) >= 200  # blocks: the bytes (and the list's growth)
    assert text.startswith("traced ")
    assert f'test_memtrace.py", line {line}' in text.split("by traceback")[1]
