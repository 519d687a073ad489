"""flash-attn backend (CUDA + flash_attn only) agrees with SDPA."""
from __future__ import annotations

import pytest
import torch

from common.engine import DecodeInput, Engine, EngineConfig
from common.model.flash_attention import flash_available

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not flash_available(), reason="flash-attn path needs a CUDA GPU and the flash_attn package")]


def test_flash_matches_sdpa() -> None:
    def run(backend: str) -> tuple[torch.Tensor, torch.Tensor]:
        e = Engine(EngineConfig(model="dummy-tiny", dtype="bfloat16", device="cuda", block_size=256,
                                num_blocks=8, attention_backend=backend))
        ids = list(range(5, 305))
        first = e.prefill(ids, [3, 1])
        step = e.decode_step([DecodeInput(7, 300, [3, 1])])[0]
        return first, step

    (fp, fd), (sp, sd) = run("flash"), run("sdpa")
    assert torch.allclose(fp, sp, atol=3e-2) and torch.allclose(fd, sd, atol=3e-2)
