"""Strided host → GPU copies by the copy engine: the driver's ``cuMemcpy2DAsync``.

A stored prefix lands layer by layer: layer l of every store object is a 64 KiB piece (an
8B model) at a fixed pitch in the store node's segment, 922 of them for 90 % of a 16k
prompt. A copy per piece costs a launch each (29,504 per prompt); a gather kernel over the
pinned mapping reads host memory at ~22 GB/s and takes SMs from the compute it overlaps.
One 2D copy moves a run of pieces at a constant pitch (objects the store placed one after
another) by DMA, at the link's rate, in one call. torch has no 2D copy, so this calls the
CUDA driver (``libcuda``, loaded in every CUDA process) through ctypes; ``usable`` checks
it once per device against a plain copy and says no (the caller uses kernels) if anything
differs or fails.

``runs`` (pure numpy, tested on the CPU) groups pieces into such runs.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from typing import Optional

import numpy as np

log = logging.getLogger(__name__)

_HOST, _DEVICE = 1, 2  # CUmemorytype


class _Memcpy2D(ctypes.Structure):
    """``CUDA_MEMCPY2D`` (cuda.h)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int), ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int), ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


MAX_PITCH = 1 << 30  # a 2D copy's pitch stays under the driver's limit (2^31 on GPUs today)


def runs(offsets: np.ndarray, width: int) -> list[tuple[int, int, int, int]]:
    """Pieces of ``width`` bytes at source ``offsets`` (in order) → runs ``(first piece,
    count, first offset, pitch)``: consecutive pieces whose offsets step by one constant
    pitch from ``width`` to ``MAX_PITCH`` (a 2D copy's rows). A run of one piece has pitch
    ``width``."""
    out: list[tuple[int, int, int, int]] = []
    n = len(offsets)
    i = 0
    steps = np.diff(offsets)
    while i < n:
        j = i + 1
        if j < n and width <= steps[i] <= MAX_PITCH:
            pitch = int(steps[i])
            while j < n and int(steps[j - 1]) == pitch:
                j += 1
        else:
            pitch = width
        out.append((i, j - i, int(offsets[i]), pitch))
        i = j
    return out


class Copier2D:
    """``cuMemcpy2DAsync`` from pinned host memory to device memory on a given stream."""

    def __init__(self) -> None:
        self._cuda = ctypes.CDLL("libcuda.so.1")
        self._copy = self._cuda.cuMemcpy2DAsync_v2
        self._copy.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
        self._copy.restype = ctypes.c_int
        self._ctx: dict[int, ctypes.c_void_p] = {}

    def _bind(self, device: int) -> None:
        """This thread's current context is the device's primary one (torch's)."""
        current = ctypes.c_void_p()
        self._check(self._cuda.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value:
            return
        if device not in self._ctx:
            ctx = ctypes.c_void_p()
            self._check(self._cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), device),
                        "cuDevicePrimaryCtxRetain")
            self._ctx[device] = ctx
        self._check(self._cuda.cuCtxSetCurrent(self._ctx[device]), "cuCtxSetCurrent")

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed (CUresult {rc})")

    def host_to_device(self, device: int, dst: int, dst_pitch: int, src: int, src_pitch: int,
                       width: int, height: int, stream: int) -> None:
        """Rows ``i < height`` of ``width`` bytes: host ``src + i * src_pitch`` → device
        ``dst + i * dst_pitch``, queued on ``stream``. Raises RuntimeError."""
        self._bind(device)
        p = _Memcpy2D(srcMemoryType=_HOST, srcHost=src, srcPitch=src_pitch,
                      dstMemoryType=_DEVICE, dstDevice=dst, dstPitch=dst_pitch,
                      WidthInBytes=width, Height=height)
        self._check(self._copy(ctypes.byref(p), stream), "cuMemcpy2DAsync")


_lock = threading.Lock()
_usable: dict[int, Optional[Copier2D]] = {}


def usable(device: "object") -> Optional[Copier2D]:
    """A ``Copier2D`` for this CUDA device, checked once: a strided pinned buffer copied in
    one 2D call must equal the same rows copied by torch. None where it is not (no driver
    library, an error, different bytes): the caller uses kernels."""
    import torch

    index = torch.device(device).index or 0
    with _lock:
        if index in _usable:
            return _usable[index]
        copier: Optional[Copier2D] = None
        try:
            candidate = Copier2D()
            width, pitch, height = 4096, 3 * 4096, 7
            src = torch.randint(0, 255, (pitch * height,), dtype=torch.uint8).pin_memory()
            dst = torch.zeros(width * height, dtype=torch.uint8, device=device)
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                candidate.host_to_device(index, dst.data_ptr(), width, src.data_ptr(), pitch,
                                         width, height, stream.cuda_stream)
            stream.synchronize()
            want = src.view(height, pitch)[:, :width].reshape(-1).to(device)
            if torch.equal(dst, want):
                copier = candidate
            else:
                log.warning("2D copies: the check copied different bytes; using kernels")
        except (OSError, AttributeError, RuntimeError) as exc:
            log.warning("2D copies unavailable (%s); using kernels", exc)
        _usable[index] = copier
        return copier
