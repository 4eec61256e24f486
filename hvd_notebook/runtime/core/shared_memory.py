"""Ranks that all share one host meet in an MPI-3 shared-memory window.

Each rank has a board there: its latest (collective number, hash) and a small
data area. Agreeing on a collective is then a store and a few loads instead of
an MPI collective; and a small allreduce's data travels with its hash, so that
agreement and data movement take one meeting instead of two (every rank then
adds the others' data itself, in rank order, so that all get the same bits).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import config

_RETRACTED = -(1 << 63)  # no hash: hashes are 63-bit, and a [h, -h] exchange never carries it


class SharedMemoryBoard:
    """Each rank's latest (collective number, hash) and data, for ranks that all
    share one host. A rank posts its own and reads the others'; ``Win.Sync`` is
    the memory barrier between the stores and the loads. Two slots per rank, by
    the parity of the number: a rank waits for the others' post of the same
    number before it can post the next, so it is at most one ahead, and the slot
    being read is never the one being written."""

    SLOT = 8  # int64s per slot: one 64-byte cache line each
    DATA_BYTES = 64 * 1024  # the largest allreduce whose data travels with its hash
    VIEWS_KEPT = 256  # (dtype, count) pairs whose views are cached

    def __init__(self, comm: Any, MPI: Any) -> None:
        rank, size = comm.Get_rank(), comm.Get_size()
        slot_bytes = 2 * self.SLOT * 8
        self.win = MPI.Win.Allocate_shared(slot_bytes + 2 * self.DATA_BYTES, 8, comm=comm)
        memories = [self.win.Shared_query(r)[0] for r in range(size)]
        slots = [np.frombuffer(m, dtype=np.int64, count=2 * self.SLOT).reshape(2, self.SLOT) for m in memories]
        self.data = [np.frombuffer(m, dtype=np.uint8, count=2 * self.DATA_BYTES, offset=slot_bytes)
                     .reshape(2, self.DATA_BYTES) for m in memories]
        self.mine, self.rank = slots[rank], rank
        self._views: dict[tuple[np.dtype, int], list[list[np.ndarray]]] = {}
        self.mine[:] = 0
        self.others = [v for r, v in enumerate(slots) if r != rank]
        self.win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch, in which Win.Sync is a memory barrier
        self.win.Sync()
        comm.Barrier()
        self.win.Sync()

    @classmethod
    def for_comm(cls, comm: Any, MPI: Any) -> SharedMemoryBoard | None:
        """A board where every rank of ``comm`` is on this host (collective), else
        None; ``HVD_NOTEBOOK_SHM_AGREEMENT=0`` on any rank asks for the collective."""
        wanted = config.SHM_AGREEMENT.flag()
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        one_host = local.Get_size() == comm.Get_size() > 1
        local.Free()
        # every rank must take the same road
        if not comm.allreduce(wanted and one_host, op=MPI.LAND):
            return None
        return cls(comm, MPI)

    def views(self, dtype: np.dtype, count: int) -> list[list[np.ndarray]]:
        """Per parity, every rank's data area as ``count`` elements of ``dtype`` (cached)."""
        key = (dtype, count)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= self.VIEWS_KEPT:  # (a program of many sizes: start the cache afresh)
                self._views.clear()
            nbytes = count * dtype.itemsize
            views = self._views[key] = [[d[parity, :nbytes].view(dtype) for d in self.data] for parity in (0, 1)]
        return views

    def post(self, seq: int, h: int, data: np.ndarray | None = None) -> None:
        """Post this rank's hash for collective ``seq``, with ``data`` (at most
        ``DATA_BYTES``) where given."""
        parity = seq & 1
        if data is not None:
            self.views(data.dtype, data.size)[parity][self.rank][...] = data.reshape(-1) if data.ndim != 1 else data
        slot = self.mine[parity]
        slot[1] = h
        self.win.Sync()
        slot[0] = seq

    def retract(self, seq: int) -> None:
        """This rank left collective ``seq``, posted with data, before every rank arrived: a
        rank arriving later must not use the data of a call that ended, but find the ranks
        disagreeing (and wait in MPI, as it would for a call without data)."""
        self.mine[seq & 1, 1] = _RETRACTED
        self.win.Sync()

    def arrived(self, seq: int) -> bool:
        parity = seq & 1
        for other in self.others:
            if other[parity, 0] != seq:
                return False
        return True

    def same(self, seq: int, h: int) -> bool:
        """After ``arrived``: did every rank post the hash ``h``?"""
        self.win.Sync()
        parity = seq & 1
        for other in self.others:  # (a loop, not all() of a generator: this is on every small call's path)
            if other[parity, 1] != h:
                return False
        return True

    def add(self, seq: int, dtype: np.dtype, count: int, out: np.ndarray) -> np.ndarray:
        """After ``same``: the sum of every rank's posted data of collective ``seq``
        (``count`` elements of ``dtype``), added in rank order into ``out``."""
        views = self.views(dtype, count)[seq & 1]
        np.add(views[0], views[1], out=out)
        for view in views[2:]:
            np.add(out, view, out=out)
        return out
