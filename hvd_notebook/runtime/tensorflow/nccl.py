"""TensorFlow GPU tensors through the core's NCCL backend (``array_backend.ArrayBackend`` on the GPU seams of
``nccl_backend``).

A tensor's device memory reaches the backend through DLPack (``nccl_backend.from_dlpack``: no copy), the
backend packs, reduces and unpacks on its stream, and each result goes back to TensorFlow the same way
(``nccl_backend.to_dlpack``). The backend's arrays have no bfloat16: those tensors are reduced as float32
(cast on the device) and sent as their 16-bit patterns where nothing is reduced. TensorFlow does not
expose its compute stream to Python, so before the backend reads a tensor it waits for the device's queued
work (``tf.test.experimental.sync_devices``), once per collective call, not per tensor; the backend then
waits once for its own stream before TensorFlow reads the results.

Unverified on a GPU: no TensorFlow wheel fits what reaches the lent GPU machine, so this path runs only
where a user has TensorFlow's CUDA build (``docs/gpus.md``). The backend itself runs on the CPU tests with
numpy and mpi4py, and on the lent GPU with cupy arrays (``tests/parallel/test_array_backend.py``).
"""

from __future__ import annotations

from typing import Any

from ..core import nccl_backend as _device
from .bridges import DLPackExport, tf


def _wait_for_tensorflow() -> None:
    tf().test.experimental.sync_devices()


def _widened(tensor: Any) -> Any:
    t = tf()
    return t.cast(tensor, t.float32) if tensor.dtype == t.bfloat16 else tensor


def _narrowed(result: Any, original: Any) -> Any:
    t = tf()
    return t.cast(result, t.bfloat16) if original.dtype == t.bfloat16 else result


def _as_bits(tensor: Any) -> Any:
    """A bfloat16 tensor as int16 (the backend's arrays have no bfloat16); any other as it is."""
    t = tf()
    return t.bitcast(tensor, t.int16) if tensor.dtype == t.bfloat16 else tensor


def _from_bits(result: Any, original: Any) -> Any:
    t = tf()
    return t.bitcast(result, t.bfloat16) if original.dtype == t.bfloat16 else result


def _adopted(array: Any) -> Any:
    """A backend result as a TensorFlow tensor on the same GPU (no copy)."""
    return tf().experimental.dlpack.from_dlpack(_device.to_dlpack(array))


class TensorFlowOnNccl:
    """The collectives of ``mpi_ops`` for eager TensorFlow GPU tensors, on one NCCL backend.

    Args:
        backend: the NCCL backend (``array_backend.ArrayBackend`` on cupy and NCCL).
        to_array: a tensor as the backend's array; None: its GPU memory through DLPack, no copy (the CPU tests
            give the host backend numpy's view of a host tensor).
        to_tensor: a backend result as a TensorFlow tensor; None: adopted through DLPack, no copy.
    """

    def __init__(self, backend: Any, to_array: Any = None, to_tensor: Any = None) -> None:
        self.backend = backend
        self.to_array = to_array or (lambda t: _device.from_dlpack(DLPackExport(t, backend.device_id)))
        self.to_tensor = to_tensor or _adopted

    def _arrays(self, tensors: list[Any]) -> list[Any]:
        return [self.to_array(t).reshape(tuple(t.shape.as_list())) for t in tensors]

    def allreduce(self, tensors: list[Any], op: int, prescale: float, postscale: float,
                  names: list[str]) -> list[Any]:
        work = [_widened(t) for t in tensors]
        outs = self.backend.allreduce(self._arrays(work), op, prescale, postscale, names,
                                      [t.dtype.name for t in tensors], order_in=_wait_for_tensorflow)
        return [_narrowed(self.to_tensor(o), t) for o, t in zip(outs, tensors)]

    def allgather(self, tensors: list[Any], names: list[str]) -> list[Any]:
        outs = self.backend.allgather(self._arrays([_as_bits(t) for t in tensors]), names,
                                      [t.dtype.name for t in tensors], order_in=_wait_for_tensorflow)
        return [_from_bits(self.to_tensor(o), t) for o, t in zip(outs, tensors)]

    def broadcast(self, tensors: list[Any], root_rank: int, names: list[str]) -> list[Any]:
        outs = self.backend.broadcast(self._arrays([_as_bits(t) for t in tensors]), root_rank, names,
                                      [t.dtype.name for t in tensors], order_in=_wait_for_tensorflow)
        return [_from_bits(self.to_tensor(o), t) for o, t in zip(outs, tensors)]

    def reducescatter(self, tensors: list[Any], op: int, names: list[str]) -> list[Any]:
        work = [_widened(t) for t in tensors]
        outs = self.backend.reducescatter(self._arrays(work), op, names, [t.dtype.name for t in tensors],
                                          order_in=_wait_for_tensorflow)
        return [_narrowed(self.to_tensor(o), t) for o, t in zip(outs, tensors)]


__all__ = ["TensorFlowOnNccl"]
