"""The collectives on the arrays of one device, written once over two seams (``transports``): an array
module with its call context (numpy on the host; cupy on a GPU) and a transport that moves flat buffers
(mpi4py's equal-block collectives on the host; NCCL on a GPU, ``nccl_backend``).

Each call packs its arrays with one ``concatenate`` (half precision widened there where the transport
needs it, padding included), makes one transport call, and hands back views of the result. Allreduces
take the coordinator's ``Work`` (``collective_logic.AllreduceWork``), so that the allreduces agreed in one
round share one transport call; the refusals, the agreement and its errors are the MPI backend's. Host
metadata (how many rows each rank gathers or sends) travels on the MPI communicator, never the device's
data. On a GPU the device's call context waits on the host at most once per call (``nccl_backend``).
Built from (communicator, negotiator, timeline, device, transport); ``nccl_backend.start`` builds the GPU's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from . import ops
from .collective_logic import AllreduceWork, alltoall_splits, refuse_dtype
from .fusion import ALIGN_BYTES, aligned_offsets, fused_label, fusion_groups
from .negotiation import Negotiator
from .signatures import (
    AllreduceCall,
    Signature,
    allgather_signature,
    allreduce_signature,
    alltoall_signature,
    broadcast_signature,
    reducescatter_signature,
)
from .timeline import Timeline
from .transports import Device, Transport

OrderIn = Callable[[], None] | None  # what a call's work must wait for (None: the caller's own stream)


def _row_elements(array: Any) -> int:
    return int(np.prod(array.shape[1:], dtype=np.int64))


def _round_up(nbytes: int) -> int:
    """``nbytes`` rounded up to a 64-byte boundary (each rank's block starts aligned: cupy views need it)."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


class ArrayAllreduce:
    """The allreduces: each dtype's arrays packed into one buffer (up to ``HOROVOD_FUSION_THRESHOLD``
    bytes, each array 64-byte aligned in it), fused with the allreduces agreed right after them, one
    transport call per buffer."""

    def __init__(self, backend: ArrayBackend) -> None:
        self.backend, self.xp, self.transport = backend, backend.xp, backend.transport
        self.negotiator, self.timeline, self.size = backend.negotiator, backend.timeline, backend.size
        self.pads: dict[np.dtype, Any] = {}  # zeros to pad with, by dtype (sliced, never written)

    def allreduce(self, arrays: list[Any], op: int, prescale: float, postscale: float, names: list[str],
                  dtype_names: list[str] | None = None, order_in: OrderIn = None) -> list[Any]:
        """Reduce each array over all ranks; returns arrays of the inputs' shapes and dtypes, views of
        the reduced buffers. ``dtype_names``: the dtypes the agreement names (a binding that widened
        bfloat16 to float32 names bfloat16). ``NotImplementedError`` for Adasum, ``ValueError`` for an
        op that is none of Horovod's, before any communication."""
        ops.check_op(op)
        dtype_names = dtype_names or [ops.dtype_name(a.dtype) for a in arrays]
        results: list[Any] = [None] * len(arrays)
        with self.backend.device.call(order_in):
            for group in fusion_groups([((a.dtype.str, dtype_names[i]), a.nbytes) for i, a in enumerate(arrays)]):
                members = [arrays[i] for i in group]
                label = fused_label([names[i] for i in group])
                sig = allreduce_signature(op, dtype_names[group[0]], tuple(tuple(m.shape) for m in members),
                                          prescale, postscale, label, via=self.transport.via)
                self.backend.refuse_dtype(sig, "allreduce", label, members[0].dtype, reducing=True)
                work = AllreduceWork(self, members, op, prescale, postscale, label)
                self.negotiator.run(sig, work, allow_joined=True)
                buf, offsets = work.result
                for i, off in zip(group, offsets):
                    results[i] = buf[off:off + arrays[i].size].reshape(arrays[i].shape)
        return results

    def reduce(self, arrays: list[Any], op: int, prescale: float, postscale: float,
               label: str) -> tuple[Any, list[int]]:
        """The data movement of one agreed (fused) allreduce (``AllreduceWork``): the reduced buffer, in
        the arrays' dtype, and each array's element offset in it. A lone contiguous array that needs no
        widening is reduced out of place, straight from its memory."""
        dtype, transport = arrays[0].dtype, self.transport
        work = transport.work_dtype(dtype)
        phase = f"{transport.phase}_ALLREDUCE"
        if len(arrays) == 1 and work == dtype and prescale == 1.0 and arrays[0].flags.c_contiguous:
            src, offsets = arrays[0].reshape(-1), [0]
            buf = self.xp.empty_like(src)
            with self.timeline.phase(phase, label, buf.nbytes):
                transport.allreduce(src, buf, op)
        else:
            buf, offsets = self.pack(arrays, work, label)
            if prescale != 1.0:
                buf = ops.scale(buf, prescale)
            with self.timeline.phase(phase, label, buf.nbytes):
                transport.allreduce(buf, buf, op)
        buf = ops.finish_reduction(buf, op, self.size, postscale)
        return (buf if buf.dtype == dtype else buf.astype(dtype)), offsets

    def pack(self, arrays: list[Any], work: np.dtype, label: str) -> tuple[Any, list[int]]:
        """``arrays`` in one new buffer of dtype ``work``, each starting 64-byte aligned (zeros between),
        by one ``concatenate``; the buffer and each array's element offset."""
        # offsets aligned for the narrower of the two dtypes the buffer will hold
        offsets, total = aligned_offsets([a.size for a in arrays], min(work.itemsize, arrays[0].dtype.itemsize))
        parts, end = [], 0
        for a, off in zip(arrays, offsets):
            if off > end:
                parts.append(self.pad(off - end, work))
            parts.append(a.reshape(-1))
            end = off + a.size
        with self.timeline.phase("MEMCPY_IN_FUSION_BUFFER", label, total * work.itemsize):
            return self.xp.concatenate(parts, dtype=work), offsets

    def pad(self, n: int, dtype: np.dtype) -> Any:
        """``n`` zeros of ``dtype`` (less than 64 bytes: one cached array, sliced)."""
        zeros = self.pads.get(dtype)
        if zeros is None:
            zeros = self.pads[dtype] = self.xp.zeros(64, dtype)
        return zeros[:n]

    def allreduce_zeros(self, call: AllreduceCall) -> None:
        """Take part with zeros in the other ranks' allreduce (after ``hvd.join()``): the same
        ``reduce`` on zeros of their shapes, so the buffers match to the byte."""
        dtype = self.transport.array_dtype(call.dtype)
        with self.backend.device.call(None):
            zeros = [self.xp.zeros(shape, dtype) for shape in call.shapes]
            self.reduce(zeros, call.op, call.prescale, call.postscale, "join")


class ArrayBackend:
    """The collectives of one communicator on one device's arrays.

    Args:
        comm: the communicator's mpi4py handle, for host metadata (rows, splits) in a call's turn.
        negotiator: the agreement every call takes its turn in.
        timeline: where each phase is recorded.
        device: the array module and each call's context (``transports.Device``).
        transport: the data movement (``transports.Transport``).
    """

    def __init__(self, comm: Any, negotiator: Negotiator, timeline: Timeline, device: Device,
                 transport: Transport) -> None:
        self.comm, self.negotiator, self.timeline = comm, negotiator, timeline
        self.device, self.transport, self.xp = device, transport, device.xp
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.device_id: int = getattr(device, "device_id", -1)
        self.allreduces = ArrayAllreduce(self)
        self.allreduce, self.allreduce_zeros = self.allreduces.allreduce, self.allreduces.allreduce_zeros

    def free(self) -> None:
        """Release the transport (collective)."""
        self.transport.free()

    def refuse_dtype(self, sig: Signature, kind: str, name: str, dtype: np.dtype, reducing: bool = False) -> None:
        """Raise on every rank where this rank's ``dtype`` cannot take part (``collective_logic``)."""
        refuse_dtype(self.negotiator, sig, kind, name, dtype, reducing, self.transport.refusal(dtype, reducing))

    def _bytes(self, array: Any) -> Any:
        return self.xp.ascontiguousarray(array).reshape(-1).view(self.xp.uint8)

    def _concat(self, parts: list[Any]) -> Any:
        return self.xp.concatenate(parts) if parts else self.xp.empty(0, self.xp.uint8)

    # ------------------------------------------------------------ allgather
    def allgather(self, arrays: list[Any], names: list[str], dtype_names: list[str] | None = None,
                  order_in: OrderIn = None) -> list[Any]:
        """Concatenate each array over ranks along its first dimension (which may differ: each rank's
        rows are padded to the longest, all arrays in one transport call). Any dtype: sent as bytes."""
        label = fused_label(names)
        dtype_names = dtype_names or [ops.dtype_name(a.dtype) for a in arrays]
        sig = allgather_signature(tuple(dtype_names), tuple(tuple(a.shape[1:]) for a in arrays), label)
        for a, name in zip(arrays, names):
            if a.ndim == 0:
                self.negotiator.refuse(sig, f"allgather of '{name}': the tensor needs at least one dimension "
                                       "(it is a scalar).")
            self.refuse_dtype(sig, "allgather", name, a.dtype)
        with self.device.call(order_in), self.negotiator.turn(sig):
            rows = np.array([a.shape[0] for a in arrays], dtype=np.int64)
            all_rows = np.empty((self.size, len(arrays)), dtype=np.int64)
            self.comm.Allgather(rows, all_rows)
            row_bytes = [_row_elements(a) * a.dtype.itemsize for a in arrays]
            starts, block = aligned_offsets([int(all_rows[:, i].max()) * rb for i, rb in enumerate(row_bytes)], 1)
            block = _round_up(block)  # (each rank's block 64-byte aligned too)
            parts, end = [], 0
            for a, start in zip(arrays, starts):
                parts += [self.allreduces.pad(start - end, np.dtype(np.uint8))] if start > end else []
                parts.append(self._bytes(a))
                end = start + a.nbytes
            parts += [self.xp.zeros(block - end, self.xp.uint8)] if block > end else []
            recv = self.xp.empty(self.size * block, self.xp.uint8)
            with self.timeline.phase(f"{self.transport.phase}_ALLGATHER", label, recv.nbytes):
                self.transport.allgather(self._concat(parts), recv)
            blocks = recv.reshape(self.size, block)
            outs = []
            for i, (a, start) in enumerate(zip(arrays, starts)):
                pieces = [blocks[r, start:start + int(all_rows[r, i]) * row_bytes[i]] for r in range(self.size)]
                out = self._concat(pieces).view(a.dtype)
                outs.append(out.reshape((int(all_rows[:, i].sum()),) + tuple(a.shape[1:])))
        return outs

    # ------------------------------------------------------------ broadcast
    def broadcast(self, arrays: list[Any], root_rank: int, names: list[str], dtype_names: list[str] | None = None,
                  order_in: OrderIn = None) -> list[Any]:
        """Every rank gets ``root_rank``'s arrays, all in one buffer (bytes: any dtype)."""
        label = fused_label(names)
        dtype_names = dtype_names or [ops.dtype_name(a.dtype) for a in arrays]
        sig = broadcast_signature(root_rank, tuple(dtype_names), tuple(tuple(a.shape) for a in arrays), label)
        if not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < self.size:
            self.negotiator.refuse(sig, f"root_rank={root_rank!r} is not a rank: use 0..{self.size - 1}.")
        for a, name in zip(arrays, names):
            self.refuse_dtype(sig, "broadcast", name, a.dtype)
        starts, total = aligned_offsets([a.nbytes for a in arrays], 1)
        with self.device.call(order_in), self.negotiator.turn(sig):
            if self.rank == root_rank:
                parts, end = [], 0
                for a, start in zip(arrays, starts):
                    parts += [self.allreduces.pad(start - end, np.dtype(np.uint8))] if start > end else []
                    parts.append(self._bytes(a))
                    end = start + a.nbytes
                buf = self._concat(parts)
            else:
                buf = self.xp.empty(total, self.xp.uint8)
            with self.timeline.phase(f"{self.transport.phase}_BROADCAST", label, total):
                self.transport.broadcast(buf, root_rank)
        return [buf[s:s + a.nbytes].view(a.dtype).reshape(a.shape) for a, s in zip(arrays, starts)]

    # ------------------------------------------------------------- alltoall
    def alltoall(self, array: Any, splits: Any, name: str, dtype_name: str | None = None,
                 order_in: OrderIn = None) -> tuple[Any, np.ndarray]:
        """Send rows ``splits[r]`` of ``array`` to rank r (equal parts where None); return what arrived
        and from whom how many rows. Each rank's block is padded to the largest, one transport call."""
        sig = alltoall_signature(dtype_name or ops.dtype_name(array.dtype), tuple(array.shape[1:]), name)
        try:
            splits = alltoall_splits(tuple(array.shape), splits, self.size, name)
        except ValueError as exc:
            self.negotiator.refuse(sig, str(exc))
        self.refuse_dtype(sig, "alltoall", name, array.dtype)
        with self.device.call(order_in), self.negotiator.turn(sig):
            matrix = np.empty((self.size, self.size), dtype=np.int64)  # row s: the rows rank s sends to each
            self.comm.Allgather(splits, matrix)
            received = matrix[:, self.rank].copy()
            row_bytes = _row_elements(array) * array.dtype.itemsize
            block = _round_up(int(matrix.max()) * row_bytes)
            src, parts, start = self._bytes(array), [], 0
            for n in (int(s) * row_bytes for s in splits):
                parts += [src[start:start + n]] + ([self.xp.zeros(block - n, self.xp.uint8)] if block > n else [])
                start += n
            recv = self.xp.empty(self.size * block, self.xp.uint8)
            with self.timeline.phase(f"{self.transport.phase}_ALLTOALL", name, array.nbytes):
                self.transport.alltoall(self._concat(parts), recv)
            pieces = [recv[r * block:r * block + int(received[r]) * row_bytes] for r in range(self.size)]
            out = self._concat(pieces).view(array.dtype)
        return out.reshape((int(received.sum()),) + tuple(array.shape[1:])), received

    # -------------------------------------------------------- reducescatter
    def reducescatter(self, arrays: list[Any], op: int, names: list[str], dtype_names: list[str] | None = None,
                      order_in: OrderIn = None) -> list[Any]:
        """Reduce over ranks and keep this rank's block of rows (``ops.even_rows``; blocks padded to
        equal size), one transport call per array."""
        dtype_names = dtype_names or [ops.dtype_name(a.dtype) for a in arrays]
        outs = []
        with self.device.call(order_in):
            for a, dtype_name, name in zip(arrays, dtype_names, names):
                sig = reducescatter_signature(op, dtype_name, tuple(a.shape), name)
                refusal = ops.op_refusal(op, what="hvd.reducescatter")
                if refusal is not None:  # (refused on every rank, as the MPI backend refuses it)
                    self.negotiator.refuse(sig, refusal)
                if a.ndim == 0:
                    self.negotiator.refuse(sig, f"reducescatter of '{name}': the tensor needs at least one "
                                           "dimension.")
                self.refuse_dtype(sig, "reducescatter", name, a.dtype, reducing=True)
                with self.negotiator.turn(sig):
                    outs.append(self._reducescatter_one(a, op, name))
        return outs

    def _reducescatter_one(self, array: Any, op: int, name: str) -> Any:
        rows = ops.even_rows(int(array.shape[0]), self.size)
        row_elems = _row_elements(array)
        block = max(rows) * row_elems
        work = self.transport.work_dtype(array.dtype)
        src, parts, start = array.reshape(-1), [], 0
        for n in (r * row_elems for r in rows):
            parts += [src[start:start + n]] + ([self.xp.zeros(block - n, work)] if block > n else [])
            start += n
        send = self.xp.concatenate(parts, dtype=work)
        recv = self.xp.empty(block, work)
        with self.timeline.phase(f"{self.transport.phase}_REDUCESCATTER", name, send.nbytes):
            self.transport.reduce_scatter(send, recv, op)
        out = recv[:rows[self.rank] * row_elems]
        if op == ops.Average:
            out = ops.average(out, self.size)
        return out.reshape((rows[self.rank],) + tuple(array.shape[1:])).astype(array.dtype, copy=False)
