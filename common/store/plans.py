"""Store plans: where a request's objects go or are, as the master grants them.

``StoreClient.start_put`` and ``plan_get`` (common/store/client.py) answer with a
``PutPlan`` (the keys granted as new and where each replica goes) or a ``GetPlan`` (where
each present object is, under a lease). A plan is a frozen dataclass that rides inside other
messages (common/ipc.py encodes and decodes it, nested), so the stages of a pipeline, which
have no master connection, move bytes under the very same plan (common/store/ranges.py's
``RangeMover``). Deadlines are wall clock (``time.time()``): they cross processes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


@dataclass(frozen=True)
class NodeRef:
    """What a mover needs to reach one store node: its transfer-engine session and segment
    address there, and for same-host movers its segment file (mapped per ``epoch``)."""

    node_id: str
    session_id: str
    base: int  # the segment's address in the node's process
    segment_bytes: int = 0
    shm_path: Optional[str] = None
    epoch: int = 0
    hostname: str = ""
    host_id: Optional[str] = None  # common/host.py: same as ours → the segment is mappable

    @classmethod
    def from_info(cls, node_id: str, info: dict[str, Any]) -> "NodeRef":
        """From the master's node info (``StoreGetReply.nodes[node_id]``)."""
        try:
            return cls(node_id, str(info["session_id"]), int(info["base"]),
                       int(info.get("segment_bytes", 0)), info.get("shm_path"),
                       int(info.get("epoch", 0)), str(info.get("hostname", "")),
                       info.get("host_id"))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"node {node_id}: bad node info {info!r} ({exc})") from None

    def info(self) -> dict[str, Any]:
        """The node info ``SegmentMaps.get`` reads."""
        return {"shm_path": self.shm_path, "segment_bytes": self.segment_bytes,
                "epoch": self.epoch, "host_id": self.host_id}


def node_refs(nodes: dict[str, Any]) -> list[NodeRef]:
    return [NodeRef.from_info(n, info) for n, info in sorted(nodes.items())]


@dataclass(frozen=True)
class Location:
    node_id: str
    offset: int  # of the object in the node's segment


@dataclass(frozen=True)
class Replicas:
    """One object's copies, in the order to try them (none: the object is absent)."""

    locations: list[Location] = field(default_factory=list)


def _check_plan(size: int, keys: list[str], replicas: list[Replicas]) -> None:
    if size <= 0:
        raise ValueError(f"object size must be positive, not {size}")
    if len(replicas) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(replicas)} replica lists")


@dataclass(frozen=True)
class PutPlan:
    """Where to write the objects the master granted as new (``index``: their positions in
    the asker's key list). Every replica must be written by ``deadline`` (wall clock)."""

    size: int  # bytes per object
    keys: list[str]  # hex, granted as new
    index: list[int]
    replicas: list[Replicas]  # per key: every location must be written
    nodes: list[NodeRef]
    deadline: float
    live: Optional[list[str]] = None  # every node the master knows (others are unmapped)

    def __post_init__(self) -> None:
        _check_plan(self.size, self.keys, self.replicas)
        if len(self.index) != len(self.keys):
            raise ValueError(f"{len(self.keys)} keys but {len(self.index)} positions")
        if any(not r.locations for r in self.replicas):
            raise ValueError("a granted key has no location")


@dataclass(frozen=True)
class GetPlan:
    """Where each object is (``replicas[i]`` empty: absent). Reads are good only if they
    end by ``deadline`` (wall clock: the lease, counted from before the request)."""

    size: int
    keys: list[str]
    replicas: list[Replicas]
    nodes: list[NodeRef]
    deadline: float
    live: Optional[list[str]] = None

    def __post_init__(self) -> None:
        _check_plan(self.size, self.keys, self.replicas)

    def present(self) -> list[bool]:
        return [bool(r.locations) for r in self.replicas]

    def first_replicas(self) -> Optional[dict[str, tuple["np.ndarray", "np.ndarray"]]]:
        """Per node: the positions of the keys whose first replica it holds, and those
        replicas' offsets in its segment; None where a key is absent."""
        by_node: dict[str, tuple[list[int], list[int]]] = {}
        for i, replicas in enumerate(self.replicas):
            if not replicas.locations:
                return None
            loc = replicas.locations[0]
            keys, offsets = by_node.setdefault(loc.node_id, ([], []))
            keys.append(i)
            offsets.append(loc.offset)
        return {node: (np.asarray(k, dtype=np.int64), np.asarray(o, dtype=np.int64))
                for node, (k, o) in by_node.items()}
