"""Collectives on GPU tensors with NCCL, coordinated over MPI.

Where every rank has a GPU, ``hvd.init()`` creates one NCCL communicator for
the world: rank 0 makes NCCL's unique id, MPI broadcasts it, every rank joins
(``bootstrap_unique_id``). GPU tensors then reach NCCL without passing through
the host: TensorFlow hands its device memory to cupy through DLPack, NCCL
reduces it on a stream of ours, and the result goes back to TensorFlow the same
way. The agreement check (``negotiation``) still runs over MPI first, so a
mismatch raises instead of hanging NCCL. Built from (communicator, negotiator,
timeline); ``world.World`` owns one.

Library: cupy's NCCL bindings (``cupy.cuda.nccl``), from the ``[gpu]`` extra.
Nothing here imports cupy or TensorFlow on a machine without an NVIDIA device.

Ordering with TensorFlow's work: TensorFlow does not expose its compute stream
to Python, so before NCCL reads a tensor we wait for the device's queued work
(``tf.test.experimental.sync_devices``), and before TensorFlow reads a result
we wait for our stream: a sync per collective call (not per tensor).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from .. import config
from . import ops
from .bridges import cupy_to_tf, from_bytes, tf, to_cupy
from .fusion import fused_label, fusion_groups
from .negotiation import Negotiator
from .signatures import AllreduceCall, allgather_signature, allreduce_signature, reducescatter_signature
from .signatures import broadcast_signature as _broadcast_signature
from .timeline import Timeline

log = logging.getLogger(__name__)


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
    """Load NCCL from the ``nvidia-nccl-cu12`` wheel (TensorFlow's CUDA build brings
    it) before cupy's NCCL module needs ``libnccl.so.2``, which is not on the
    loader's path in a virtualenv."""
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


def _shape(tensor: Any) -> list[int]:
    return tensor.shape.as_list()


def _row_elements(tensor: Any) -> int:
    return int(np.prod(_shape(tensor)[1:], dtype=np.int64))


def _widened(tensor: Any) -> Any:
    """cupy has no bfloat16: those tensors are reduced as float32 (cast on the device)."""
    t = tf()
    return t.cast(tensor, t.float32) if tensor.dtype == t.bfloat16 else tensor


def _narrowed(result: Any, original: Any) -> Any:
    """A result back in its input's dtype where ``_widened`` widened it."""
    t = tf()
    return t.cast(result, t.bfloat16) if original.dtype == t.bfloat16 else result


