"""benchmarks/serving_overhead.py's conductor figure times decisions, not timeouts: against
a real conductor process, every request it fires is accepted (the benchmark answers each
ReserveBlocks as the decode worker it names)."""
from __future__ import annotations

from benchmarks.serving_overhead import conductor_rate, run_with


def test_every_request_is_accepted_and_the_rate_is_positive() -> None:
    rate = run_with("kvcache_centric", ["conductor"], lambda cfg: conductor_rate(cfg, 40))
    assert rate > 0  # conductor_rate raises unless all 40 were accepted
