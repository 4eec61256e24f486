"""The collectives on numpy arrays, with the MPI library's own collectives.

Everything here works on host memory (``Allreduce`` in place on a fused buffer,
``Allgatherv``, ``Bcast``, ``Alltoallv``, ``Reduce_scatter``): bandwidth-optimal
algorithms chosen by MPI, never a gather to one rank. ``tensorflow/mpi_ops.py`` wraps
these for TensorFlow tensors. Built from (communicator, negotiator, timeline);
``world.World`` owns one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import ops
from .collective_logic import AllreduceWork, alltoall_splits, refuse_dtype
from .fusion import ALIGN_BYTES, aligned_offsets, fused_label, fusion_groups, fusion_threshold, is_aligned, pool
from .negotiation import Negotiator
from .ops import Average, check_op, dtype_name, reduce_dtype
from .signatures import (
    AllreduceCall,
    Signature,
    allgather_object_signature,
    allgather_signature,
    allreduce_signature,
    alltoall_signature,
    broadcast_object_signature,
    broadcast_signature,
    reducescatter_signature,
)
from .timeline import Timeline

__all__ = ["ALIGN_BYTES", "MpiBackend", "alltoall_splits"]


def _bytes(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def _displacements(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)[:-1]])


class _CachedCall:
    """What a single-tensor allreduce of one shape, dtype and arguments needs, worked out once."""

    __slots__ = ("signature", "hash", "mpi_op", "factors")

    def __init__(self, signature: Any, hash: int, mpi_op: Any, factors: tuple) -> None:
        self.signature, self.hash = signature, hash
        self.mpi_op = mpi_op  # None: MPI's result needs more than in-place scaling (the general path's work)
        self.factors = factors  # in-place multiplications after the sum (average, postscale)


class SingleTensorAllreduce:
    """The common case, one tensor, with everything that depends only on its
    shape, dtype and arguments cached (validation, signature, its hash): the
    same work as the fused path for one array, minus Python."""

    def __init__(self, backend: MpiAllreduce) -> None:
        self.backend = backend
        self.comm, self.negotiator, self.timeline = backend.comm, backend.negotiator, backend.timeline
        self.calls: dict[tuple, _CachedCall] = {}
        board = self.negotiator.board
        # an allreduce this small sums on the board of a one-host world (``shared_memory``)
        self.board_bytes = board.DATA_BYTES if board is not None else -1
        self.board_op = backend.MPI.SUM

    def _prepare(self, arr: np.ndarray, op: int, prescale: float, postscale: float) -> _CachedCall | None:
        if (op not in self.backend.mpi_ops or prescale != 1.0 or reduce_dtype(arr.dtype) != arr.dtype
                or ops.dtype_refusal(arr.dtype, reducing=True)):
            return None
        backend = self.backend
        sig = allreduce_signature(op, dtype_name(arr.dtype), (arr.shape,), prescale, postscale, "")
        factors = ((1.0 / backend.size,) if op == Average else ()) + ((postscale,) if postscale != 1.0 else ())
        scaled_in_place = not factors or arr.dtype.kind == "f"  # as ops.scale scales floats
        return _CachedCall(sig, backend.negotiator.hash_of(sig), backend.mpi_ops[op] if scaled_in_place else None,
                           tuple(arr.dtype.type(f) for f in factors))

    def allreduce(self, arr: np.ndarray, op: int, prescale: float, postscale: float, label: str) -> np.ndarray | None:
        """The reduced array, of ``arr``'s shape, in a pooled buffer; None (before any
        communication) where the general path must take it: a dtype MPI cannot
        reduce, a prescale, an op it does not know, or other calls waiting."""
        key = (arr.shape, arr.dtype, op, prescale, postscale)
        call = self.calls.get(key)
        if call is None:
            call = self._prepare(arr, op, prescale, postscale)
            if call is None:
                return None
            self.calls[key] = call
        timeline, negotiator = self.timeline, self.negotiator
        # (whether data goes on the board may depend only on what every rank agrees on: size, dtype, op)
        on_board = arr.nbytes <= self.board_bytes and call.mpi_op is self.board_op
        shared = negotiator.acquire(call.signature, True, call.hash, label, arr if on_board else None, lone=True)
        if shared is None:  # other calls wait: the general path, where this one may share their MPI call
            return None
        try:
            if not shared and (call.mpi_op is None or not arr.flags.c_contiguous):
                return self.backend.reduce([arr], op, prescale, postscale, label)[0].reshape(arr.shape)
            buf = pool.get(arr.nbytes).view(arr.dtype)
            if shared:  # (the agreement brought every rank's data: add it up here)
                if timeline.path is None:
                    negotiator.add_shared(arr.dtype, arr.size, buf)
                else:
                    with timeline.phase("SHM_ALLREDUCE", label, arr.nbytes):
                        negotiator.add_shared(arr.dtype, arr.size, buf)
            elif timeline.path is None:
                self.comm.Allreduce(arr, buf, op=call.mpi_op)
            else:
                with timeline.phase("MPI_ALLREDUCE", label, arr.nbytes):
                    self.comm.Allreduce(arr, buf, op=call.mpi_op)
        finally:
            negotiator.release()
        if arr.ndim != 1:
            buf = buf.reshape(arr.shape)
        for factor in call.factors:
            buf *= factor
        return buf


def pack(arrays: list[np.ndarray], work: np.dtype, timeline: Timeline, label: str) -> tuple[np.ndarray, list[int]]:
    """Copy ``arrays`` into one pooled buffer of dtype ``work``, each starting 64-byte
    aligned (padding zeroed); return it and each array's element offset."""
    # offsets aligned for the narrower of the two dtypes the buffer will hold
    offsets, total = aligned_offsets([a.size for a in arrays], min(work.itemsize, arrays[0].dtype.itemsize))
    buf = pool.empty(total, work)
    with timeline.phase("MEMCPY_IN_FUSION_BUFFER", label, buf.nbytes):
        if total == sum(a.size for a in arrays):  # no padding needed: one C call copies them all, flattened
            np.concatenate(arrays, axis=None, out=buf, casting="same_kind")
            return buf, offsets
        end = 0
        for a, off in zip(arrays, offsets):
            if off > end:
                buf[end:off] = 0
            buf[off:off + a.size] = a.reshape(-1)
            end = off + a.size
    return buf, offsets


