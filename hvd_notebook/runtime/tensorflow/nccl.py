"""TensorFlow GPU tensors through the core's NCCL backend (``nccl_backend``, which works on cupy arrays).

A tensor's device memory reaches cupy through DLPack (``bridges.to_cupy``: no copy), the backend
reduces it on its stream, and each result goes back to TensorFlow the same way
(``bridges.cupy_to_tf``). cupy has no bfloat16: those tensors are reduced as float32 (cast on the
device) and sent as their 16-bit patterns where nothing is reduced. TensorFlow does not expose its
compute stream to Python, so before NCCL reads a tensor the backend waits for the device's queued
work (``tf.test.experimental.sync_devices``): one sync per collective call, not per tensor.
"""

from __future__ import annotations

from typing import Any

from .bridges import cupy_to_tf, tf, to_cupy


def _wait_for_tensorflow(stream: Any) -> None:
    tf().test.experimental.sync_devices()


def _widened(tensor: Any) -> Any:
    t = tf()
    return t.cast(tensor, t.float32) if tensor.dtype == t.bfloat16 else tensor


def _narrowed(result: Any, original: Any) -> Any:
    t = tf()
    return t.cast(result, t.bfloat16) if original.dtype == t.bfloat16 else result


def _as_bits(tensor: Any) -> Any:
    """A bfloat16 tensor as int16 (cupy has no bfloat16); any other as it is."""
    t = tf()
    return t.bitcast(tensor, t.int16) if tensor.dtype == t.bfloat16 else tensor


def _from_bits(result: Any, original: Any) -> Any:
    t = tf()
    return t.bitcast(result, t.bfloat16) if original.dtype == t.bfloat16 else result


class TensorFlowOnNccl:
    """The collectives of ``collectives`` for eager TensorFlow GPU tensors, on one ``NcclBackend``."""

    def __init__(self, nccl: Any) -> None:
        self.nccl = nccl

    def _arrays(self, tensors: list[Any]) -> list[Any]:
        return [to_cupy(t, self.nccl.device_id).reshape(tuple(t.shape.as_list())) for t in tensors]

    def allreduce(self, tensors: list[Any], op: int, prescale: float, postscale: float,
                  names: list[str]) -> list[Any]:
        work = [_widened(t) for t in tensors]
        outs = self.nccl.allreduce(self._arrays(work), op, prescale, postscale, names,
                                   [t.dtype.name for t in tensors], wait=_wait_for_tensorflow)
        return [_narrowed(cupy_to_tf(o), t) for o, t in zip(outs, tensors)]

    def allgather(self, tensors: list[Any], names: list[str]) -> list[Any]:
        outs = self.nccl.allgather(self._arrays([_as_bits(t) for t in tensors]), names,
                                   [t.dtype.name for t in tensors], wait=_wait_for_tensorflow)
        return [_from_bits(cupy_to_tf(o), t) for o, t in zip(outs, tensors)]

    def broadcast(self, tensors: list[Any], root_rank: int, names: list[str]) -> list[Any]:
        outs = self.nccl.broadcast(self._arrays([_as_bits(t) for t in tensors]), root_rank, names,
                                   [t.dtype.name for t in tensors], wait=_wait_for_tensorflow)
        return [_from_bits(cupy_to_tf(o), t) for o, t in zip(outs, tensors)]

    def reducescatter(self, tensors: list[Any], op: int, names: list[str]) -> list[Any]:
        work = [_widened(t) for t in tensors]
        outs = self.nccl.reducescatter(self._arrays(work), op, names, [t.dtype.name for t in tensors],
                                       wait=_wait_for_tensorflow)
        return [_narrowed(cupy_to_tf(o), t) for o, t in zip(outs, tensors)]


__all__ = ["TensorFlowOnNccl"]
