"""A pipeline group's head merges its followers' reports (services/prefill/group.py):
the request goes on only if every stage did its part and the last one sampled."""
from __future__ import annotations

import pytest

from common.grammar import GrammarError
from common.protocol import Fence
from common.sampling_params import SampledToken
from services.prefill.stage_protocol import StageReport
from common.transfer import TransferError
from services.prefill.group import Outcome

F = Fence(1, 1)


def report(stage: int, ok: bool = True, **kw: object) -> StageReport:
    return StageReport(1, stage, "r", F, ok, **kw)  # type: ignore[arg-type]


def test_every_stage_ok_and_the_last_ones_tokens_go_on() -> None:
    out = Outcome()
    out.add(report(1, kv_bytes=10, compute_s=1.0))
    out.add(report(2, kv_bytes=5, wait_s=0.5, first=[SampledToken(4), SampledToken(9)]))
    out.check()
    assert (out.stages, out.kv_bytes, out.compute_s, out.wait_s) == ({1, 2}, 15, 1.0, 0.5)
    assert [t.token for t in out.first] == [4, 9]


@pytest.mark.parametrize("reports, error, why", [
    ([report(1, False, error="link down"), report(2, first=[SampledToken(4)])],
     TransferError, "link down"),
    ([report(1)], TransferError, "a pipeline stage failed"),  # nobody sampled
    ([report(1), report(2, False, error="grammar", invalid=True)], GrammarError, "grammar"),
    ([report(1, False, error="late"), report(2, False, error="x", invalid=True)],
     GrammarError, "x"),  # the request's own fault wins: a 400, not a 503
])
def test_a_failed_stage_fails_the_request(reports: list, error: type, why: str) -> None:
    out = Outcome()
    for r in reports:
        out.add(r)
    with pytest.raises(error, match=why):
        out.check()
