"""The cost model fitted on this machine (common/engine/calibrate.py): what is timed, the
fit, the cache and its key, and the wire."""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest

from common.engine import Engine, EngineConfig
from common.engine import calibrate
from common.engine.calibrate import cache_path, calibration_key, machine_cost
from common.ipc import decode, encode
from common.protocol import MachineCost, RegisterWorker
from common.scheduling.cost import DecodeCoefficients, PrefillCoefficients


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(EngineConfig(model="dummy-tiny", num_blocks=600, block_size=16,
                               chunk_align=16, max_batch_size=64))


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("CRESCENT_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_prefill_runs_the_workers_chunks_and_frees_its_blocks(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[list[tuple[int, int]]] = []
    step = engine.stage_step
    monkeypatch.setattr(engine, "stage_step", lambda chunks, *a: (
        steps.append([(c.start, c.end) for c in chunks]), step(chunks, *a))[1])
    free = engine.pool.num_free
    samples = calibrate.prefill_samples(engine, budget=40, repeats=1, grid=((70, 0), (20, 36)))
    assert [(n, c) for n, c, _ in samples] == [(70, 0), (20, 36)]
    assert all(s > 0 for _, _, s in samples)
    # budget 40, chunks end on 16-token blocks (or the prompt's end): 0-32, 32-70; then
    # the 20 tokens after the 36 the warm-up prefill wrote
    assert steps == [[(0, 32)], [(32, 70)], [(36, 56)]]
    assert engine.pool.num_free == free


def test_points_that_do_not_fit_are_skipped(engine: Engine) -> None:
    samples = calibrate.prefill_samples(engine, 256, 1, grid=((16, 0), (20000, 0), (8, 8)))
    assert [(n, c) for n, c, _ in samples] == [(16, 0), (8, 8)]
    decode = calibrate.decode_samples(engine, 1, grid=((2, 32), (1000, 32), (64, 4000)))
    assert [(b, k) for b, k, _ in decode] == [(2, 64)]


def test_measure_fits_both_phases_nonnegative(engine: Engine) -> None:
    cost = calibrate.measure(engine, ["prefill", "decode"], budget=256)
    assert cost.prefill is not None and cost.decode is not None
    assert min(vars(cost.prefill).values()) >= 0 and min(vars(cost.decode).values()) >= 0
    assert cost.prefill.c_new > 0 or cost.prefill.c_new_sq > 0
    assert '"phase": "prefill"' in cost.key and '"phase": "decode"' in cost.key


def test_cached_per_key_and_measured_again_when_forced(
        engine: Engine, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs: list[list[str]] = []

    def fake(engine: Engine, phases: list[str], budget: int) -> MachineCost:
        runs.append(list(phases))
        return MachineCost("k", PrefillCoefficients(c0=len(runs)), DecodeCoefficients(d0=1))

    monkeypatch.setattr(calibrate, "measure", fake)
    first = machine_cost(engine, ["prefill"], 256)
    assert runs == [["prefill"]] and first.prefill == PrefillCoefficients(c0=1)
    assert first.decode is None  # only the phases asked for
    again = machine_cost(engine, ["prefill"], 256)
    assert runs == [["prefill"]] and again == first  # read from the cache
    path = cache_path(calibration_key(engine, "prefill", 256))
    assert path.parent == cache / "profiles"
    assert json.loads(path.read_text())["key"]["budget"] == 256
    machine_cost(engine, ["prefill"], 128)  # another budget: another key
    assert len(runs) == 2
    forced = machine_cost(engine, ["prefill"], 256, force=True)
    assert len(runs) == 3 and forced.prefill == PrefillCoefficients(c0=3)
    both = machine_cost(engine, ["prefill", "decode"], 256)
    assert runs[-1] == ["decode"] and both.prefill == forced.prefill


def test_a_damaged_or_foreign_cache_file_is_measured_again(
        engine: Engine, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(calibrate, "measure", lambda e, p, b: MachineCost(
        "k", PrefillCoefficients(c0=7.0)))
    path = cache_path(calibration_key(engine, "prefill", 64))
    path.parent.mkdir(parents=True)
    for text in ("{not json", json.dumps({"key": {"other": 1}, "prefill": {"c0": 1}}),
                 json.dumps({"key": calibration_key(engine, "prefill", 64),
                             "prefill": {"c9": 1}})):
        path.write_text(text)
        assert machine_cost(engine, ["prefill"], 64).prefill == PrefillCoefficients(c0=7.0)


def test_key_names_what_changes_the_time(engine: Engine,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    key = calibration_key(engine, "decode", 256)
    assert key["machine"] and key["model"] == "dummy-tiny" and key["threads"] >= 1
    assert {"dtype", "linear_dtype", "kv_dtype", "chunk_align", "version"} <= set(key)
    assert key["budget"] == 0  # a decode step does not depend on the prefill budget
    assert calibration_key(engine, "prefill", 256)["budget"] == 256
    assert key["quantized"] is False  # a float model's; quantized linears are re-measured
    monkeypatch.setattr(engine.model, "kept_quantized", 1)
    assert calibration_key(engine, "decode", 256)["quantized"] is True


def test_workers_starting_together_measure_once(engine: Engine, cache: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    started, calls = threading.Event(), []

    def slow(engine: Engine, phases: list[str], budget: int) -> MachineCost:
        calls.append(phases)
        started.set()
        time.sleep(0.5)
        return MachineCost("k", PrefillCoefficients(c0=5.0))

    monkeypatch.setattr(calibrate, "measure", slow)
    first = threading.Thread(target=machine_cost, args=(engine, ["prefill"], 32))
    first.start()
    try:
        assert started.wait(30)
        # the lock is on an open file: a second open, even in this process, waits on it
        assert machine_cost(engine, ["prefill"], 32).prefill == PrefillCoefficients(c0=5.0)
        assert len(calls) == 1
    finally:
        first.join(30)


def test_registration_carries_the_cost_on_the_wire() -> None:
    cost = MachineCost("{}", PrefillCoefficients(0.1, 2e-3, 0, 1e-6, 5e-7),
                       DecodeCoefficients(0.05, 1e-3, 1e-5))
    msg = RegisterWorker("prefill-0", "prefill", "tcp://x", "h:1", 0, 64, 4, 10, 16, cost=cost)
    assert decode(encode(msg)) == msg
    assert decode(encode(RegisterWorker("d", "decode", "tcp://x", "h:1", 0, 64, 4, 10, 16))
                  ).cost is None


def test_a_busy_machine_measures_fewer_points_not_longer(engine: Engine) -> None:
    assert len(calibrate.prefill_samples(engine, 256, 1, limit_s=0.0)) == 1
    assert len(calibrate.decode_samples(engine, 1, limit_s=0.0)) == 1


def test_a_prefix_is_computed_when_reached_and_only_if_it_fits(
        engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """The prefixes grow as the grid reaches them (no 960-token prefill up front); where
    the prompts' speed says a prefix would outlast the time left, the grid ends there."""
    prefills: list[tuple[int, int]] = []
    prefill = engine.prefill
    monkeypatch.setattr(engine, "prefill", lambda ids, table, cached=0: (
        prefills.append((cached, len(ids))), prefill(ids, table, cached))[1])
    grid = ((8, 0), (32, 0), (32, 256), (16, 960))
    got = calibrate.prefill_samples(engine, 256, 1, grid=grid, limit_s=60.0)
    assert [(n, c) for n, c, _ in got] == list(grid)
    assert prefills == [(0, 1), (1, 256), (256, 960)]  # the warm-up, then each prefix
    prefills.clear()
    # prompts measured at 1 s a token: a 255-token prefix would take minutes
    monkeypatch.setattr(calibrate, "_fastest", lambda engine, fn, repeats: (fn(), 8.0)[1])
    got = calibrate.prefill_samples(engine, 256, 1, grid=grid, limit_s=60.0)
    assert [(n, c) for n, c, _ in got] == [(8, 0), (32, 0)] and prefills == [(0, 1)]


def test_a_calibration_on_busy_cores_is_cached_with_its_share(
        engine: Engine, cache: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    runs = []

    def waiting(engine: Engine, phases: list[str], budget: int) -> MachineCost:
        runs.append(phases)
        time.sleep(0.2)  # wall time passes, the process computes nothing: others had the core
        return MachineCost("k", decode=DecodeCoefficients(d0=0.5))

    monkeypatch.setattr(calibrate, "measure", waiting)
    assert machine_cost(engine, ["decode"], 256).decode == DecodeCoefficients(d0=0.5)
    assert "they were busy" in caplog.text
    saved = json.loads(cache_path(calibration_key(engine, "decode", 256)).read_text())
    assert saved["cpu_share"] < 0.5
    machine_cost(engine, ["decode"], 256)
    assert len(runs) == 1  # a restart reads it: it does not pay the calibration again


def test_a_worker_calibrates_its_own_phases_only_with_the_auto_profile(
        engine: Engine, cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from common.config import ClusterConfig
    from common.worker import WorkerRuntime

    monkeypatch.setattr(calibrate, "measure", lambda e, phases, b: MachineCost(
        "k", PrefillCoefficients(c0=1.0), DecodeCoefficients(d0=2.0)))

    def cost(role: str, stages: int = 1, profile: str = "auto") -> MachineCost | None:
        rt = SimpleNamespace(config=ClusterConfig(cost_profile=profile), engine=engine,
                             role=role, stages=stages)
        return WorkerRuntime._machine_cost(rt)  # type: ignore[arg-type]

    prefill, decode, both = cost("prefill"), cost("decode"), cost("colocated")
    assert (prefill.prefill, prefill.decode) == (PrefillCoefficients(c0=1.0), None)
    assert (decode.prefill, decode.decode) == (None, DecodeCoefficients(d0=2.0))
    assert both.prefill and both.decode
    assert cost("prefill", stages=2) is None  # a pipeline stage holds a share of the layers
    assert cost("prefill", profile="cpu-smollm2-135m") is None  # a pinned profile
