"""The compressor interface every binding's ``Compression`` shares (Horovod's ``Compressor``), and the
compressor that sends tensors as they are."""

from __future__ import annotations

from typing import Any


class Compressor:
    """The interface of a compressor, as Horovod's ``Compressor``: how a tensor travels in a collective.

    A collective calls ``compress`` on each tensor before it sends it, and ``decompress`` on the result with the
    context ``compress`` returned. Subclasses implement both as static methods.
    """

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Compress a tensor before a collective sends it.

        Args:
            tensor: the tensor to send.

        Returns:
            A tuple ``(compressed, ctx)``: the tensor to send, and what ``decompress`` needs to restore it.

        Raises:
            NotImplementedError: always, in this interface; subclasses implement it.
        """
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Restore a tensor that a collective received compressed.

        Args:
            tensor: the collective's result, as compressed.
            ctx: the context that ``compress`` returned for the tensor sent.

        Returns:
            The tensor restored to its original dtype.

        Raises:
            NotImplementedError: always, in this interface; subclasses implement it.
        """
        raise NotImplementedError


class NoneCompressor(Compressor):
    """The compressor that sends tensors as they are: ``hvd.Compression.none``."""

    @staticmethod
    def compress(tensor: Any) -> tuple[Any, Any]:
        """Return ``(tensor, None)``: the tensor is sent unchanged (see ``Compressor.compress``)."""
        return tensor, None

    @staticmethod
    def decompress(tensor: Any, ctx: Any) -> Any:
        """Return ``tensor`` unchanged (see ``Compressor.decompress``)."""
        return tensor
