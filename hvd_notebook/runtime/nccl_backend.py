"""Collectives on GPU tensors with NCCL, coordinated over MPI.

Where every rank has a GPU, ``hvd.init()`` creates one NCCL communicator for
the world: rank 0 makes NCCL's unique id, MPI broadcasts it, every rank joins
(``bootstrap_unique_id``). GPU tensors then reach NCCL without passing through
the host: TensorFlow hands its device memory to cupy through DLPack, NCCL
reduces it on a stream of ours, and the result goes back to TensorFlow the same
way. The agreement check (``negotiation``) still runs over MPI first, so a
mismatch raises instead of hanging NCCL.

Library: cupy's NCCL bindings (``cupy.cuda.nccl``), from the ``[gpu]`` extra.
Nothing here imports cupy or TensorFlow on a machine without an NVIDIA device.

Ordering with TensorFlow's work: TensorFlow does not expose its compute stream
to Python, so before NCCL reads a tensor we wait for the device's queued work
(``tf.test.experimental.sync_devices``), and before TensorFlow reads a result
we wait for our stream. Correct, and a sync per collective call (not per tensor).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .mpi_backend import Average, Max, Min, Product, Sum, allreduce_signature, fused_label, fusion_groups
from .negotiation import Signature

log = logging.getLogger(__name__)

DISABLE_ENV = "HVD_NOTEBOOK_NCCL"  # "0": GPU tensors go through the host and MPI instead


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


def is_gpu_tensor(tensor: Any) -> bool:
    """A TensorFlow tensor placed on a GPU (eager tensors know their device)."""
    device = getattr(tensor, "device", "") or ""
    return "GPU" in device.upper()


class _DLPackOut:
    """Hands a TensorFlow GPU tensor to ``cupy.from_dlpack`` (no copy)."""

    def __init__(self, tensor: Any, device_id: int) -> None:
        self.tensor, self.device_id = tensor, device_id

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        import tensorflow as tf

        return tf.experimental.dlpack.to_dlpack(self.tensor)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, self.device_id)  # kDLCUDA


class NcclRuntime:
    """The world's NCCL communicator and the GPU collectives built on it."""

    def __init__(self, comm: Any, timeline: Any, agree: Callable[..., None], device_id: int) -> None:
        _preload_nccl()
        import cupy
        from cupy.cuda import nccl

        self.cupy, self.nccl = cupy, nccl
        self.comm, self.timeline, self.agree = comm, timeline, agree
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.device_id = device_id
        with cupy.cuda.Device(device_id):
            uid = bootstrap_unique_id(comm, nccl.get_unique_id)
            self.nccl_comm = nccl.NcclCommunicator(self.size, uid, self.rank)
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self._ops = {Sum: nccl.NCCL_SUM, Average: nccl.NCCL_SUM, Min: nccl.NCCL_MIN, Max: nccl.NCCL_MAX,
                     Product: nccl.NCCL_PROD}
        self._types = {np.dtype(np.int8): nccl.NCCL_INT8, np.dtype(np.uint8): nccl.NCCL_UINT8,
                       np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.int64): nccl.NCCL_INT64,
                       np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32,
                       np.dtype(np.float64): nccl.NCCL_FLOAT64}

    def free(self) -> None:
        with self.cupy.cuda.Device(self.device_id):
            self.stream.synchronize()
            self.nccl_comm.destroy()

    # -------------------------------------------------------------- helpers
    def _wait_for_tensorflow(self) -> None:
        import tensorflow as tf

        tf.test.experimental.sync_devices()

    def _in(self, tensor: Any) -> Any:
        """A GPU tensor's memory as a flat cupy array (no copy)."""
        return self.cupy.from_dlpack(_DLPackOut(tensor, self.device_id)).reshape(-1)

    def _out(self, array: Any) -> Any:
        """A cupy array as a TensorFlow tensor on the same GPU (no copy)."""
        import tensorflow as tf

        export = getattr(array, "toDlpack", None) or array.__dlpack__  # the stream is synchronized already
        return tf.experimental.dlpack.from_dlpack(export())

    def _nccl_type(self, dtype: np.dtype, what: str) -> int:
        try:
            return self._types[np.dtype(dtype)]
        except KeyError:
            raise TypeError(f"{what}: NCCL has no type for {np.dtype(dtype).name} tensors.") from None

    def _finish(self, phase: str, label: str, nbytes: int) -> None:
        with self.timeline.phase(phase, label, nbytes):
            self.stream.synchronize()

    # ------------------------------------------------------------ allreduce
    def allreduce(self, tensors: list[Any], op: int, prescale: float, postscale: float,
                  names: list[str]) -> list[Any]:
        """Reduce GPU tensors over all ranks; each dtype's tensors are fused into one
        device buffer (up to ``HOROVOD_FUSION_THRESHOLD`` bytes) and one NCCL call."""
        import tensorflow as tf

        originals = list(tensors)
        # cupy has no bfloat16: reduce those as float32 (on the device) and cast back
        tensors = [tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t for t in tensors]
        self._wait_for_tensorflow()
        results: list[Any] = [None] * len(tensors)
        cp = self.cupy
        with cp.cuda.Device(self.device_id), self.stream:
            for group in fusion_groups([(t.dtype, t.shape.num_elements() * t.dtype.size) for t in tensors]):
                members = [tensors[i] for i in group]
                label = fused_label([names[i] for i in group])
                dtype = np.dtype(members[0].dtype.as_numpy_dtype)
                self.agree(allreduce_signature(op, str(originals[group[0]].dtype.name),
                                               tuple(tuple(t.shape.as_list()) for t in members),
                                               prescale, postscale, label, via="NCCL"), allow_joined=True)
                arrays = [self._in(t) for t in members]
                nbytes = sum(a.nbytes for a in arrays)
                if len(arrays) == 1 and prescale == 1.0:
                    src, buf = arrays[0], cp.empty_like(arrays[0])  # out of place: no copy in
                else:
                    with self.timeline.phase("MEMCPY_IN_FUSION_BUFFER", label, nbytes):
                        buf = cp.concatenate(arrays) if len(arrays) > 1 else arrays[0].copy()
                        if prescale != 1.0:
                            buf *= buf.dtype.type(prescale)
                    src = buf
                with self.timeline.phase("NCCL_ALLREDUCE", label, nbytes):
                    self.nccl_comm.allReduce(src.data.ptr, buf.data.ptr, buf.size,
                                             self._nccl_type(dtype, "allreduce"), self._ops[op], self.stream.ptr)
                    self.stream.synchronize()
                if op == Average:
                    buf = buf / self.size if buf.dtype.kind in "iub" else _scaled(buf, 1.0 / self.size)
                if postscale != 1.0:
                    buf = _scaled(buf, postscale)
                self._finish("MEMCPY_OUT_FUSION_BUFFER", label, nbytes)
                flat = self._out(buf)
                pieces = tf.split(flat, [a.size for a in arrays]) if len(arrays) > 1 else [flat]
                for i, piece in zip(group, pieces):
                    piece = tf.reshape(piece, tensors[i].shape)
                    results[i] = tf.cast(piece, tf.bfloat16) if originals[i].dtype == tf.bfloat16 else piece
        return results

    def allreduce_zeros(self, dtype_name: str, elements: int, op: int) -> None:
        """Take part with zeros in the other ranks' NCCL allreduce (after ``hvd.join()``)."""
        cp = self.cupy
        dtype = np.dtype(np.float32) if dtype_name == "bfloat16" else np.dtype(dtype_name)
        with cp.cuda.Device(self.device_id), self.stream:
            buf = cp.zeros(elements, dtype=dtype)
            self.nccl_comm.allReduce(buf.data.ptr, buf.data.ptr, elements, self._nccl_type(dtype, "allreduce"),
                                     self._ops[op], self.stream.ptr)
            self.stream.synchronize()

    # ------------------------------------------------------------ allgather
    def allgather(self, tensors: list[Any], names: list[str]) -> list[Any]:
        """Concatenate GPU tensors over ranks along the first dimension (which may
        differ: NCCL gathers equal blocks, so each is padded to the longest)."""

        label = fused_label(names)
        self.agree(Signature("allgather", (("dtypes", tuple(t.dtype.name for t in tensors)),
                                           ("trailing shapes", tuple(tuple(t.shape[1:].as_list())
                                                                     for t in tensors))), label))
        all_rows = self.comm.allgather([int(t.shape[0]) for t in tensors])
        self._wait_for_tensorflow()
        cp, outs = self.cupy, []
        with cp.cuda.Device(self.device_id), self.stream:
            for i, t in enumerate(tensors):
                rows = [r[i] for r in all_rows]
                row_elems = int(np.prod(t.shape[1:].as_list(), dtype=np.int64))
                src = self._in(t).view(cp.uint8)
                row_bytes = row_elems * t.dtype.size
                send = cp.zeros(max(rows) * row_bytes, dtype=cp.uint8)
                send[:src.size] = src
                recv = cp.empty(self.size * send.size, dtype=cp.uint8)
                with self.timeline.phase("NCCL_ALLGATHER", label, recv.nbytes):
                    self.nccl_comm.allGather(send.data.ptr, recv.data.ptr, send.size, self.nccl.NCCL_UINT8,
                                             self.stream.ptr)
                    self.stream.synchronize()
                blocks = recv.reshape(self.size, send.size)
                out = cp.concatenate([blocks[r, :rows[r] * row_bytes] for r in range(self.size)])
                self.stream.synchronize()
                outs.append(_from_bytes(self._out(out), t.dtype, [sum(rows)] + t.shape[1:].as_list()))
        return outs

    # ------------------------------------------------------------ broadcast
    def broadcast(self, tensors: list[Any], root_rank: int, names: list[str]) -> list[Any]:
        """Every rank gets ``root_rank``'s GPU tensors (sent as bytes: any dtype)."""

        label = fused_label(names)
        self.agree(Signature("broadcast", (("root_rank", root_rank),
                                           ("dtypes", tuple(t.dtype.name for t in tensors)),
                                           ("shapes", tuple(tuple(t.shape.as_list()) for t in tensors))), label))
        self._wait_for_tensorflow()
        cp, outs = self.cupy, []
        with cp.cuda.Device(self.device_id), self.stream:
            for t in tensors:
                src = self._in(t).view(cp.uint8)
                out = cp.empty_like(src)
                with self.timeline.phase("NCCL_BROADCAST", label, src.nbytes):
                    self.nccl_comm.broadcast(src.data.ptr, out.data.ptr, src.size, self.nccl.NCCL_UINT8,
                                             root_rank, self.stream.ptr)
                    self.stream.synchronize()
                outs.append(_from_bytes(self._out(out), t.dtype, t.shape))
        return outs

    # -------------------------------------------------------- reducescatter
    def reducescatter(self, tensors: list[Any], op: int, names: list[str]) -> list[Any]:
        """Reduce over ranks and keep this rank's block of rows (the first
        ``rows % size`` ranks get one row more; blocks are padded for NCCL)."""
        import tensorflow as tf

        cp, outs = self.cupy, []
        self._wait_for_tensorflow()
        with cp.cuda.Device(self.device_id), self.stream:
            for t, name in zip(tensors, names):
                self.agree(Signature("reducescatter", (("op", _op_name(op)), ("dtype", t.dtype.name),
                                                       ("shape", tuple(t.shape.as_list()))), name))
                work = tf.cast(t, tf.float32) if t.dtype == tf.bfloat16 else t
                dtype = np.dtype(work.dtype.as_numpy_dtype)
                base, extra = divmod(int(t.shape[0]), self.size)
                rows = [base + (1 if r < extra else 0) for r in range(self.size)]
                row_elems = int(np.prod(t.shape[1:].as_list(), dtype=np.int64))
                block = max(rows) * row_elems
                src = self._in(work)
                send = cp.zeros(self.size * block, dtype=dtype)
                start = 0
                for r, n in enumerate(rows):
                    send[r * block:r * block + n * row_elems] = src[start:start + n * row_elems]
                    start += n * row_elems
                recv = cp.empty(block, dtype=dtype)
                with self.timeline.phase("NCCL_REDUCESCATTER", name, send.nbytes):
                    self.nccl_comm.reduceScatter(send.data.ptr, recv.data.ptr, block,
                                                 self._nccl_type(dtype, "reducescatter"), self._ops[op],
                                                 self.stream.ptr)
                    self.stream.synchronize()
                out = recv[:rows[self.rank] * row_elems]
                if op == Average:
                    out = out / self.size if out.dtype.kind in "iub" else _scaled(out.copy(), 1.0 / self.size)
                self.stream.synchronize()
                result = tf.reshape(self._out(cp.ascontiguousarray(out)), [rows[self.rank]] + t.shape[1:].as_list())
                outs.append(tf.cast(result, tf.bfloat16) if t.dtype == tf.bfloat16 else result)
        return outs


