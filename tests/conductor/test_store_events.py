"""IndexSync: the conductor's global index follows the store master's committed keys
through lost events, master restarts and master silence (exact keys and states)."""
from __future__ import annotations

from common.scheduling import PrefixIndex
from common.store.protocol import StoreEvents, StoreKeysReply
from services.conductor.store_events import IndexSync, Sync


def events(inc: str, *evs: tuple[int, str, str], last: int | None = None) -> StoreEvents:
    seqs = [e[0] for e in evs]
    return StoreEvents([list(e) for e in evs], inc, last if last is not None else max(seqs))


def keys(index: PrefixIndex) -> set[str]:
    return {k for k in ("a", "b", "c", "d", "e", "x", "y") if k in index}


def live(inc: str = "m1", snapshot: tuple[str, ...] = (), seq: int = 0) -> IndexSync:
    sync = IndexSync(PrefixIndex())
    sync.on_events(StoreEvents([], inc, seq), now=0.0)
    assert sync.state is Sync.RESYNCING
    sync.on_snapshot(StoreKeysReply(1, inc, seq, list(snapshot)))
    assert sync.state is Sync.LIVE
    return sync


def test_first_message_asks_for_a_snapshot_and_events_follow_it() -> None:
    sync = IndexSync(PrefixIndex())
    assert sync.state is Sync.WAITING
    sync.on_events(events("m1", (4, "stored", "a")), now=1.0)
    assert sync.state is Sync.RESYNCING and keys(sync.index) == set()  # dropped: no base
    sync.on_snapshot(StoreKeysReply(1, "m1", 5, ["a", "b"]))
    assert (sync.state, sync.last_seq, keys(sync.index)) == (Sync.LIVE, 5, {"a", "b"})
    # queued behind the snapshot: 5 is in it already, 6 and 7 are new
    sync.on_events(events("m1", (5, "removed", "a"), (6, "stored", "c"), (7, "removed", "b")),
                   now=1.1)
    assert (sync.state, sync.last_seq, keys(sync.index)) == (Sync.LIVE, 7, {"a", "c"})
    assert (sync.gaps, sync.restarts, sync.resyncs) == (0, 0, 1)


def test_stored_then_removed_in_one_batch_is_absent() -> None:
    sync = live()
    sync.on_events(events("m1", (1, "stored", "a"), (2, "removed", "a"), (3, "stored", "b")),
                   now=1.0)
    assert keys(sync.index) == {"b"} and sync.last_seq == 3


def test_a_gap_keeps_the_index_until_the_snapshot_replaces_it() -> None:
    sync = live(snapshot=("a",), seq=10)
    sync.on_events(events("m1", (11, "stored", "b"), (13, "stored", "c")), now=1.0)
    assert (sync.state, sync.gaps, sync.last_seq) == (Sync.RESYNCING, 1, 11)
    assert keys(sync.index) == {"a", "b"}  # applied up to the gap; nothing after it
    sync.on_events(events("m1", (14, "stored", "d")), now=1.1)  # dropped while resyncing
    assert keys(sync.index) == {"a", "b"}
    sync.on_snapshot(StoreKeysReply(2, "m1", 14, ["b", "c", "d"]))
    assert (sync.state, keys(sync.index)) == (Sync.LIVE, {"b", "c", "d"})


def test_a_beacon_ahead_of_us_is_a_gap() -> None:
    sync = live(seq=3)
    sync.on_events(StoreEvents([], "m1", 3), now=1.0)
    assert sync.state is Sync.LIVE  # an idle beacon: nothing missed
    sync.on_events(StoreEvents([], "m1", 5), now=1.5)  # events 4..5 never arrived
    assert (sync.state, sync.gaps) == (Sync.RESYNCING, 1)


def test_master_restart_clears_the_old_masters_keys() -> None:
    sync = live(snapshot=("a", "b"), seq=2)
    sync.on_events(events("m2", (1, "stored", "x")), now=1.0)  # new incarnation
    assert (sync.state, sync.restarts, sync.incarnation) == (Sync.RESYNCING, 1, "m2")
    assert keys(sync.index) == set()  # a and b died with the old master
    sync.on_events(events("m1", (3, "stored", "c")), now=1.1)  # the old one, late
    assert (sync.incarnation, sync.restarts, keys(sync.index)) == ("m1", 2, set())
    sync.on_events(events("m2", (2, "stored", "y")), now=1.2)
    sync.on_snapshot(StoreKeysReply(3, "m2", 2, ["x", "y"]))
    assert (sync.state, sync.incarnation, keys(sync.index)) == (Sync.LIVE, "m2", {"x", "y"})


def test_silence_forgets_the_master_and_its_keys() -> None:
    sync = live(snapshot=("a",), seq=1)
    sync.last_heard = 10.0
    assert not sync.on_silence(now=14.9, silence_s=5.0)
    assert keys(sync.index) == {"a"}
    assert sync.on_silence(now=15.0, silence_s=5.0)
    assert (sync.state, sync.incarnation, keys(sync.index)) == (Sync.WAITING, None, set())
    assert not sync.on_silence(now=30.0, silence_s=5.0)  # already forgotten
    sync.on_events(StoreEvents([], "m1", 1), now=31.0)  # the same master, back: resync
    assert (sync.state, sync.restarts) == (Sync.RESYNCING, 0)
