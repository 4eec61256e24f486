"""Tensor bridges: TensorFlow tensors to numpy or cupy arrays and back, through
DLPack and without a copy where the memory allows.

The backends work on numpy (host) and cupy (GPU) arrays; ``collectives`` hands
them TensorFlow's memory through these functions, and adopts their results the
same way. TensorFlow is imported only when a tensor is met.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..core.fusion import is_aligned

_KDL_CPU, _KDL_CUDA = 1, 2  # DLPack device types


def tf() -> Any:
    """The ``tensorflow`` module (imported on first use)."""
    import tensorflow

    return tensorflow


def is_tf(x: Any) -> bool:
    """Is ``x`` a TensorFlow (or Keras) object? Asked without importing TensorFlow."""
    return type(x).__module__.startswith(("tensorflow", "keras"))


def is_eager(x: Any) -> bool:
    """An eager tensor (it holds a value; graph tensors do not)."""
    return type(x).__name__ == "EagerTensor"


def is_gpu_tensor(tensor: Any) -> bool:
    """A TensorFlow tensor placed on a GPU (eager tensors know their device)."""
    device = getattr(tensor, "device", "") or ""
    return "GPU" in device.upper()


class DLPackExport:
    """Hands a TensorFlow tensor to a DLPack consumer (``np.from_dlpack``,
    ``cupy.from_dlpack``) as a view of its memory, no copy."""

    def __init__(self, tensor: Any, device_id: int | None = None) -> None:
        self.tensor = tensor
        self.device = (_KDL_CPU, 0) if device_id is None else (_KDL_CUDA, device_id)

    def __dlpack__(self, stream: Any = None, **kwargs: Any) -> Any:
        return tf().experimental.dlpack.to_dlpack(self.tensor)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device


def to_numpy(tensor: Any) -> np.ndarray:
    """A tensor's host memory as numpy without a copy (a device tensor is copied
    to the host once). The runtime only reads these arrays, never writes them."""
    if is_eager(tensor):
        try:
            # shares the eager tensor's host buffer (``numpy()`` would copy); a scalar or a string comes as a
            # numpy scalar or bytes, which np.asarray makes an array
            arr = tensor._numpy()
            return arr if type(arr) is np.ndarray else np.asarray(tensor)
        except (TypeError, ValueError, AttributeError):
            pass
    if tensor.dtype in dlpack_dtypes() and tensor.device.endswith("CPU:0"):
        try:
            return np.from_dlpack(DLPackExport(tensor))
        except (TypeError, ValueError, RuntimeError, BufferError):
            pass
    return tensor.numpy()


def to_tf(array: np.ndarray, dtype: Any) -> Any:
    """A numpy result as a TensorFlow tensor of ``dtype``; 64-byte aligned results
    are adopted without a copy."""
    dtype = tf().as_dtype(dtype)
    # TensorFlow aborts the process on a misaligned adopted buffer: check first
    if array.dtype == numpy_dtype(dtype) and is_aligned(array) and array.flags.c_contiguous:
        return adopt(array)
    return tf().convert_to_tensor(array, dtype=dtype)


def adopt(array: np.ndarray) -> Any:
    """An aligned, contiguous numpy array (a pooled result) as a TensorFlow tensor of
    its own dtype, without a copy where DLPack carries that dtype."""
    if array.size and array.dtype in _dlpack_numpy_dtypes():
        try:
            return _from_dlpack()(array.__dlpack__())
        except (TypeError, ValueError, RuntimeError, BufferError):
            pass
    return tf().convert_to_tensor(array)


@functools.cache
def _from_dlpack() -> Any:
    """``tf.experimental.dlpack.from_dlpack`` without its Python wrapper, which costs every small result about
    half as much again as the import itself; the public function where TensorFlow's inside differs."""
    from tensorflow.python import pywrap_tfe
    from tensorflow.python.eager import context

    capsule_to_tensor = getattr(pywrap_tfe, "TFE_FromDlpackCapsule", None)
    if capsule_to_tensor is None or not hasattr(context.Context, "_handle"):
        return tf().experimental.dlpack.from_dlpack
    context_of = context.context

    def from_dlpack(capsule: Any) -> Any:
        ctx = context_of()
        ctx.ensure_initialized()
        return capsule_to_tensor(capsule, ctx._handle)

    return from_dlpack


@functools.cache
def _dlpack_numpy_dtypes() -> frozenset[np.dtype]:
    return frozenset(np.dtype(numpy_dtype(d)) for d in dlpack_dtypes())


@functools.cache
def numpy_dtype(dtype: Any) -> Any:
    """``dtype.as_numpy_dtype``, cached (TensorFlow computes it on every access)."""
    return dtype.as_numpy_dtype


@functools.cache
def dlpack_dtypes() -> frozenset[Any]:
    """The dtypes that TensorFlow and numpy exchange through DLPack."""
    t = tf()
    return frozenset({t.float16, t.float32, t.float64, t.int8, t.int16, t.int32, t.int64, t.uint8})
