"""The default model loads in under 10 s once its dequantized weights are cached."""
from __future__ import annotations

import time

from common.engine import Engine, EngineConfig


def test_warm_load_under_10s(smol: Engine) -> None:  # the fixture has filled the disk cache
    t = time.perf_counter()
    engine = Engine(EngineConfig(num_blocks=16))
    assert time.perf_counter() - t < 10.0
    assert engine.fingerprint == smol.fingerprint
