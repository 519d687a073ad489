"""Outboxes are bounded (common/mailbox.py): a peer that is down holds at most
``OUTBOX_HWM`` of our messages; beyond that ``send`` drops, logs and counts."""
from __future__ import annotations

import asyncio

import pytest

import common.mailbox as mailbox
from common.mailbox import Mailbox
from common.protocol import AbortRequest

NOBODY = "tcp://127.0.0.1:20599"  # nothing listens here


def test_a_full_outbox_drops_and_counts(monkeypatch: pytest.MonkeyPatch,
                                        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(mailbox, "OUTBOX_HWM", 5)
    mail = Mailbox(None, "test")

    async def go() -> list[bool]:  # services send from their event loop
        return [mail.send(NOBODY, AbortRequest(f"r{i}")) for i in range(12)]

    try:
        sent = asyncio.run(go())
    finally:
        mail.close()
    assert sent == [True] * 5 + [False] * 7
    assert mail.dropped == {NOBODY: 7}
    line = "outbox to tcp://127.0.0.1:20599 is full (5 queued); dropped AbortRequest (7 so far)"
    assert line in caplog.text


def test_the_bound_is_sane() -> None:
    assert 1_000 <= mailbox.OUTBOX_HWM <= 20_000


def test_a_dealer_link_to_an_absent_master_drops_instead_of_blocking(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A store node's link while its master is away: heartbeats queue up to the bound,
    then are dropped and logged; ``send`` never waits."""
    monkeypatch.setattr(mailbox, "OUTBOX_HWM", 5)
    link = mailbox.DealerLink(NOBODY, "node", b"n0")

    async def go() -> None:
        for i in range(12):
            await asyncio.wait_for(link.send(AbortRequest(f"r{i}")), 0.5)

    try:
        asyncio.run(go())
    finally:
        link.close()
    assert caplog.text.count("node: AbortRequest dropped") == 7