def _as_result(buf: np.ndarray, dtype: np.dtype, op: int, timeline: Timeline, label: str) -> np.ndarray:
    """A reduced buffer in the result's dtype (back from float32 for half precision), aligned."""
    if buf.dtype != dtype:
        with timeline.phase("MEMCPY_OUT_FUSION_BUFFER", label, buf.nbytes):
            half = pool.empty(buf.size, dtype)
            half[:] = buf
            return half
    if not is_aligned(buf):  # integers averaged into a new array
        aligned = pool.empty(buf.size, buf.dtype)
        aligned[:] = buf
        return aligned
    return buf


class MpiAllreduce:
    """The host allreduces of one world: arrays of one dtype fused into buffers of up to
    ``HOROVOD_FUSION_THRESHOLD`` bytes, one ``Allreduce`` each, and the cached single-tensor path.

    Args:
        comm: the world's MPI communicator.
        negotiator: the agreement every rank's call takes its turn in.
        timeline: where each phase is recorded.
    """

    def __init__(self, comm: Any, negotiator: Negotiator, timeline: Timeline) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.comm, self.negotiator, self.timeline = comm, negotiator, timeline
        self.size = comm.Get_size()
        self.mpi_ops = {ops.Sum: MPI.SUM, ops.Average: MPI.SUM, ops.Min: MPI.MIN, ops.Max: MPI.MAX,
                        ops.Product: MPI.PROD}
        self.single = SingleTensorAllreduce(self)

    def allreduce(self, arrays: list[np.ndarray], op: int, prescale: float, postscale: float,
                  names: list[str]) -> list[np.ndarray]:
        """Reduce each array over all ranks; arrays of one dtype are fused into
        buffers of up to ``HOROVOD_FUSION_THRESHOLD`` bytes, one MPI call each."""
        results: list[np.ndarray | None] = [None] * len(arrays)
        for group, buf, offsets in self.allreduce_fused(arrays, op, prescale, postscale, names):
            with self.timeline.phase("MEMCPY_OUT_FUSION_BUFFER", fused_label([names[i] for i in group]), buf.nbytes):
                for i, off in zip(group, offsets):
                    results[i] = buf[off:off + arrays[i].size].reshape(arrays[i].shape)
        return results  # type: ignore[return-value]

    def allreduce_fused(self, arrays: list[np.ndarray], op: int, prescale: float, postscale: float,
                        names: list[str], shapes: tuple | None = None) -> list[tuple[list[int], np.ndarray, list[int]]]:
        """Like ``allreduce`` but returns, per fusion buffer, the indices of the
        arrays in it, the reduced 1-D buffer and each array's element offset.
        ``shapes`` replaces the arrays' own shapes in the agreement check (for a
        buffer that TensorFlow packed from tensors of these shapes)."""
        check_op(op)
        if len(arrays) == 1 and (shapes is None or len(shapes) == 1):
            shape = arrays[0].shape if shapes is None else shapes[0]
            if shape is not None and None not in shape:  # (a graph's dynamic shape takes the general path)
                one = self.single.allreduce(arrays[0].reshape(shape), op, prescale, postscale, names[0])
                if one is not None:
                    return [([0], one.reshape(-1), [0])]
        out = []
        for group in self.fusion_plan(arrays):
            members = [arrays[i] for i in group]
            label = fused_label([names[i] for i in group])
            sig = allreduce_signature(op, dtype_name(members[0].dtype), shapes or tuple(a.shape for a in members),
                                      prescale, postscale, label)
            refuse_dtype(self.negotiator, sig, "allreduce", label, members[0].dtype, reducing=True)
            work = AllreduceWork(self, members, op, prescale, postscale, label)
            self.negotiator.run(sig, work, allow_joined=True)
            out.append((group, *work.result))
        return out

    def allreduce_one(self, arr: np.ndarray, op: int, prescale: float, postscale: float,
                      label: str) -> np.ndarray | None:
        """One array through the cached single-tensor path (see ``SingleTensorAllreduce``)."""
        return self.single.allreduce(arr, op, prescale, postscale, label)

    @staticmethod
    def fusion_plan(arrays: list[np.ndarray]) -> list[list[int]]:
        """Which arrays share a fusion buffer (``fusion.fusion_groups`` by dtype and bytes)."""
        dtype, threshold = arrays[0].dtype, fusion_threshold()
        if threshold > 0 and all(a.dtype == dtype for a in arrays) and sum(a.nbytes for a in arrays) <= threshold:
            return [list(range(len(arrays)))]  # the common case, without a pass per array in Python
        return fusion_groups([(a.dtype.str, a.nbytes) for a in arrays])

    def reduce(self, arrays: list[np.ndarray], op: int, prescale: float, postscale: float,
               label: str) -> tuple[np.ndarray, list[int]]:
        """The data movement of one agreed (fused) allreduce into a pooled buffer whose
        tensors each start at a 64-byte aligned offset, so that every result can
        become a TensorFlow tensor without a copy.

        A single tensor of a type MPI reduces is reduced straight from its own
        memory into the buffer (out of place: no copy at all); several tensors
        are copied into the buffer and reduced in place."""
        dtype = arrays[0].dtype
        work = reduce_dtype(dtype)
        mpi_op = self.mpi_ops[op]
        if len(arrays) == 1 and work == dtype and prescale == 1.0 and arrays[0].flags.c_contiguous:
            src = arrays[0]
            offsets, buf = [0], pool.empty(src.size, dtype)
            with self.timeline.phase("MPI_ALLREDUCE", label, buf.nbytes):
                self.comm.Allreduce(src.reshape(-1) if src.ndim != 1 else src, buf, op=mpi_op)
        else:
            buf, offsets = pack(arrays, work, self.timeline, label)
            if prescale != 1.0:
                buf = ops.scale(buf, prescale)
            with self.timeline.phase("MPI_ALLREDUCE", label, buf.nbytes):
                self.comm.Allreduce(self.MPI.IN_PLACE, buf, op=mpi_op)
        buf = ops.finish_reduction(buf, op, self.size, postscale)
        return _as_result(buf, dtype, op, self.timeline, label), offsets

    def allreduce_zeros(self, call: AllreduceCall) -> None:
        """Take part with zeros in the other ranks' allreduce (after ``hvd.join()``)."""
        dtype = ops.numpy_dtype(call.dtype)
        zeros = [np.zeros(shape, dtype=dtype) for shape in call.shapes]
        self.reduce(zeros, call.op, call.prescale, call.postscale, "join")


