"""Other processes' node segments mapped here: one mapping per segment file, per epoch.

Same-host readers and writers (the store client, a node copying a hot replica from another
node) move bytes with one ``memmove`` through a mapping of the node's /dev/shm file instead
of the transfer engine. A node that re-registers gets a fresh segment and a new ``epoch``
from the master: the cached mapping is then replaced. A file this host cannot open is
remembered as ``None`` for that epoch, so the caller falls back to the transfer engine
without trying again on every block.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

from common.store.shm import Segment

log = logging.getLogger(__name__)


class SegmentMaps:
    """Node info (``shm_path``, ``segment_bytes``, ``epoch``) → this process's mapping."""

    def __init__(self, own_path: Optional[str] = None) -> None:
        self.own_path = own_path  # never map our own segment a second time
        self._maps: dict[str, tuple[int, Optional[Segment]]] = {}  # path → (epoch, map)

    def get(self, info: dict[str, Any]) -> Optional[Segment]:
        """The node's segment mapped here, or None: no file, not openable, or our own."""
        path = info.get("shm_path")
        if not path or path == self.own_path:
            return None
        epoch = info.get("epoch", 0)
        cached = self._maps.get(path)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        seg: Optional[Segment] = None
        if os.path.exists(path):
            try:
                seg = Segment(int(info["segment_bytes"]), path)
            except (OSError, ValueError) as exc:
                log.info("cannot map %s (%s): using the transfer engine", path, exc)
        self._maps[path] = (epoch, seg)
        return seg

    def close(self) -> None:
        for _, seg in self._maps.values():
            if seg is not None:
                seg.close()
        self._maps.clear()
