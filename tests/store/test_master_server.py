"""The master's registration and snapshot verbs, in process (its sockets bound, not served)."""
from __future__ import annotations

import asyncio
import time

from common.config import ClusterConfig
from common.store import protocol as p
from services.store_master.server import MasterServer
from tests.store.conftest import free_base_port

NODE = "store_node-0"


def register(pid: int) -> p.NodeRegister:
    return p.NodeRegister(NODE, "h", "h:1", 4096, 1 << 20, 0, f"/dev/shm/seg-{pid}", pid)


def test_a_repeated_registration_keeps_the_nodes_replicas_and_epoch() -> None:
    async def go() -> None:
        server = MasterServer(ClusterConfig(base_port=free_base_port()))
        try:
            ack = await server.on_register(NODE.encode(), register(pid=10))
            assert (ack.known, ack.live) == (True, [NODE])
            md = server.md
            md.put_start(["k"], 64, 1, time.monotonic())
            assert md.put_end(["k"], [True], time.monotonic()) == [True]
            for _ in range(3):  # heartbeats queued during an outage, answered "unknown"
                ack = await server.on_register(NODE.encode(), register(pid=10))
                assert ack.known
            assert md.exists(["k"]) == [True]
            assert md.nodes[NODE].info["epoch"] == 1
            keys = await server.on_keys(b"conductor", p.StoreKeys(7))
            assert (keys.req_id, keys.incarnation, keys.last_seq, keys.keys) == (
                7, server.incarnation, 1, ["k"])
            await server.on_register(NODE.encode(), register(pid=11))  # a new process
            assert md.exists(["k"]) == [False]  # its segment is fresh: the object is gone
            assert md.nodes[NODE].info["epoch"] == 2
            keys = await server.on_keys(b"conductor", p.StoreKeys(8))
            assert (keys.last_seq, keys.keys) == (2, [])  # event 2: "removed"
            assert await server.on_register(b"intruder", register(pid=12)) is None
            assert md.nodes[NODE].info["epoch"] == 2
        finally:
            server.close()

    asyncio.run(go())


def test_the_masters_process_freezes_what_each_full_collection_leaves():
    """``freeze_after_full_collections`` (the master's process only: run in a child): after
    a full collection its survivors are frozen; garbage cycles made later still go."""
    import subprocess
    import sys

    code = """
import gc, weakref
from services.store_master.server import freeze_after_full_collections
freeze_after_full_collections()
keep = [[i] for i in range(1000)]
gc.collect()
assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()
class Node: pass
a, b = Node(), Node(); a.peer, b.peer = b, a
gone = weakref.ref(a)
del a, b
gc.collect(0)
assert gone() is None
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=str(__import__("pathlib").Path(__file__).parents[2]))
    assert out.stdout.strip() == "ok", out.stderr
