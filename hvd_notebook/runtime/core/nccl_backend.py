"""Collectives on GPU arrays with NCCL, coordinated over MPI: the framework-neutral GPU core.

Where every rank has a GPU, ``hvd.init()`` creates one NCCL communicator for
the world: rank 0 makes NCCL's unique id, MPI broadcasts it, every rank joins
(``bootstrap_unique_id``). The backend takes and returns cupy arrays: the
framework bindings hand it their tensors' device memory through DLPack (no copy,
no trip through the host) and adopt its results the same way
(``tensorflow/nccl.py`` for TensorFlow; PyTorch's go through ``torch.distributed``). The agreement
check (``negotiation``) still runs over MPI first, so a mismatch raises instead of
hanging NCCL. Built from (communicator, negotiator, timeline); ``world.World``
owns one.

Library: cupy's NCCL bindings (``cupy.cuda.nccl``), from the ``[gpu]`` extra.
Nothing here imports cupy or a framework on a machine without an NVIDIA device.

Ordering with the framework's work: each call takes ``wait``, the binding's way
to make our stream wait for the work that writes the inputs (TensorFlow: a device
sync, since it does not expose its stream; PyTorch: an event on its current
stream, no host wait). Every call ends with our stream synchronized, so its
results are complete when the framework reads them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ... import config
from ...messages import EventKind
from . import events, ops
from .fusion import aligned_offsets, fused_label, fusion_groups
from .negotiation import Negotiator
from .signatures import AllreduceCall, allgather_signature, allreduce_signature, reducescatter_signature
from .signatures import broadcast_signature as _broadcast_signature
from .timeline import Timeline

log = logging.getLogger(__name__)

Wait = Callable[[Any], None] | None  # called with our cupy stream before any input is read


def gpu_device_present() -> bool:
    """Is an NVIDIA device node here? Asked of the file system, so a CPU-only
    machine imports neither cupy nor anything of CUDA to find out."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("-1", ""):
        return False
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def cupy_importable() -> bool:
    """Whether cupy is installed, found without importing it."""
    import importlib.util

    return importlib.util.find_spec("cupy") is not None


def _preload_nccl() -> None:
    """Load NCCL from an ``nvidia-nccl-cu12``/``-cu13`` wheel (TensorFlow's and PyTorch's CUDA builds
    bring one) before cupy's NCCL module needs ``libnccl.so.2``, which is not on the loader's path in
    a virtualenv."""
    import ctypes
    from pathlib import Path

    try:
        import nvidia.nccl  # type: ignore[import-not-found]
    except ImportError:
        return  # a system NCCL, found by the loader itself
    for folder in nvidia.nccl.__path__:
        lib = Path(folder) / "lib" / "libnccl.so.2"
        if lib.exists():
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            return


def bootstrap_unique_id(comm: Any, make_id: Callable[[], Any]) -> Any:
    """Rank 0 makes the unique id that names the NCCL communicator; MPI gives
    it to every rank. Collective: every rank of ``comm`` must call it."""
    uid = make_id() if comm.Get_rank() == 0 else None
    return comm.bcast(uid, root=0)


def _row_elements(array: Any) -> int:
    return int(np.prod(array.shape[1:], dtype=np.int64))


