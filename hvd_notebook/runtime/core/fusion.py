"""Tensor fusion: which tensors share a buffer, where each sits in it, and the
pool of aligned buffers that results live in."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from ... import config

ALIGN_BYTES = 64  # TensorFlow adopts host memory without a copy only when 64-byte aligned


def cycle_time_s() -> float:
    """Seconds a round waits for more requests before it is agreed, from ``HOROVOD_CYCLE_TIME`` (ms)."""
    return max(0.0, float(config.CYCLE_TIME.number())) / 1000.0


def fusion_threshold() -> int:
    """Bytes per fusion buffer, from ``HOROVOD_FUSION_THRESHOLD`` (0: no fusion)."""
    return int(config.FUSION_THRESHOLD.number())


def fusion_groups(items: list[tuple[Any, int]]) -> list[list[int]]:
    """Indices of ``(dtype, nbytes)`` items grouped by dtype, in order, each
    group's bytes within ``HOROVOD_FUSION_THRESHOLD`` (one tensor per group at 0)."""
    threshold = fusion_threshold()
    groups: list[list[int]] = []
    open_group: dict[Any, tuple[list[int], int]] = {}
    for i, (key, nbytes) in enumerate(items):
        members, total = open_group.get(key, ([], 0))
        if members and (threshold <= 0 or total + nbytes > threshold):
            members, total = [], 0
        if not members:
            groups.append(members)
        members.append(i)
        open_group[key] = (members, total + nbytes)
    return groups


def fused_label(names: list[str]) -> str:
    """How the timeline names a fusion buffer: its first tensor and how many more."""
    return names[0] if len(names) == 1 else f"{names[0]} +{len(names) - 1} fused"


def aligned_offsets(sizes: list[int], itemsize: int) -> tuple[list[int], int]:
    """Element offsets of each tensor in a fusion buffer, each on a 64-byte boundary,
    and the buffer's length in elements."""
    step = max(1, ALIGN_BYTES // itemsize)
    offsets, end = [], 0
    for n in sizes:
        start = -(-end // step) * step
        offsets.append(start)
        end = start + n
    return offsets, end


def is_aligned(array: np.ndarray) -> bool:
    """Does the array's data start on a 64-byte boundary?"""
    return array.__array_interface__["data"][0] % ALIGN_BYTES == 0


class BufferPool:
    """Aligned result buffers, reused once nothing refers to them any more.

    A fresh buffer costs page faults on first touch. Results are handed out as
    views of pooled buffers; a TensorFlow tensor adopted through DLPack keeps
    its view, and so the buffer, referenced. A buffer whose only reference is
    the pool's own is free.
    """

    def __init__(self, max_bytes: int = 512 * 1024 * 1024, per_size: int = 4) -> None:
        self.max_bytes, self.per_size = max_bytes, per_size
        self.buffers: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}  # nbytes: [(owner, aligned view)]
        self.total = 0

    def get(self, nbytes: int) -> np.ndarray:
        """A free aligned buffer of ``nbytes`` (uint8), from the pool where one is
        free. Use a view of it (``.view(dtype)``), never the array itself: the pool
        sees a buffer in use by the views that refer to its memory."""
        # numpy points every view at the array that owns the memory (``raw``), so a
        # live view, or a tensor that adopted one, shows as an extra reference to it
        candidates = self.buffers.get(nbytes, ())
        for raw, aligned in candidates:
            if sys.getrefcount(raw) == 4:  # the pool's tuple, ``aligned``, this loop variable, getrefcount's argument
                return aligned
        raw = np.empty(nbytes + ALIGN_BYTES, dtype=np.uint8)
        start = -raw.__array_interface__["data"][0] % ALIGN_BYTES
        aligned = raw[start:start + nbytes]
        if self.total + nbytes <= self.max_bytes and len(candidates) < self.per_size:
            self.buffers.setdefault(nbytes, []).append((raw, aligned))
            self.total += nbytes
        return aligned

    def empty(self, size: int, dtype: Any) -> np.ndarray:
        """An uninitialised 1-D array of ``size`` elements whose data starts on a 64-byte boundary."""
        dtype = np.dtype(dtype)
        return self.get(size * dtype.itemsize).view(dtype)


pool = BufferPool()  # one per process: results outlive worlds (a tensor may hold one after shutdown)