class MpiBackend:
    """The host collectives of one world; its allreduces are ``MpiAllreduce``'s.

    Args:
        comm: the world's MPI communicator.
        negotiator: the agreement every rank's call takes its turn in.
        timeline: where each phase is recorded.
    """

    def __init__(self, comm: Any, negotiator: Negotiator, timeline: Timeline) -> None:
        self.allreduces = MpiAllreduce(comm, negotiator, timeline)
        self.MPI, self.mpi_ops = self.allreduces.MPI, self.allreduces.mpi_ops
        self.comm, self.negotiator, self.timeline = comm, negotiator, timeline
        self.rank, self.size = comm.Get_rank(), self.allreduces.size

    # ------------------------------------------------------------ allreduce (MpiAllreduce's)
    def allreduce(self, arrays: list[np.ndarray], op: int, prescale: float, postscale: float,
                  names: list[str]) -> list[np.ndarray]:
        """Reduce each array over all ranks, fused (``MpiAllreduce.allreduce``)."""
        return self.allreduces.allreduce(arrays, op, prescale, postscale, names)

    def allreduce_fused(self, arrays: list[np.ndarray], op: int, prescale: float, postscale: float,
                        names: list[str], shapes: tuple | None = None) -> list[tuple[list[int], np.ndarray, list[int]]]:
        """Per fusion buffer: its arrays' indices, the reduced buffer, their offsets (``MpiAllreduce``'s)."""
        return self.allreduces.allreduce_fused(arrays, op, prescale, postscale, names, shapes)

    def allreduce_one(self, arr: np.ndarray, op: int, prescale: float, postscale: float,
                      label: str) -> np.ndarray | None:
        """One array through the cached single-tensor path (see ``SingleTensorAllreduce``)."""
        return self.allreduces.allreduce_one(arr, op, prescale, postscale, label)

    def allreduce_zeros(self, call: AllreduceCall) -> None:
        """Take part with zeros in the other ranks' allreduce (after ``hvd.join()``)."""
        self.allreduces.allreduce_zeros(call)

    # ------------------------------------------------------------ allgather
    def allgather(self, arrays: list[np.ndarray], names: list[str]) -> list[np.ndarray]:
        """Concatenate each array over ranks along its first dimension (which may differ)."""
        label = names[0] if len(names) == 1 else f"{names[0]} +{len(names) - 1} grouped"
        sig = allgather_signature(tuple(a.dtype.name for a in arrays), tuple(a.shape[1:] for a in arrays), label)
        for arr, name in zip(arrays, names):
            if arr.ndim == 0:
                self.negotiator.refuse(sig, f"allgather of '{name}': the tensor needs at least one dimension "
                                       "(it is a scalar).")
            refuse_dtype(self.negotiator, sig, "allgather", name, arr.dtype)
        with self.negotiator.turn(sig):
            rows = np.array([a.shape[0] for a in arrays], dtype=np.int64)
            all_rows = np.empty((self.size, len(arrays)), dtype=np.int64)
            self.comm.Allgather(rows, all_rows)
            outs = []
            with self.timeline.phase("MPI_ALLGATHER", label, sum(a.nbytes for a in arrays)):
                for i, arr in enumerate(arrays):
                    row_bytes = int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.dtype.itemsize
                    counts = all_rows[:, i] * row_bytes
                    out = np.empty((int(all_rows[:, i].sum()),) + arr.shape[1:], dtype=arr.dtype)
                    self.comm.Allgatherv(_bytes(arr), [out.reshape(-1).view(np.uint8), counts, _displacements(counts),
                                                       self.MPI.BYTE])
                    outs.append(out)
        return outs

    # ------------------------------------------------------------ broadcast
    def broadcast(self, arrays: list[np.ndarray], root_rank: int, names: list[str]) -> list[np.ndarray]:
        """Every rank gets root_rank's arrays; all arrays travel in one fused buffer."""
        label = fused_label(names)
        sig = broadcast_signature(root_rank, tuple(a.dtype.name for a in arrays), tuple(a.shape for a in arrays), label)
        self.check_root(root_rank, sig)
        for a, name in zip(arrays, names):
            refuse_dtype(self.negotiator, sig, "broadcast", name, a.dtype)
        nbytes = sum(a.nbytes for a in arrays)
        buf = np.empty(nbytes, dtype=np.uint8)
        if self.rank == root_rank:
            offset = 0
            for a in arrays:
                buf[offset:offset + a.nbytes] = _bytes(a)
                offset += a.nbytes
        with self.negotiator.turn(sig), self.timeline.phase("MPI_BROADCAST", label, nbytes):
            self.comm.Bcast(buf, root=root_rank)
        outs, offset = [], 0
        for a in arrays:
            outs.append(buf[offset:offset + a.nbytes].view(a.dtype).reshape(a.shape).copy())
            offset += a.nbytes
        return outs

    def check_root(self, root_rank: int, sig: Signature) -> None:
        """Raise on every rank unless ``root_rank`` is a rank of this world."""
        if not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < self.size:
            self.negotiator.refuse(sig, f"root_rank={root_rank!r} is not a rank: use 0..{self.size - 1}.")

    # ------------------------------------------------------------- alltoall
    def alltoall(self, arr: np.ndarray, splits: np.ndarray | None, name: str) -> tuple[np.ndarray, np.ndarray]:
        """Send rows ``splits[r]`` of ``arr`` to rank r; return what arrived and from whom how many rows."""
        sig = alltoall_signature(arr.dtype.name, arr.shape[1:], name)
        try:
            splits = alltoall_splits(arr.shape, splits, self.size, name)
        except ValueError as exc:
            self.negotiator.refuse(sig, str(exc))
        refuse_dtype(self.negotiator, sig, "alltoall", name, arr.dtype)
        with self.negotiator.turn(sig):
            received = np.empty(self.size, dtype=np.int64)
            self.comm.Alltoall(splits, received)
            row_bytes = int(np.prod(arr.shape[1:], dtype=np.int64)) * arr.dtype.itemsize
            out = np.empty((int(received.sum()),) + arr.shape[1:], dtype=arr.dtype)
            send_counts, recv_counts = splits * row_bytes, received * row_bytes
            with self.timeline.phase("MPI_ALLTOALL", name, arr.nbytes):
                self.comm.Alltoallv([_bytes(arr), send_counts, _displacements(send_counts), self.MPI.BYTE],
                                    [out.reshape(-1).view(np.uint8), recv_counts, _displacements(recv_counts),
                                     self.MPI.BYTE])
        return out, received

    # -------------------------------------------------------- reducescatter
    def reducescatter(self, arrays: list[np.ndarray], op: int, names: list[str]) -> list[np.ndarray]:
        """Reduce over ranks, then give rank r its block of rows (``ops.even_rows``)."""
        outs = []
        for arr, name in zip(arrays, names):
            sig = reducescatter_signature(op, arr.dtype.name, arr.shape, name)
            refusal = ops.op_refusal(op, what="hvd.reducescatter")
            if refusal is not None:
                self.negotiator.refuse(sig, refusal)
            if arr.ndim == 0:
                self.negotiator.refuse(sig, f"reducescatter of '{name}': the tensor needs at least one dimension.")
            refuse_dtype(self.negotiator, sig, "reducescatter", name, arr.dtype, reducing=True)
            rows = ops.even_rows(arr.shape[0], self.size)
            row_elems = int(np.prod(arr.shape[1:], dtype=np.int64))
            work = reduce_dtype(arr.dtype)
            send = np.ascontiguousarray(arr, dtype=work).reshape(-1)
            out = np.empty(rows[self.rank] * row_elems, dtype=work)
            with self.negotiator.turn(sig), self.timeline.phase("MPI_REDUCESCATTER", name, arr.nbytes):
                self.comm.Reduce_scatter(send, out, [r * row_elems for r in rows], op=self.mpi_ops[op])
            if op == Average:
                out = ops.average(out, self.size)
            outs.append(out.reshape((rows[self.rank],) + arr.shape[1:]).astype(arr.dtype, copy=False))
        return outs

    # --------------------------------------------------------------- others
    def broadcast_object(self, obj: Any, root_rank: int, name: str) -> Any:
        sig = broadcast_object_signature(root_rank, name)
        self.check_root(root_rank, sig)
        with self.negotiator.turn(sig):
            return self.comm.bcast(obj, root=root_rank)

    def allgather_object(self, obj: Any, name: str) -> list[Any]:
        with self.negotiator.turn(allgather_object_signature(name)):
            return self.comm.allgather(obj)
