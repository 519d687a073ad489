"""Bounds on the caches torch's oneDNN keeps per matmul shape, set by the bootstrap
(common/service.py) of every process that computes.

A bfloat16 linear on the CPU (a prefill step in bfloat16, decode's bfloat16 linears) runs a
oneDNN primitive made for its exact shape, and two caches keep each one made: oneDNN's
own (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and ideep's (torch's wrapper,
``LRU_CACHE_CAPACITY``), 1,024 entries each by default. An entry holds about 0.4-0.65 MB
of native memory (JIT kernels; tracemalloc does not see it), and the row count M is part
of the shape: a prefill step's M is the tokens it computes, so nearly every step is a new
shape. Measured on SmolLM2-135M's four linear shapes in bfloat16 (benchmarks/soak.py,
BENCHMARKS.md "Soak"): 2.6 MB more RSS per new M, and the prefill worker grew 18-26 MB per
1,000 requests, toward the default caps' ~1 GB. Bounded at ``CAPACITY`` the growth stops
once the caches are full. A miss costs about 0.6 ms per linear shape (the first layer of a
step; the others hit), against prefill steps of 100 ms and more.

The prefill worker's M varies most and hits least, so its caches are smallest; a decode
worker's M is its batch size (1 to ``max_batch_size``), each worth keeping. A variable the
environment already sets is left as it is.
"""
from __future__ import annotations

import os
from typing import MutableMapping

VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
CAPACITY = {"prefill": 64, "decode": 256, "colocated": 256}  # entries of each cache


def bound(role: str, env: MutableMapping[str, str] = os.environ) -> None:
    """Cap both caches for ``role`` (others: left alone) unless ``env`` sets them; before
    the first matmul (oneDNN and ideep read the variables on first use)."""
    capacity = CAPACITY.get(role)
    if capacity is not None:
        for name in VARIABLES:
            env.setdefault(name, str(capacity))
