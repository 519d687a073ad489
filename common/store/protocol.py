"""Store wire messages, grouped by receiver. Keys travel hex-encoded (``bytes.hex()``).

Clients and nodes talk to the master over one DEALER → ROUTER channel; every client request
carries a ``req_id`` echoed by its reply. A node's DEALER identity is its ``node_id`` so
the master can send it ``NodeCommand``s. KV bytes never ride here.

A location is ``[node_id, offset]``; ``nodes`` maps each node_id named in a reply to what a
client needs to reach it: ``{"session_id", "base", "shm_path", "hostname", "host_id", "epoch"}``;
``live`` lists every node the master knows (a client unmaps the others' segments).

A master process has an ``incarnation`` (random, fixed for its life): a new one means the
master restarted and everything the old one reported is gone.
"""
from __future__ import annotations

from typing import Any, Optional

from common.ipc import message

# ------------------------------------------------------------ to the master, from clients


@message
class StoreExists:
    req_id: int
    keys: list[str]


@message
class StoreGet:
    """Locations of ready DRAM replicas; grants a lease; promotes SSD-only objects."""
    req_id: int
    keys: list[str]


@message
class StorePutStart:
    req_id: int
    keys: list[str]
    size: int
    replica_num: int = 1


@message
class StorePutEnd:
    req_id: int
    keys: list[str]
    ok: list[bool]


@message
class StoreRemove:
    req_id: int
    keys: list[str]


@message
class StorePollEvents:
    """KV events with ``seq > after_seq`` (for the conductor; also published on PUB)."""
    req_id: int
    after_seq: int = 0


@message
class StoreStats:
    req_id: int


@message
class StoreKeys:
    """A snapshot of every committed key (the conductor's resync after a gap or restart)."""
    req_id: int


# ------------------------------------------------------------ to the master, from nodes


@message
class NodeRegister:
    node_id: str
    hostname: str
    session_id: str  # transfer-engine session of the node's segment
    base: int  # address of the segment in the node's process
    segment_bytes: int
    ssd_bytes: int
    shm_path: Optional[str] = None  # same-host clients may mmap this file instead
    pid: int = 0
    host_id: Optional[str] = None  # common/host.py: who may map shm_path (None: nobody)


@message
class NodeHeartbeat:
    node_id: str
    ssd_used: int = 0


@message
class NodeCommandDone:
    node_id: str
    op: str  # "offload" | "promote" | "drop_ssd" | "replicate"
    key: str
    ok: bool
    offset: int = 0  # the command's offset (a replicate answer must match its replica)


# ------------------------------------------------------------ to clients


@message
class StoreExistsReply:
    req_id: int
    present: list[bool]


@message
class StoreGetReply:
    req_id: int
    locations: list[Any]  # per key: [[node_id, offset], ...] or None (miss)
    nodes: dict[str, Any]
    lease_s: float
    live: Optional[list[str]] = None


@message
class StorePutStartReply:
    req_id: int
    status: list[str]  # per key: "new" | "exists" | "nospace"
    locations: list[Any]  # per key: [[node_id, offset], ...] (empty unless "new")
    nodes: dict[str, Any]
    put_timeout_s: float
    live: Optional[list[str]] = None


@message
class StorePutEndReply:
    req_id: int
    committed: list[bool]


@message
class StoreRemoveReply:
    req_id: int
    removed: int


@message
class StoreEventsReply:
    req_id: int
    events: list[Any]  # [seq, "stored" | "removed", key]
    last_seq: int


@message
class StoreStatsReply:
    req_id: int
    stats: dict[str, Any]


@message
class StoreKeysReply:
    """Every committed key as of event ``last_seq`` of master ``incarnation``."""
    req_id: int
    incarnation: str
    last_seq: int
    keys: list[str]


@message
class StoreEvents:
    """Published on the master's PUB socket (topic-less): a batch of KV events, or none
    (a beacon, every heartbeat interval while idle). ``last_seq``: the master's latest
    event, so a subscriber sees a gap even when no event follows the lost ones."""
    events: list[Any]  # [[seq, "stored" | "removed", key], ...]
    incarnation: str = ""
    last_seq: int = 0


# ------------------------------------------------------------ to nodes


@message
class NodeAck:
    known: bool  # False: the master does not know this node; register again
    heartbeat_interval_s: float = 0.5
    live: Optional[list[str]] = None  # every node the master knows


@message
class NodeCommandMsg:
    """``replicate``: copy ``size`` bytes from the ``source`` node's segment (its client info
    as in replies, plus ``node_id``) at ``source_offset`` into this segment at ``offset``,
    starting within ``start_within_s`` of receipt or not at all."""
    op: str  # "offload" (segment → SSD) | "promote" (SSD → segment) | "drop_ssd" | "replicate"
    key: str
    offset: int
    size: int
    source: Optional[dict[str, Any]] = None
    source_offset: int = 0
    start_within_s: float = 0.0