class NcclBackend:
    """The world's NCCL communicator and the GPU collectives built on it."""

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
    def _on_stream(self, wait_for_tensorflow: bool = True) -> Iterator[Any]:
        """Our device and stream, after TensorFlow's queued work (which may write our inputs)."""
        if wait_for_tensorflow:
            tf().test.experimental.sync_devices()
        with self.cupy.cuda.Device(self.device_id), self.stream:
            yield self.cupy

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

    def _in(self, tensor: Any) -> Any:
        return to_cupy(tensor, self.device_id)

    def _out(self, array: Any) -> Any:
        """A result as a TensorFlow tensor, once the stream has finished writing it."""
        self.stream.synchronize()
        return cupy_to_tf(array)

    # ------------------------------------------------------------ allreduce
    def allreduce(self, tensors: list[Any], op: int, prescale: float, postscale: float,
                  names: list[str]) -> list[Any]:
        """Reduce GPU tensors over all ranks; each dtype's tensors are fused into one
        device buffer (up to ``HOROVOD_FUSION_THRESHOLD`` bytes) and one NCCL call."""
        work = [_widened(t) for t in tensors]
        results: list[Any] = [None] * len(tensors)
        with self._on_stream():
            for group in fusion_groups([(t.dtype, t.shape.num_elements() * t.dtype.size) for t in work]):
                reduced = self._allreduce_group([tensors[i] for i in group], [work[i] for i in group], op,
                                                prescale, postscale, fused_label([names[i] for i in group]))
                for i, piece in zip(group, reduced):
                    results[i] = piece
        return results

    def _allreduce_group(self, originals: list[Any], members: list[Any], op: int, prescale: float,
                         postscale: float, label: str) -> list[Any]:
        cp, t = self.cupy, tf()
        with self.negotiator.turn(allreduce_signature(op, str(originals[0].dtype.name),
                                                  tuple(tuple(_shape(m)) for m in members), prescale, postscale,
                                                  label, via="NCCL"), allow_joined=True):
            arrays = [self._in(m) for m in members]
            nbytes = sum(a.nbytes for a in arrays)
            if len(arrays) == 1 and prescale == 1.0:
                src, buf = arrays[0], cp.empty_like(arrays[0])  # out of place: no copy in
            else:
                with self.timeline.phase("MEMCPY_IN_FUSION_BUFFER", label, nbytes):
                    buf = cp.concatenate(arrays) if len(arrays) > 1 else arrays[0].copy()
                    if prescale != 1.0:
                        buf = ops.scale(buf, prescale)
                src = buf
            nccl_type = self._nccl_type(members[0].dtype.as_numpy_dtype, "allreduce")
            self._nccl_call("NCCL_ALLREDUCE", label, nbytes, self.nccl_comm.allReduce, src.data.ptr, buf.data.ptr,
                            buf.size, nccl_type, self._ops[op])
            buf = ops.finish_reduction(buf, op, self.size, postscale)
            with self.timeline.phase("MEMCPY_OUT_FUSION_BUFFER", label, nbytes):
                flat = self._out(buf)
            pieces = t.split(flat, [a.size for a in arrays]) if len(arrays) > 1 else [flat]
            return [_narrowed(t.reshape(piece, m.shape), o) for piece, m, o in zip(pieces, members, originals)]

    def allreduce_zeros(self, call: AllreduceCall) -> None:
        """Take part with zeros in the other ranks' NCCL allreduce (after ``hvd.join()``)."""
        dtype = np.dtype(np.float32) if call.dtype == "bfloat16" else np.dtype(call.dtype)
        with self._on_stream(wait_for_tensorflow=False) as cp:
            buf = cp.zeros(call.elements, dtype=dtype)
            self._nccl_call("NCCL_ALLREDUCE", "join", buf.nbytes, self.nccl_comm.allReduce, buf.data.ptr,
                            buf.data.ptr, buf.size, self._nccl_type(dtype, "allreduce"), self._ops[call.op])

    # ------------------------------------------------------------ allgather
    def allgather(self, tensors: list[Any], names: list[str]) -> list[Any]:
        """Concatenate GPU tensors over ranks along the first dimension (which may
        differ: NCCL gathers equal blocks, so each is padded to the longest)."""
        label = fused_label(names)
        with self.negotiator.turn(allgather_signature(tuple(t.dtype.name for t in tensors),
                                                  tuple(tuple(_shape(t)[1:]) for t in tensors), label)):
            all_rows = self.comm.allgather([int(t.shape[0]) for t in tensors])
            outs = []
            with self._on_stream() as cp:
                for i, t in enumerate(tensors):
                    rows = [r[i] for r in all_rows]
                    row_bytes = _row_elements(t) * t.dtype.size
                    src = self._in(t).view(cp.uint8)
                    send = cp.zeros(max(rows) * row_bytes, dtype=cp.uint8)
                    send[:src.size] = src
                    recv = cp.empty(self.size * send.size, dtype=cp.uint8)
                    self._nccl_call("NCCL_ALLGATHER", label, recv.nbytes, self.nccl_comm.allGather, send.data.ptr,
                                    recv.data.ptr, send.size, self.nccl.NCCL_UINT8)
                    blocks = recv.reshape(self.size, send.size)
                    out = cp.concatenate([blocks[r, :rows[r] * row_bytes] for r in range(self.size)])
                    outs.append(from_bytes(self._out(out), t.dtype, [sum(rows)] + _shape(t)[1:]))
        return outs

    # ------------------------------------------------------------ broadcast
    def broadcast(self, tensors: list[Any], root_rank: int, names: list[str]) -> list[Any]:
        """Every rank gets ``root_rank``'s GPU tensors (sent as bytes: any dtype)."""
        label = fused_label(names)
        with self.negotiator.turn(_broadcast_signature(root_rank, tuple(t.dtype.name for t in tensors),
                                                   tuple(tuple(_shape(t)) for t in tensors), label)):
            outs = []
            with self._on_stream() as cp:
                for t in tensors:
                    src = self._in(t).view(cp.uint8)
                    out = cp.empty_like(src)
                    self._nccl_call("NCCL_BROADCAST", label, src.nbytes, self.nccl_comm.broadcast, src.data.ptr,
                                    out.data.ptr, src.size, self.nccl.NCCL_UINT8, root_rank)
                    outs.append(from_bytes(self._out(out), t.dtype, t.shape))
        return outs

    # -------------------------------------------------------- reducescatter
    def reducescatter(self, tensors: list[Any], op: int, names: list[str]) -> list[Any]:
        """Reduce over ranks and keep this rank's block of rows (``ops.even_rows``;
        blocks are padded to equal size for NCCL)."""
        work = [_widened(t) for t in tensors]  # (before the wait: the casts run on TensorFlow's stream)
        outs = []
        with self._on_stream():
            for t, widened, name in zip(tensors, work, names):
                with self.negotiator.turn(reducescatter_signature(op, t.dtype.name, tuple(_shape(t)), name)):
                    outs.append(_narrowed(self._reducescatter_one(widened, op, name), t))
        return outs

    def _reducescatter_one(self, work: Any, op: int, name: str) -> Any:
        cp = self.cupy
        dtype = np.dtype(work.dtype.as_numpy_dtype)
        rows = ops.even_rows(int(work.shape[0]), self.size)
        row_elems = _row_elements(work)
        block = max(rows) * row_elems
        src = self._in(work)
        send = cp.zeros(self.size * block, dtype=dtype)
        start = 0
        for r, n in enumerate(rows):
            send[r * block:r * block + n * row_elems] = src[start:start + n * row_elems]
            start += n * row_elems
        recv = cp.empty(block, dtype=dtype)
        nccl_type = self._nccl_type(dtype, "reducescatter")
        self._nccl_call("NCCL_REDUCESCATTER", name, send.nbytes, self.nccl_comm.reduceScatter, send.data.ptr,
                        recv.data.ptr, block, nccl_type, self._ops[op])
        out = recv[:rows[self.rank] * row_elems]
        if op == ops.Average:
            out = ops.average(out.copy(), self.size)
        return tf().reshape(self._out(cp.ascontiguousarray(out)), [rows[self.rank]] + _shape(work)[1:])


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
            print(f"{config.WARNING_PREFIX}: only some ranks have a GPU; NCCL is off and every collective goes "
                  "through MPI on the host.", file=sys.stderr, flush=True)
        return None
    return NcclBackend(comm, negotiator, timeline, device_id)
