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
    """The compressor that sends floating tensors as float16: ``hvd.Compression.fp16``.

    Floating tensors, bfloat16 included, travel as float16 and get their dtype back after the collective. Other
    tensors pass unchanged. It takes TensorFlow tensors, numpy and cupy arrays.
    """

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Cast a floating tensor to float16 before a collective sends it.

        Args:
            tensor: a TensorFlow tensor, a numpy or cupy array, or anything ``np.asarray`` takes.

        Returns:
            A tuple ``(compressed, ctx)``. For a floating tensor, the tensor cast to float16 and its original dtype.
            For any other tensor, the tensor itself and None.
        """
        if not _is_floating(tensor):
            return tensor, None
        if _is_tf(tensor):
            import tensorflow as tf

            return tf.cast(tensor, tf.float16), tensor.dtype
        arr = _array(tensor)
        return arr.astype(np.float16), arr.dtype

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Cast a tensor received as float16 back to its original dtype.

        Args:
            tensor: the collective's result.
            ctx: the context ``compress`` returned: the original dtype, or None.

        Returns:
            ``tensor`` cast to the dtype ``ctx`` names; ``tensor`` itself where ``ctx`` is None.
        """
        if ctx is None:
            return tensor
        if _is_tf(tensor):
            import tensorflow as tf

            return tf.cast(tensor, ctx)
        return _array(tensor).astype(ctx)


class Compression:
    """The compressors that collectives and ``DistributedOptimizer`` take, by name.

    ``Compression.none`` sends tensors as they are. ``Compression.fp16`` sends floating tensors as float16 and
    restores their dtype afterwards.

    >>> opt = hvd.DistributedOptimizer(opt, compression=hvd.Compression.fp16)
    """

    none = NoneCompressor
    fp16 = FP16Compressor
