"""The replica state machine: every legal move by name, every other one raises."""
from __future__ import annotations

import itertools
from typing import Optional

import pytest

from services.store_master.replica import (DRAM, SSD, IllegalTransition, Replica,
                                  ReplicaState as S)

W, R, O, P, C, X = (S.WRITING, S.READY, S.OFFLOADING, S.PROMOTING, S.REPLICATING,
                    S.DROPPED)

# Written out by hand (not imported): the table the policy relies on.
LEGAL = {
    (DRAM, W, R), (DRAM, W, X),  # put_end; a failed or zombie put
    (DRAM, R, O), (DRAM, R, X),  # evicted to SSD; evicted or removed
    (DRAM, O, R),  # the offload answered (or its deadline passed)
    (DRAM, P, R), (DRAM, P, X),  # promotion done; failed or timed out
    (DRAM, C, R), (DRAM, C, X),  # replication done; failed or timed out
    (SSD, W, R), (SSD, W, X),  # the offload's SSD copy written; the offload failed
    (SSD, R, X),  # pushed off the SSD for room
}
BIRTHS = {(DRAM, W), (DRAM, P), (DRAM, C), (SSD, W)}
TIMED = {(DRAM, W), (DRAM, O), (DRAM, P), (DRAM, C)}


def born(tier: str, state: S) -> Replica:
    """A replica brought to ``state`` through legal moves only."""
    offset = 0 if tier == DRAM else None
    if state in (W, P, C):
        return Replica("n0", tier, state, offset, 1.0 if (tier, state) in TIMED else None,
                       "n1" if state is C else None)
    rep = born(tier, W)
    rep.move(R)
    if state is O:
        rep.move(O, 2.0)
    elif state is X:
        rep.move(X)
    return rep


def deadline_for(tier: str, state: S) -> Optional[float]:
    return 5.0 if (tier, state) in TIMED else None


REACHABLE = [(DRAM, s) for s in S] + [(SSD, W), (SSD, R), (SSD, X)]


@pytest.mark.parametrize("tier,src,dst", [(t, s, d) for t, s in REACHABLE for d in S])
def test_every_move_is_legal_exactly_when_the_table_says(tier, src, dst):
    rep = born(tier, src)
    assert rep.state is src
    if (tier, src, dst) in LEGAL:
        rep.move(dst, deadline_for(tier, dst))
        assert (rep.state, rep.deadline, rep.source) == (dst, deadline_for(tier, dst), None)
    else:
        with pytest.raises(IllegalTransition):
            rep.move(dst, deadline_for(tier, dst))
        assert rep.state is src  # unchanged


@pytest.mark.parametrize("tier,state", list(itertools.product((DRAM, SSD), S)))
def test_births(tier, state):
    offset = 0 if tier == DRAM else None
    make = lambda: Replica("n0", tier, state, offset, deadline_for(tier, state),  # noqa: E731
                           "n1" if state is C else None)
    if (tier, state) in BIRTHS:
        assert make().state is state
    else:
        with pytest.raises(IllegalTransition):
            make()


def test_deadlines_belong_to_timed_states_only():
    with pytest.raises(IllegalTransition):
        Replica("n0", DRAM, W, 0)  # a put without a deadline
    with pytest.raises(IllegalTransition):
        Replica("n0", SSD, W, deadline=1.0)  # the SSD copy's deadline is its DRAM copy's
    rep = Replica("n0", DRAM, W, 0, 10.0)
    assert (rep.expired(9.9), rep.expired(10.0)) == (False, True)
    with pytest.raises(IllegalTransition):
        rep.move(R, 12.0)
    rep.move(R)
    assert rep.deadline is None and not rep.expired(1e9)
    with pytest.raises(IllegalTransition):
        rep.move(O)  # an offload must say when it is given up
    rep.move(O, 20.0)
    assert rep.deadline == 20.0 and rep.state.readable


def test_source_only_while_replicating_and_offsets_only_in_dram():
    with pytest.raises(IllegalTransition):
        Replica("n0", DRAM, C, 0, 1.0)  # a copy from nowhere
    with pytest.raises(IllegalTransition):
        Replica("n0", DRAM, P, 0, 1.0, source="n1")
    with pytest.raises(IllegalTransition):
        Replica("n0", DRAM, W, None, 1.0)
    with pytest.raises(IllegalTransition):
        Replica("n0", SSD, W, 0)
    rep = Replica("n0", DRAM, C, 64, 1.0, "n1")
    rep.move(R)
    assert (rep.state, rep.source, rep.deadline, rep.offset) == (R, None, None, 64)


def test_readable_states():
    assert {s for s in S if s.readable} == {R, O}
