"""Where a request's time goes between the processes: its stages' timestamps, off unless
asked for.

With ``CRESCENT_TIMELINE_DIR`` naming a directory, every service process (``start``, from
the one bootstrap) appends a line ``<wall-clock s> <stage> <request id> [detail]`` to
``DIR/<role>-<index>-<pid>.log`` as a request passes each stage of ``STAGES``;
``benchmarks/timeline.py`` merges the files into each request's timeline and a table of
the hops between its stages. Wall-clock time: the processes of one host share its clock;
across hosts a hop is only as good as their clocks' agreement. Off, ``mark`` is one test
of a global.
"""
from __future__ import annotations

import os
import time
from typing import Mapping, Optional, TextIO

ENV_DIR = "CRESCENT_TIMELINE_DIR"

# Every stage, in the order a disaggregated request passes them (a colocated worker's
# prompt marks only the router's and conductor's); the detail a line may carry is named
# here. A stage that sends a message to another process is marked before it sends, so
# that a request's stages are in time order across the processes of one host.
STAGES: dict[str, str] = {
    "router_in": "the router has the request's body",
    "router_sent": "the router queues the SubmitRequest (detail: the prompt's tokens)",
    "conductor_in": "the conductor took the SubmitRequest",
    "placed": "placed: ReserveBlocks queued to the decode worker",
    "reserved": "the conductor took the decode worker's BlocksReserved",
    "task_sent": "the conductor queues the PrefillTask to the prefill worker",
    "prefill_in": "the prefill worker took the PrefillTask",
    "admitting": "its admission began",
    "admitted": "admitted (detail: the prompt's tokens it need not compute)",
    "step": "a step with a chunk of it began (detail: the chunk's tokens)",
    "computed": "the step with its last chunk ended",
    "kv_ready": "its KV landed and its first token was sampled: it queues KVReady",
    "decode_in": "the decode worker took the KVReady",
    "first_sent": "the decode worker queues the first token's TokenDelta to the router",
    "router_first": "the router took the first token",
    "first_written": "the first token's chunk written to the client",
}

_out: Optional[TextIO] = None


def start(role: str, index: int, env: Mapping[str, str] = os.environ) -> Optional[str]:
    """Open this process's file if ``env`` asks for one; its path, else None."""
    global _out
    directory = env.get(ENV_DIR)
    if not directory:
        return None
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{role}-{index}-{os.getpid()}.log")
    _out = open(path, "a", buffering=1)  # a line at a time: a killed process keeps its lines
    return path


def mark(stage: str, request_id: str, detail: object = "") -> None:
    """``request_id`` passed ``stage`` now (one of ``STAGES``)."""
    if _out is not None:
        _out.write(f"{time.time():.6f} {stage} {request_id} {detail}".rstrip() + "\n")


def stop() -> None:
    global _out
    if _out is not None:
        _out.close()
        _out = None
