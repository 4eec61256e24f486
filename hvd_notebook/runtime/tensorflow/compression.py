"""Gradient compression for collectives, as ``horovod.tensorflow.Compression``.

``Compression.fp16`` sends floating tensors as float16 and restores their dtype
afterwards; other tensors pass unchanged. Works on numpy and cupy arrays and
TensorFlow tensors alike.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.compression import Compressor, NoneCompressor
from .bridges import is_tf as _is_tf


def _array(x: Any) -> Any:
    """``x`` as an array with ``dtype`` and ``astype``: numpy and cupy arrays as they are, anything else
    through numpy."""
    return x if hasattr(x, "dtype") and hasattr(x, "astype") else np.asarray(x)


def _is_floating(x: Any) -> bool:
    if _is_tf(x):
        return x.dtype.is_floating
    dtype = np.dtype(_array(x).dtype)
    return np.issubdtype(dtype, np.floating) or str(dtype) == "bfloat16"


class FP16Compressor(Compressor):
    """Sends floating tensors as float16; ``decompress`` restores the dtype."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        if not _is_floating(tensor):
            return tensor, None
        if _is_tf(tensor):
            import tensorflow as tf

            return tf.cast(tensor, tf.float16), tensor.dtype
        arr = _array(tensor)
        return arr.astype(np.float16), arr.dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        if ctx is None:
            return tensor
        if _is_tf(tensor):
            import tensorflow as tf

            return tf.cast(tensor, ctx)
        return _array(tensor).astype(ctx)


class Compression:
    """The compressors, by name: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor
