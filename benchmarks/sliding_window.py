"""A CPU decode step of a model with sliding layers, side by side: on the C kernel
(common/model/cpu_attention.py), whose sliding layers read only the blocks of their window
in place (since 2026-11-29), on the gathering path (``attention_backend = "sdpa"``, what
a soft-capped layer and a GPU's windowed layers take: it gathers the window's blocks
and masks them; before 2026-11-29 it gathered the whole context), and the same model with
every layer attending everything, on the kernel. Model: ``dummy-gemma3-1b`` (Gemma 3 1B's
shape: 26 layers, 5 in 6 sliding over 512 keys, one KV head of 256, a 262k vocabulary),
bfloat16 linears and KV, one thread.

    python benchmarks/sliding_window.py [--contexts 1024,4096,8192] [--batches 1,4]

Prints a table of milliseconds per step (the least of ``--rounds`` rounds, the variants
in turn each round, a round starting with the next), then one JSON line.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.decode_step import compare  # noqa: E402
from common.engine import Engine, EngineConfig  # noqa: E402
from common.model.attention import CpuPagedAttention, SdpaAttention  # noqa: E402
from common.model.config import DUMMY_CONFIGS  # noqa: E402

MODEL = "dummy-gemma3-1b"
# variant -> (the model's sliding window kept, the attention backend)
VARIANTS = {"window/kernel": (True, "cpu"), "window/gather": (True, "sdpa"),
            "no-window/kernel": (False, "cpu")}


def make_engine(variant: str, blocks: int) -> Engine:
    window, backend = VARIANTS[variant]
    model = MODEL
    if not window:
        model = f"{MODEL}-no-window"
        DUMMY_CONFIGS[model] = dataclasses.replace(DUMMY_CONFIGS[MODEL], name=model,
                                                   sliding_window=None)
    engine = Engine(EngineConfig(model=model, kv_dtype="bfloat16", linear_dtype="bfloat16",
                                 num_blocks=blocks, attention_backend=backend))
    want = CpuPagedAttention if backend == "cpu" else SdpaAttention
    assert type(engine.attention) is want, f"{variant}: no {want.__name__}"
    return engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", default="1024,4096,8192")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{MODEL}, one thread")
    res = compare(args, make_engine, VARIANTS)
    print(json.dumps({"model": MODEL, **res}))


if __name__ == "__main__":
    main()
