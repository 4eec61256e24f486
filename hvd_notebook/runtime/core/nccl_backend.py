"""Every cupy call of the runtime's core and its TensorFlow binding: a GPU's arrays (``CupyDevice``), NCCL
through cupy's bindings (``NcclTransport``), DLPack in and out, and ``start``, which builds the world's
NCCL backend: ``array_backend.ArrayBackend`` (the MPI backend's logic, run on the CPU tests with numpy and
mpi4py) on these two seams.

Where every rank has a GPU, ``hvd.init()`` creates one NCCL communicator for the world: rank 0 makes
NCCL's unique id, MPI broadcasts it, every rank joins (``bootstrap_unique_id``). The agreement still runs
over MPI first, so a mismatch raises instead of hanging NCCL. PyTorch's tensors do not come here (they go
through ``torch.distributed``); cupy arrays and TensorFlow's GPU tensors (through DLPack, no copy) do.

Ordering with the caller's work, one host wait per call at most: cupy arrays run on cupy's current stream,
the caller's own, so nothing waits; a framework that exposes no stream (TensorFlow) passes ``order_in``,
which waits for its queued work, and the call then runs on our stream and ends with that stream
synchronized, so that its results are complete when the framework reads them.

Library: cupy's NCCL bindings (``cupy.cuda.nccl``), from the ``[gpu]`` extra. Nothing here imports cupy
on a machine without an NVIDIA device.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ... import config
from ...messages import EventKind
from . import events, ops
from .array_backend import ArrayBackend
from .negotiation import Negotiator
from .timeline import Timeline

log = logging.getLogger(__name__)


def gpu_device_present() -> bool:
    """Is an NVIDIA device node here? Asked of the file system, so a CPU-only
    machine imports neither cupy nor anything of CUDA to find out."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("-1", ""):
        return False
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


def nccl_importable() -> bool:
    """Whether cupy (and so its NCCL bindings) is installed, found without importing it."""
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


# ------------------------------------------------------------------ arrays in and out
def is_device_array(x: Any) -> bool:
    """A cupy array (asked without importing cupy): it stays on its GPU, through NCCL."""
    return type(x).__module__.startswith("cupy")


def from_dlpack(exporter: Any) -> Any:
    """An object with ``__dlpack__`` (a framework's GPU tensor) as a cupy array on its memory, no copy."""
    import cupy

    return cupy.from_dlpack(exporter)


def to_dlpack(array: Any) -> Any:
    """A DLPack capsule of a cupy array's memory, for a framework to adopt without a copy."""
    export = getattr(array, "toDlpack", None) or array.__dlpack__
    return export()


class CupyDevice:
    """cupy arrays on one GPU (``transports.Device``).

    Args:
        device_id: the GPU, by CUDA's index.
    """

    def __init__(self, device_id: int) -> None:
        import cupy

        self.xp, self.device_id = cupy, device_id
        self.device = cupy.cuda.Device(device_id)
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)

    @contextlib.contextmanager
    def call(self, order_in: Callable[[], None] | None) -> Iterator[None]:
        """One call on this GPU: on the caller's current stream (``order_in`` None: nothing waits), or on
        our stream after ``order_in()``, synchronized once at the end (the call's one host wait)."""
        with self.device:
            if order_in is None:
                yield
                return
            with self.stream:
                order_in()
                yield
                self.stream.synchronize()


