"""serve_inbox: dispatch over real sockets; bad frames and handler errors do not stop it;
a dead background task ends the service with an error."""
from __future__ import annotations

import asyncio

import pytest

from common.mailbox import Mailbox, ServiceTaskDied, serve_inbox
from common.protocol import AbortRequest, KVFailed


def test_dispatch_survives_bad_frames_and_handler_errors() -> None:
    async def go() -> list[str]:
        inbox = "tcp://127.0.0.1:18321"
        server, client = Mailbox(inbox, "server"), Mailbox(None, "client")
        seen: list[str] = []

        def on_abort(msg: AbortRequest) -> None:
            if msg.request_id == "boom":
                raise RuntimeError("handler bug")
            seen.append(msg.request_id)

        task = asyncio.create_task(serve_inbox(server, {AbortRequest: on_abort}))
        raw = client._socket(inbox)
        await raw.send(b"garbage")
        client.send(inbox, AbortRequest("boom"))
        client.send(inbox, KVFailed("x", "no handler for this type"))
        client.send(inbox, AbortRequest("ok"))
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        server.close()
        client.close()
        return seen

    assert asyncio.run(go()) == ["ok"]


def test_dead_background_task_ends_the_service() -> None:
    async def go() -> None:
        mail = Mailbox("tcp://127.0.0.1:18322", "svc")

        async def crashes() -> None:
            await asyncio.sleep(0.05)
            raise ValueError("step loop bug")

        try:
            with pytest.raises(ServiceTaskDied, match="step loop bug"):
                await asyncio.wait_for(
                    serve_inbox(mail, {}, [asyncio.create_task(crashes())]), 5)
        finally:
            mail.close()

    asyncio.run(go())
