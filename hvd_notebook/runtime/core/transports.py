"""The two seams of ``array_backend``: an array module with its call context (``Device``) and a transport
that moves flat buffers between the ranks (``Transport``); here their host implementations, numpy and
mpi4py. ``nccl_backend`` has the GPU's: cupy and NCCL.

A transport's collectives are NCCL's: equal blocks on every rank, one dtype per buffer, data only (host
metadata, such as how many rows each rank has, travels on the MPI communicator of the backend). The host
transport keeps to them on purpose, so that the CPU tests run every line the GPU path runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from . import ops


class Device(Protocol):
    """Where the arrays live: their array module and the context every call runs in."""

    xp: Any  # the array module: numpy, cupy

    def call(self, order_in: Callable[[], None] | None) -> contextlib.AbstractContextManager:
        """The context of one collective call: on entering, the call's work is ordered behind what
        ``order_in`` waits for (None: the caller's own stream, no wait); on leaving, its results are
        complete for the caller, with at most one host wait."""


class Transport(Protocol):
    """The data movement of one communicator on flat contiguous buffers (NCCL's collectives)."""

    via: str  # the road every rank's signature names (a joined rank serves an allreduce on the same one)
    phase: str  # how the timeline names its calls: "NCCL" gives NCCL_ALLREDUCE, NCCL_ALLGATHER, ...
    size: int
    rank: int

    def array_dtype(self, name: str) -> np.dtype:
        """The dtype of the arrays that a signature's dtype ``name`` arrives in (a joined rank's zeros)."""

    def work_dtype(self, dtype: np.dtype) -> np.dtype:
        """The dtype an array of ``dtype`` is reduced in (the transport's widening of half precision)."""

    def refusal(self, dtype: np.dtype, reducing: bool) -> str | None:
        """Why this transport cannot move (or reduce) ``dtype``; None where it can."""

    def allreduce(self, send: Any, recv: Any, op: int) -> None:
        """``recv`` = ``send`` reduced over the ranks (``send is recv``: in place)."""

    def allgather(self, send: Any, recv: Any) -> None:
        """``recv`` = every rank's ``send`` in rank order (``size * send.size`` elements)."""

    def broadcast(self, buf: Any, root: int) -> None:
        """``buf`` = ``root``'s ``buf``."""

    def reduce_scatter(self, send: Any, recv: Any, op: int) -> None:
        """``recv`` = block ``rank`` of ``send`` (``size`` equal blocks) reduced over the ranks."""

    def alltoall(self, send: Any, recv: Any) -> None:
        """Block r of ``send`` to rank r; block r of ``recv`` from rank r (equal blocks)."""

    def free(self) -> None:
        """Release the communicator (collective)."""


class HostDevice:
    """numpy arrays in host memory: nothing to order, nothing to wait for."""

    xp = np

    def call(self, order_in: Callable[[], None] | None) -> contextlib.AbstractContextManager:
        return _NO_CONTEXT


_NO_CONTEXT = contextlib.nullcontext()


class MpiTransport:
    """numpy buffers through the MPI library's equal-block collectives (``Allreduce``, ``Allgather``,
    ``Bcast``, ``Reduce_scatter_block``, ``Alltoall``), half precision reduced as float32 (MPI has no
    half-precision types).

    Args:
        comm: an mpi4py communicator of its own (a ``Dup``): no other call may use it meanwhile.
        via: the name the signatures give this road.
    """

    def __init__(self, comm: Any, via: str = "MPI-arrays") -> None:
        from mpi4py import MPI

        self.MPI, self.comm, self.via = MPI, comm, via
        self.size, self.rank = comm.Get_size(), comm.Get_rank()
        self.ops = {ops.Sum: MPI.SUM, ops.Average: MPI.SUM, ops.Min: MPI.MIN, ops.Max: MPI.MAX,
                    ops.Product: MPI.PROD}

    phase = "MPI"

    def array_dtype(self, name: str) -> np.dtype:
        return ops.numpy_dtype(name)

    def work_dtype(self, dtype: np.dtype) -> np.dtype:
        return ops.reduce_dtype(dtype)

    def refusal(self, dtype: np.dtype, reducing: bool) -> str | None:
        return None  # (every dtype ops takes: bytes, or widened half precision)

    def allreduce(self, send: Any, recv: Any, op: int) -> None:
        self.comm.Allreduce(self.MPI.IN_PLACE if send is recv else send, recv, op=self.ops[op])

    def allgather(self, send: Any, recv: Any) -> None:
        self.comm.Allgather(send, recv)

    def broadcast(self, buf: Any, root: int) -> None:
        self.comm.Bcast(buf, root=root)

    def reduce_scatter(self, send: Any, recv: Any, op: int) -> None:
        self.comm.Reduce_scatter_block(send, recv, op=self.ops[op])

    def alltoall(self, send: Any, recv: Any) -> None:
        self.comm.Alltoall(send, recv)

    def free(self) -> None:
        self.comm.Free()