class NcclBackend:
    """The world's NCCL communicator and the GPU collectives built on it, on cupy arrays."""

    def __init__(self, comm: Any, negotiator: Negotiator, timeline: Timeline, device_id: int) -> None:
        _preload_nccl()
        import cupy
        from cupy.cuda import nccl

        self.cupy, self.nccl = cupy, nccl
        self.comm, self.negotiator, self.timeline = comm, negotiator, timeline
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            uid = bootstrap_unique_id(comm, nccl.get_unique_id)
            self.nccl_comm = nccl.NcclCommunicator(self.size, uid, self.rank)
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._ops = {ops.Sum: nccl.NCCL_SUM, ops.Average: nccl.NCCL_SUM, ops.Min: nccl.NCCL_MIN,
                     ops.Max: nccl.NCCL_MAX, ops.Product: nccl.NCCL_PROD}
        self._types = {np.dtype(np.int8): nccl.NCCL_INT8, np.dtype(np.uint8): nccl.NCCL_UINT8,
                       np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.int64): nccl.NCCL_INT64,
                       np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32,
                       np.dtype(np.float64): nccl.NCCL_FLOAT64}

    def free(self) -> None:
        with self.cupy.cuda.Device(self.device_id):
            self.stream.synchronize()
            self.nccl_comm.destroy()

    # -------------------------------------------------------------- helpers
    @contextlib.contextmanager
    def on_stream(self, wait: Wait = None) -> Iterator[Any]:
        """Our device and stream (cupy's current stream inside), after ``wait(stream)`` has ordered it
        behind the framework's work on the inputs; synchronized on the way out, so the results are complete."""
        with self.cupy.cuda.Device(self.device_id), self.stream:
            if wait is not None:
                wait(self.stream)
            yield self.cupy
            self.stream.synchronize()

    def _nccl_call(self, phase: str, label: str, nbytes: int, call: Callable[..., None], *args: Any) -> None:
        """``call(*args, stream pointer)`` (an NCCL collective) as one timeline phase, waiting for it."""
        with self.timeline.phase(phase, label, nbytes):
            call(*args, self.stream.ptr)
            self.stream.synchronize()

    def _nccl_type(self, dtype: Any, what: str) -> int:
        try:
            return self._types[np.dtype(dtype)]
        except KeyError:
            raise TypeError(f"{what}: NCCL has no type for {np.dtype(dtype).name} tensors.") from None

    # ------------------------------------------------------------ allreduce
    def allreduce(self, arrays: list[Any], op: int, prescale: float, postscale: float, names: list[str],
                  dtype_names: list[str] | None = None, wait: Wait = None) -> list[Any]:
        """Reduce GPU arrays over all ranks; each dtype's arrays are fused into one device buffer (up
        to ``HOROVOD_FUSION_THRESHOLD`` bytes, each array 64-byte aligned in it) and one NCCL call.
        Returns arrays of the inputs' shapes, views of the reduced buffers. ``dtype_names``: the
        dtypes the agreement names (a binding that widened bfloat16 to float32 names bfloat16).
        ``NotImplementedError`` for Adasum, ``ValueError`` for an op that is none of Horovod's, before any call."""
        ops.check_op(op)  # (the backend's boundary: every binding's reduction passes here)
        dtype_names = dtype_names or [a.dtype.name for a in arrays]
        results: list[Any] = [None] * len(arrays)
        with self.on_stream(wait):
            for group in fusion_groups([(a.dtype, a.nbytes) for a in arrays]):
                reduced = self._allreduce_group([arrays[i] for i in group], op, prescale, postscale,
                                                fused_label([names[i] for i in group]), dtype_names[group[0]])
                for i, piece in zip(group, reduced):
                    results[i] = piece
        return results

    def _allreduce_group(self, members: list[Any], op: int, prescale: float, postscale: float, label: str,
                         dtype_name: str) -> list[Any]:
        cp = self.cupy
        with self.negotiator.turn(allreduce_signature(op, dtype_name, tuple(tuple(m.shape) for m in members),
                                                      prescale, postscale, label, via="NCCL"), allow_joined=True):
            nbytes = sum(m.nbytes for m in members)
            if len(members) == 1 and prescale == 1.0 and members[0].flags.c_contiguous:
                src = members[0].reshape(-1)
                buf, offsets = cp.empty_like(src), [0]  # out of place: no copy in
            else:
                offsets, total = aligned_offsets([m.size for m in members], members[0].dtype.itemsize)
                with self.timeline.phase("MEMCPY_IN_FUSION_BUFFER", label, nbytes):
                    buf = cp.zeros(total, dtype=members[0].dtype)
                    for m, off in zip(members, offsets):
                        buf[off:off + m.size] = m.reshape(-1)
                    if prescale != 1.0:
                        buf = ops.scale(buf, prescale)
                src = buf
            nccl_type = self._nccl_type(members[0].dtype, "allreduce")
            self._nccl_call("NCCL_ALLREDUCE", label, nbytes, self.nccl_comm.allReduce, src.data.ptr, buf.data.ptr,
                            buf.size, nccl_type, self._ops[op])
            buf = ops.finish_reduction(buf, op, self.size, postscale)
            return [buf[off:off + m.size].reshape(m.shape) for m, off in zip(members, offsets)]

    def allreduce_zeros(self, call: AllreduceCall) -> None:
        """Take part with zeros in the other ranks' NCCL allreduce (after ``hvd.join()``)."""
        dtype = np.dtype(np.float32) if call.dtype == "bfloat16" else np.dtype(call.dtype)
        with self.on_stream() as cp:
            # the other ranks' fused buffer, alignment padding included
            _, total = aligned_offsets([math.prod(shape) for shape in call.shapes], dtype.itemsize)
            buf = cp.zeros(total, dtype=dtype)
            self._nccl_call("NCCL_ALLREDUCE", "join", buf.nbytes, self.nccl_comm.allReduce, buf.data.ptr,
                            buf.data.ptr, buf.size, self._nccl_type(dtype, "allreduce"), self._ops[call.op])

    # ------------------------------------------------------------ allgather
    def allgather(self, arrays: list[Any], names: list[str], dtype_names: list[str] | None = None,
                  wait: Wait = None) -> list[Any]:
        """Concatenate GPU arrays over ranks along the first dimension (which may differ: NCCL
        gathers equal blocks, so each is padded to the longest). Any dtype: sent as bytes."""
        label = fused_label(names)
        dtype_names = dtype_names or [a.dtype.name for a in arrays]
        with self.negotiator.turn(allgather_signature(tuple(dtype_names), tuple(tuple(a.shape[1:]) for a in arrays),
                                                      label)):
            all_rows = self.comm.allgather([int(a.shape[0]) for a in arrays])
            outs = []
            with self.on_stream(wait) as cp:
                for i, a in enumerate(arrays):
                    rows = [r[i] for r in all_rows]
                    row_bytes = _row_elements(a) * a.dtype.itemsize
                    src = cp.ascontiguousarray(a).reshape(-1).view(cp.uint8)
                    send = cp.zeros(max(rows) * row_bytes, dtype=cp.uint8)
                    send[:src.size] = src
                    recv = cp.empty(self.size * send.size, dtype=cp.uint8)
                    self._nccl_call("NCCL_ALLGATHER", label, recv.nbytes, self.nccl_comm.allGather, send.data.ptr,
                                    recv.data.ptr, send.size, self.nccl.NCCL_UINT8)
                    blocks = recv.reshape(self.size, send.size)
                    out = cp.concatenate([blocks[r, :rows[r] * row_bytes] for r in range(self.size)])
                    outs.append(out.view(a.dtype).reshape((sum(rows),) + tuple(a.shape[1:])))
        return outs

    # ------------------------------------------------------------ broadcast
    def broadcast(self, arrays: list[Any], root_rank: int, names: list[str], dtype_names: list[str] | None = None,
                  wait: Wait = None) -> list[Any]:
        """Every rank gets ``root_rank``'s GPU arrays (sent as bytes: any dtype)."""
        label = fused_label(names)
        dtype_names = dtype_names or [a.dtype.name for a in arrays]
        with self.negotiator.turn(_broadcast_signature(root_rank, tuple(dtype_names),
                                                       tuple(tuple(a.shape) for a in arrays), label)):
            outs = []
            with self.on_stream(wait) as cp:
                for a in arrays:
                    src = cp.ascontiguousarray(a).reshape(-1).view(cp.uint8)
                    out = cp.empty_like(src)
                    self._nccl_call("NCCL_BROADCAST", label, src.nbytes, self.nccl_comm.broadcast, src.data.ptr,
                                    out.data.ptr, src.size, self.nccl.NCCL_UINT8, root_rank)
                    outs.append(out.view(a.dtype).reshape(a.shape))
        return outs

    # -------------------------------------------------------- reducescatter
    def reducescatter(self, arrays: list[Any], op: int, names: list[str], dtype_names: list[str] | None = None,
                      wait: Wait = None) -> list[Any]:
        """Reduce over ranks and keep this rank's block of rows (``ops.even_rows``; blocks are
        padded to equal size for NCCL)."""
        dtype_names = dtype_names or [a.dtype.name for a in arrays]
        outs = []
        with self.on_stream(wait):
            for a, dtype_name, name in zip(arrays, dtype_names, names):
                sig = reducescatter_signature(op, dtype_name, tuple(a.shape), name)
                refusal = ops.op_refusal(op, what="hvd.reducescatter")
                if refusal is not None:  # (refused on every rank, as the MPI backend refuses it)
                    self.negotiator.refuse(sig, refusal)
                with self.negotiator.turn(sig):
                    outs.append(self._reducescatter_one(a, op, name))
        return outs

    def _reducescatter_one(self, array: Any, op: int, name: str) -> Any:
        cp = self.cupy
        rows = ops.even_rows(int(array.shape[0]), self.size)
        row_elems = _row_elements(array)
        block = max(rows) * row_elems
        src = cp.ascontiguousarray(array).reshape(-1)
        send = cp.zeros(self.size * block, dtype=array.dtype)
        start = 0
        for r, n in enumerate(rows):
            send[r * block:r * block + n * row_elems] = src[start:start + n * row_elems]
            start += n * row_elems
        recv = cp.empty(block, dtype=array.dtype)
        nccl_type = self._nccl_type(array.dtype, "reducescatter")
        self._nccl_call("NCCL_REDUCESCATTER", name, send.nbytes, self.nccl_comm.reduceScatter, send.data.ptr,
                        recv.data.ptr, block, nccl_type, self._ops[op])
        out = recv[:rows[self.rank] * row_elems]
        if op == ops.Average:
            out = ops.average(out, self.size)
        return out.reshape((rows[self.rank],) + tuple(array.shape[1:]))


def _local_device(comm: Any, local_rank: int) -> int:
    """The GPU this rank uses, by local rank; -1 where NCCL is off or there is none."""
    if not (config.NCCL.flag() and gpu_device_present() and cupy_importable()):
        return -1
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        return local_rank % count if count else -1
    except Exception as exc:  # a driver without a usable device, or a cupy for another CUDA
        log.warning("rank %d: cupy sees no usable GPU (%s); GPU tensors will go through the host",
                    comm.Get_rank(), exc)
        return -1


def start(comm: Any, local_rank: int, negotiator: Negotiator, timeline: Timeline) -> NcclBackend | None:
    """Create the world's NCCL communicator where every rank has a GPU (a collective
    call: every rank must make it). None where any rank has none, where cupy is
    missing, or where ``HVD_NOTEBOOK_NCCL=0``: GPU tensors then go through the host."""
    device_id = _local_device(comm, local_rank)
    with_gpu = comm.allgather(device_id >= 0)
    if not all(with_gpu):
        if any(with_gpu) and comm.Get_rank() == 0:
            events.emit(EventKind.WARNING, "only some ranks have a GPU; NCCL is off and every collective goes "
                        "through MPI on the host.")
        return None
    return NcclBackend(comm, negotiator, timeline, device_id)
