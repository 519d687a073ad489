"""Other processes' node segments mapped here: one mapping per node, per file and epoch.

Same-host readers and writers (the store client, a node copying a hot replica from another
node) move bytes with one ``memmove`` through a mapping of the node's /dev/shm file instead
of the transfer engine. A node that re-registers (new epoch) or restarts (new file) gets its
old mapping closed and a fresh one. A node the master no longer lists is dead: ``retain``
closes its mapping, so a SIGKILLed node's file does not stay mapped (and its tmpfs pages
held) for the life of every client. A file this host cannot open is remembered as ``None``
for that epoch, so the caller falls back to the transfer engine without trying again on
every block. Only a node segment file is mapped: a regular file of ours directly in the
configured ``[store] shm_dir``, named as nodes name them (``checked_shm_path``); a node info
naming anything else (``/etc/passwd``, a symlink) is refused and logged.

Closing never unmaps bytes under a running copy: a copy pins the mapping with a view
(``Segment.view``, passed as ``copy_many``'s ``pin``) and the unmapping waits for it.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterable, Optional

from common.host import same_host
from common.security import STORE_SEGMENT, checked_shm_path
from common.store.shm import Segment

log = logging.getLogger(__name__)


class SegmentMaps:
    """node_id + node info (``shm_path``, ``segment_bytes``, ``epoch``) → a mapping here."""

    def __init__(self, shm_dir: Optional[str], own_path: Optional[str] = None,
                 on_close: Optional[Callable[[Segment], None]] = None) -> None:
        self.shm_dir = shm_dir  # [store] shm_dir: only segment files in it are mapped
        self.own_path = own_path  # never map our own segment a second time
        self.on_close = on_close  # called with a mapping just before it closes
        # node_id → (path, epoch, mapping or None: not mappable here)
        self._maps: dict[str, tuple[str, int, Optional[Segment]]] = {}

    def get(self, node_id: str, info: dict[str, Any]) -> Optional[Segment]:
        """The node's segment mapped here, or None: no file, not openable, our own, or
        on another host (its ``host_id`` is not ours: common/host.py)."""
        path = info.get("shm_path")
        if not path or path == self.own_path or not same_host(info.get("host_id")):
            return None
        epoch = info.get("epoch", 0)
        cached = self._maps.get(node_id)
        if cached is not None and cached[:2] == (path, epoch):
            return cached[2]
        self._drop(node_id)
        seg: Optional[Segment] = None
        if os.path.lexists(path):  # else on another host: the transfer engine, silently
            try:
                checked_shm_path(path, self.shm_dir, STORE_SEGMENT)
                seg = Segment(int(info["segment_bytes"]), path)
            except (OSError, ValueError, KeyError) as exc:
                log.warning("node %s: not mapping %s (%s): using the transfer engine",
                            node_id, path, exc)
        self._maps[node_id] = (path, epoch, seg)
        return seg

    def retain(self, live: Iterable[str]) -> list[str]:
        """Close the mappings of nodes not in ``live`` (the master's node list); returns
        the node ids dropped."""
        keep = set(live)
        gone = sorted(n for n in self._maps if n not in keep)
        for node_id in gone:
            log.info("node %s is gone: unmapping %s", node_id, self._maps[node_id][0])
            self._drop(node_id)
        return gone

    def mapped(self) -> dict[str, str]:
        """node_id → path of every open mapping."""
        return {n: path for n, (path, _, seg) in self._maps.items() if seg is not None}

    def _drop(self, node_id: str) -> None:
        cached = self._maps.pop(node_id, None)
        if cached is not None and cached[2] is not None:
            if self.on_close is not None:
                self.on_close(cached[2])
            cached[2].close()

    def close(self) -> None:
        for node_id in list(self._maps):
            self._drop(node_id)
