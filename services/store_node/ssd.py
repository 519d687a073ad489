"""The SSD tier of a store node: one file per object in a directory.

Runs on a single worker thread so that commands for one key keep their order
(offload, then perhaps drop). Capacity is accounted by the master; the node reports usage.
"""
from __future__ import annotations

import os
from typing import Optional

from common.store.shm import Segment


class SsdTier:
    def __init__(self, directory: Optional[str], capacity: int) -> None:
        self.directory = directory
        self.capacity = capacity if directory else 0
        self.used = 0
        if directory:
            os.makedirs(directory, exist_ok=True)
            for name in os.listdir(directory):  # a restarted node starts empty
                if name.endswith(".kv"):
                    os.unlink(os.path.join(directory, name))

    def _path(self, key: str) -> str:
        if not key.isalnum():
            raise ValueError(f"bad key {key!r}")
        assert self.directory is not None
        return os.path.join(self.directory, f"{key}.kv")

    def offload(self, seg: Segment, key: str, offset: int, size: int) -> bool:
        """Segment → file (written whole, then renamed into place)."""
        if not self.directory or offset + size > seg.nbytes:
            return False
        path = self._path(key)
        tmp = path + ".tmp"
        with open(tmp, "wb") as fh:
            fh.write(seg.view(offset, size))
        os.replace(tmp, path)
        self.used += size
        return True

    def promote(self, seg: Segment, key: str, offset: int, size: int) -> bool:
        """File → segment; the file stays (the object keeps its SSD copy)."""
        if not self.directory or offset + size > seg.nbytes:
            return False
        try:
            with open(self._path(key), "rb") as fh:
                return fh.readinto(seg.view(offset, size)) == size
        except FileNotFoundError:
            return False

    def drop(self, key: str) -> bool:
        if not self.directory:
            return False
        path = self._path(key)
        try:
            size = os.path.getsize(path)
            os.unlink(path)
        except FileNotFoundError:
            return False
        self.used -= size
        return True
