"""Gradient compression for PyTorch tensors, as ``horovod.torch.Compression``: ``Compression.fp16``
sends floating tensors as float16 and restores their dtype afterwards; others pass unchanged."""

from __future__ import annotations

from typing import Any

import torch

from ..core.compression import Compressor, NoneCompressor


class FP16Compressor(Compressor):
    """Sends floating tensors as float16; ``decompress`` restores the dtype."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if not tensor.is_floating_point() or tensor.dtype == torch.float16:
            return tensor, None
        return tensor.to(torch.float16), tensor.dtype

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """The compressors, by name: ``Compression.none`` and ``Compression.fp16``."""

    none = NoneCompressor
    fp16 = FP16Compressor


__all__ = ["Compression", "FP16Compressor", "NoneCompressor"]
