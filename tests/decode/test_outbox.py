"""``DeltaOutbox``: what one step (or one handled message) streams goes to each router as
one message, in order, once the event loop is free; a lone delta as itself."""
from __future__ import annotations

import asyncio

from common.protocol import TokenDelta, TokenDeltas
from services.decode.outbox import DeltaOutbox
from tests.conductor.test_conductor import RecordingMail


def delta(rid: str, i: int) -> TokenDelta:
    return TokenDelta(rid, [i], f"w{i}", None, None, 5, i + 1)


def test_a_steps_deltas_go_as_one_message_per_router() -> None:
    mail = RecordingMail()
    outbox = DeltaOutbox(mail)  # type: ignore[arg-type]

    async def step() -> list:
        outbox.put("router-a", delta("r1", 0))
        outbox.put("router-b", delta("r2", 0))
        outbox.put("router-a", delta("r3", 0))
        held = list(mail.sent)  # nothing leaves while the step's callback runs
        await asyncio.sleep(0)
        return held

    assert asyncio.run(step()) == []
    assert mail.sent == [("router-a", TokenDeltas([delta("r1", 0), delta("r3", 0)])),
                         ("router-b", delta("r2", 0))]


def test_each_step_is_its_own_message() -> None:
    mail = RecordingMail()
    outbox = DeltaOutbox(mail)  # type: ignore[arg-type]

    async def steps() -> None:
        for i in range(2):
            outbox.put("router", delta("r1", i))
            outbox.put("router", delta("r2", i))
            await asyncio.sleep(0)

    asyncio.run(steps())
    assert mail.sent == [("router", TokenDeltas([delta("r1", i), delta("r2", i)]))
                         for i in range(2)]


def test_without_a_loop_a_delta_goes_at_once() -> None:
    mail = RecordingMail()
    DeltaOutbox(mail).put("router", delta("r1", 0))  # type: ignore[arg-type]
    assert mail.sent == [("router", delta("r1", 0))]
