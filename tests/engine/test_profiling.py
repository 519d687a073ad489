"""The opt-in step profiler (common/engine/profiling.py): off without its variable, a
summary per profiled step, at most the asked number per label, timelines for the first."""
from __future__ import annotations

import gzip
import json

import torch

from common.engine.profiling import ENV_DIR, ENV_STEPS, StepProfiler


def test_off_without_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_DIR, raising=False)
    monkeypatch.chdir(tmp_path)
    prof = StepProfiler.from_env("prefill-0")
    with prof.step("cold-8t", torch.device("cpu")):
        torch.ones(2).sum()
    assert prof.written == 0 and not list(tmp_path.iterdir())


def test_profiles_each_label_up_to_its_count(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "prof"))
    monkeypatch.setenv(ENV_STEPS, "3")
    prof = StepProfiler.from_env("prefill-0")
    a = torch.randn(64, 64)
    for label in ["cold-64t"] * 4 + ["warm-16t"]:
        with prof.step(label, torch.device("cpu")):
            (a @ a).sum()
    texts = sorted((tmp_path / "prof").glob("*.txt"))
    assert [p.name for p in texts] == ["prefill-0-01-cold-64t.txt", "prefill-0-02-cold-64t.txt",
                                       "prefill-0-03-cold-64t.txt", "prefill-0-04-warm-16t.txt"]
    head = texts[0].read_text().splitlines()[0]
    assert head.startswith("prefill-0 step 1 (cold-64t): wall ") and "host thread" in head
    assert "aten::mm" in texts[0].read_text()
    traces = sorted(p.name for p in (tmp_path / "prof").glob("*.json.gz"))
    assert traces == ["prefill-0-01-cold-64t.json.gz", "prefill-0-02-cold-64t.json.gz",
                      "prefill-0-04-warm-16t.json.gz"]
    with gzip.open(tmp_path / "prof" / traces[0]) as fh:
        assert any(e.get("name") == "aten::mm" for e in json.load(fh)["traceEvents"])


def test_an_engines_stage_steps_are_labelled_by_tokens_and_start(tmp_path):
    """``Engine.stage_step`` profiles each step under its tokens and where it starts."""
    from common.engine import Engine, EngineConfig
    from common.engine.config import PrefillChunk

    engine = Engine(EngineConfig(model="dummy-tiny", num_blocks=16, block_size=16))
    engine.profiler = StepProfiler(tmp_path, "prefill-0", 1)
    ids = list(range(3, 43))
    table = engine.pool.allocate(engine.blocks_needed(len(ids)))
    engine.stage_step([PrefillChunk(ids, 0, 32, table)])
    engine.stage_step([PrefillChunk(ids, 32, 40, table)])
    assert sorted(p.name for p in tmp_path.glob("*.txt")) == [
        "prefill-0-01-32t-after0.txt", "prefill-0-02-8t-after32.txt"]
