"""A failed transfer future waited on through ``watched`` is not logged again as "Future
exception was never retrieved" when its asyncio wrapper is collected.

The check runs in a process of its own: it calls ``gc.collect()``, which in the suite's
process would also collect whatever earlier tests left behind (a ZeroMQ context's
finalizer can block there), and the result must not depend on them."""
from __future__ import annotations

import subprocess
import sys

CHECK = """
import asyncio, gc, sys
from concurrent.futures import Future
from common.transfer import TransferError, watched

def unretrieved(wrap):
    async def main():
        seen = []
        asyncio.get_running_loop().set_exception_handler(lambda _, ctx: seen.append(ctx))
        fut = Future()
        fut.set_exception(TransferError("store write: 3 of 3 ranges failed"))
        await asyncio.wait([wrap(fut)])
        gc.collect()
        await asyncio.sleep(0)
        return seen
    return asyncio.run(main())

seen = unretrieved({wrap})
print(len(seen), any("never retrieved" in c.get("message", "") for c in seen))
"""


def _unretrieved(wrap: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", CHECK.format(wrap=wrap)], check=True,
                          capture_output=True, text=True, timeout=120).stdout.split()


def test_watched_failures_are_not_logged_as_never_retrieved() -> None:
    assert _unretrieved("watched") == ["0", "False"]
    # the check can fail: the plain wrapper logs
    assert _unretrieved("asyncio.wrap_future")[1] == "True"
