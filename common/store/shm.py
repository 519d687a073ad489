"""Node segments as files in /dev/shm: the node maps one, same-host clients map it too.

A worker then moves a block with one ``memmove`` (GIL released) instead of a TCP loopback
round trip. ``Segment.base`` is the address of the mapping in *this* process.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from typing import Optional, Sequence


class Segment:
    """A mapped region: a file in /dev/shm (``path``) or anonymous memory (``path=None``)."""

    def __init__(self, nbytes: int, path: Optional[str] = None, create: bool = False) -> None:
        self.nbytes = nbytes
        self.path = path
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        if path is None:
            self._mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
        else:
            fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
            try:
                if create:
                    try:  # reserve now: a full tmpfs fails here, not with SIGBUS on a write
                        os.posix_fallocate(fd, 0, nbytes)
                    except OSError:
                        os.unlink(path)
                        raise
                elif os.fstat(fd).st_size < nbytes:
                    raise OSError(f"{path} is smaller than {nbytes} bytes")
                self._mm = mmap.mmap(fd, nbytes, flags=flags)
            finally:
                os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.base = ctypes.addressof(self._anchor)
        if create or path is None:
            ctypes.memset(self.base, 0, nbytes)  # fault every page in now, not on first put

    def view(self, offset: int, size: int) -> memoryview:
        return memoryview(self._mm)[offset:offset + size]

    def close(self, unlink: bool = False) -> None:
        del self._anchor
        try:
            self._mm.close()
        except BufferError:  # a view is still alive; the mapping goes with the process
            pass
        if unlink and self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


def copy_many(jobs: Sequence[tuple[int, int, int]]) -> int:
    """``memmove(dst, src, n)`` for each job (runs GIL-free in a worker thread)."""
    total = 0
    for dst, src, n in jobs:
        ctypes.memmove(dst, src, n)
        total += n
    return total