def _from_bytes(raw: Any, dtype: Any, shape: Any) -> Any:
    """A flat uint8 TensorFlow tensor reinterpreted as ``dtype`` of ``shape``."""
    import tensorflow as tf

    if dtype.size > 1:
        raw = tf.reshape(raw, [-1, dtype.size])
    return tf.reshape(tf.bitcast(raw, dtype), shape)


def _scaled(buf: Any, factor: float) -> Any:
    if buf.dtype.kind == "f":
        buf *= buf.dtype.type(factor)
        return buf
    return (buf * factor).astype(buf.dtype)


def _op_name(op: int) -> str:
    from .mpi_backend import OP_NAMES

    return OP_NAMES[op]


def start(comm: Any, local_rank: int, timeline: Any, agree: Callable[..., None]) -> NcclRuntime | None:
    """Create the world's NCCL communicator where every rank has a GPU (a collective
    call: every rank must make it). None where any rank has none, where cupy is
    missing, or where ``HVD_NOTEBOOK_NCCL=0``: GPU tensors then go through the host."""

    wanted = os.environ.get(DISABLE_ENV, "1") not in ("0", "false", "no")
    has_gpu = wanted and gpu_device_present() and cupy_importable()
    device_id = -1
    if has_gpu:
        try:
            import cupy

            count = cupy.cuda.runtime.getDeviceCount()
            device_id = local_rank % count if count else -1
        except Exception as exc:  # a driver without a usable device, or a cupy for another CUDA
            log.warning("rank %d: cupy sees no usable GPU (%s); GPU tensors will go through the host",
                        comm.Get_rank(), exc)
    with_gpu = comm.allgather(device_id >= 0)
    if not all(with_gpu):
        if any(with_gpu) and comm.Get_rank() == 0:
            print("[hvd_notebook] WARNING: only some ranks have a GPU; NCCL is off and every collective goes "
                  "through MPI on the host.", file=sys.stderr, flush=True)
        return None
    return NcclRuntime(comm, timeline, agree, device_id)