class NcclTransport:
    """Flat cupy buffers through one NCCL communicator, on cupy's current stream (``transports.Transport``):
    half precision reduced as it is (NCCL has float16), bfloat16 never arrives (cupy has no such dtype: a
    binding widens it to float32).

    Args:
        comm: the MPI communicator whose ranks the NCCL communicator joins (collective).
        device_id: this rank's GPU.
    """

    via = phase = "NCCL"

    def __init__(self, comm: Any, device_id: int) -> None:
        _preload_nccl()
        import cupy
        from cupy.cuda import nccl

        self.cupy, self.nccl, self.device_id = cupy, nccl, device_id
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        with cupy.cuda.Device(device_id):
            self.comm = nccl.NcclCommunicator(self.size, bootstrap_unique_id(comm, nccl.get_unique_id), self.rank)
        self.ops = {ops.Sum: nccl.NCCL_SUM, ops.Average: nccl.NCCL_SUM, ops.Min: nccl.NCCL_MIN,
                    ops.Max: nccl.NCCL_MAX, ops.Product: nccl.NCCL_PROD}
        self.types = {np.dtype(np.int8): nccl.NCCL_INT8, np.dtype(np.uint8): nccl.NCCL_UINT8,
                      np.dtype(np.int32): nccl.NCCL_INT32, np.dtype(np.uint32): nccl.NCCL_UINT32,
                      np.dtype(np.int64): nccl.NCCL_INT64, np.dtype(np.uint64): nccl.NCCL_UINT64,
                      np.dtype(np.float16): nccl.NCCL_FLOAT16, np.dtype(np.float32): nccl.NCCL_FLOAT32,
                      np.dtype(np.float64): nccl.NCCL_FLOAT64}

    def free(self) -> None:
        """Destroy the communicator once the device has finished the calls issued on it (cupy arrays' calls run
        on their callers' streams, which may still be working: a wait at shutdown only)."""
        device = self.cupy.cuda.Device(self.device_id)
        with device:
            device.synchronize()
            self.comm.destroy()

    def array_dtype(self, name: str) -> np.dtype:
        return np.dtype(np.float32) if name == "bfloat16" else np.dtype(name)

    def work_dtype(self, dtype: np.dtype) -> np.dtype:
        return dtype

    def refusal(self, dtype: np.dtype, reducing: bool) -> str | None:
        if reducing and np.dtype(dtype) not in self.types:
            return f"NCCL has no type for {np.dtype(dtype).name} tensors; cast them to float32"
        return None

    def _stream(self) -> int:
        return self.cupy.cuda.get_current_stream().ptr

    def allreduce(self, send: Any, recv: Any, op: int) -> None:
        self.comm.allReduce(send.data.ptr, recv.data.ptr, recv.size, self.types[recv.dtype], self.ops[op],
                            self._stream())

    def allgather(self, send: Any, recv: Any) -> None:
        self.comm.allGather(send.data.ptr, recv.data.ptr, send.size, self.types[send.dtype], self._stream())

    def broadcast(self, buf: Any, root: int) -> None:
        self.comm.broadcast(buf.data.ptr, buf.data.ptr, buf.size, self.types[buf.dtype], root, self._stream())

    def reduce_scatter(self, send: Any, recv: Any, op: int) -> None:
        self.comm.reduceScatter(send.data.ptr, recv.data.ptr, recv.size, self.types[recv.dtype], self.ops[op],
                                self._stream())

    def alltoall(self, send: Any, recv: Any) -> None:
        """NCCL has no alltoall: a send and a receive per rank, in one group."""
        count, stream, kind = send.size // self.size, self._stream(), self.types[send.dtype]
        step = count * send.dtype.itemsize
        self.nccl.groupStart()
        try:
            for r in range(self.size):
                self.comm.send(send.data.ptr + r * step, count, kind, r, stream)
                self.comm.recv(recv.data.ptr + r * step, count, kind, r, stream)
        finally:
            self.nccl.groupEnd()


def _local_device(comm: Any, local_rank: int) -> int:
    """The GPU this rank uses, by local rank; -1 where NCCL is off or there is none."""
    if not (config.NCCL.flag() and gpu_device_present() and nccl_importable()):
        return -1
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        return local_rank % count if count else -1
    except Exception as exc:  # a driver without a usable device, or a cupy for another CUDA
        log.warning("rank %d: cupy sees no usable GPU (%s); GPU tensors will go through the host",
                    comm.Get_rank(), exc)
        return -1


def start(comm: Any, local_rank: int, negotiator: Negotiator, timeline: Timeline) -> ArrayBackend | None:
    """Create the world's NCCL backend where every rank has a GPU (a collective call: every rank must
    make it). None where any rank has none, where cupy is missing, or where ``HVD_NOTEBOOK_NCCL=0``: GPU
    tensors then go through the host."""
    device_id = _local_device(comm, local_rank)
    with_gpu = comm.allgather(device_id >= 0)
    if not all(with_gpu):
        if any(with_gpu) and comm.Get_rank() == 0:
            events.emit(EventKind.WARNING, "only some ranks have a GPU; NCCL is off and every collective goes "
                        "through MPI on the host.")
        return None
    return ArrayBackend(comm, negotiator, timeline, CupyDevice(device_id), NcclTransport(comm, device_id))
