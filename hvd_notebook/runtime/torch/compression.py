"""Gradient compression for PyTorch tensors, as ``horovod.torch.Compression``: ``Compression.fp16``
sends floating tensors as float16 and restores their dtype afterwards; others pass unchanged."""

from __future__ import annotations

from typing import Any

import torch

from ..core.compression import Compressor, NoneCompressor


class FP16Compressor(Compressor):
    """The compressor that sends floating tensors as float16: ``hvd.Compression.fp16``.

    Floating tensors travel as float16 and get their dtype back after the collective. Other tensors, and float16
    ones, pass unchanged.
    """

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Cast a floating tensor to float16 before a collective sends it.

        Args:
            tensor: a ``torch.Tensor``.

        Returns:
            A tuple ``(compressed, ctx)``. For a floating tensor other than float16, the tensor cast to float16 and
            its original dtype. For any other tensor, the tensor itself and None.
        """
        if not tensor.is_floating_point() or tensor.dtype == torch.float16:
            return tensor, None
        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        """Cast a tensor received as float16 back to its original dtype.

        Args:
            tensor: the collective's result.
            ctx: the context ``compress`` returned: the original ``torch.dtype``, or None.

        Returns:
            ``tensor`` cast to ``ctx``; ``tensor`` itself where ``ctx`` is None.
        """
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """The compressors that collectives and ``DistributedOptimizer`` take, by name.

    ``Compression.none`` sends tensors as they are. ``Compression.fp16`` sends floating tensors as float16 and
    restores their dtype afterwards.

    >>> opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
    ...                                compression=hvd.Compression.fp16)
    """

    none = NoneCompressor
    fp16 = FP16Compressor


__all__ = ["Compression", "FP16Compressor", "NoneCompressor"]
