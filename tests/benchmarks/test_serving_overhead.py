"""benchmarks/serving_overhead.py's conductor figure times decisions, not timeouts: against
a real conductor process, every request it fires is accepted (the benchmark answers each
ReserveBlocks as the decode worker it names)."""
from __future__ import annotations

from benchmarks.serving_overhead import conductor_rate, router_cpu, run_with


def test_every_request_is_accepted_and_the_rate_is_positive() -> None:
    rate = run_with("kvcache_centric", ["conductor"], lambda cfg, _: conductor_rate(cfg, 40))
    assert rate > 0  # conductor_rate raises unless all 40 were accepted


def test_the_router_streams_every_token_of_a_steps_message() -> None:
    """The router's CPU per token: every token of 8 streams arrives (it raises if not),
    at a figure that is a router's (800 tokens: some 40 ms of CPU, 4 clock ticks)."""
    us = run_with("load_balance", ["router"], lambda cfg, pids: router_cpu(
        cfg, pids["router"], streams=8, tokens=100, batched=True))
    assert 0 < us < 10_000
