"""PyTorch tensors to the core's arrays and back, without a copy where the memory allows.

The core (``mpi_backend``) works on numpy arrays: a CPU tensor's memory is read as numpy
(``Tensor.numpy()`` shares it) and a result, a numpy array in the core's aligned pool, becomes a
tensor with ``torch.from_numpy`` (shared too). numpy has no bfloat16 that torch knows: bfloat16
tensors are reduced as float32 (as the core reduces every half type) and sent as their 16-bit
patterns where nothing is reduced. A CUDA tensor goes through the host where the world has no NCCL.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def host_array(tensor: torch.Tensor, reducing: bool) -> np.ndarray:
    """``tensor``'s values as a numpy array: a view of a CPU tensor's memory (read, never written),
    a copy of a CUDA tensor's."""
    t = tensor.detach()
    if t.dtype == torch.bfloat16:
        t = t.float() if reducing else t.view(torch.int16)
    if t.device.type != "cpu":
        t = t.cpu()
    return t.numpy()


def as_tensor(array: np.ndarray, like: torch.Tensor, shape: Any = None) -> torch.Tensor:
    """A core result as a tensor of ``like``'s dtype on ``like``'s device (of ``shape`` where given),
    sharing the result's memory where it stays on the host."""
    if not array.flags.writeable:  # (torch warns about read-only arrays: results are ours to hand out)
        array = array.copy()
    out = torch.from_numpy(array)
    if like.dtype == torch.bfloat16:
        out = out.to(torch.bfloat16) if out.dtype != torch.int16 else out.view(torch.bfloat16)
    elif out.dtype != like.dtype:
        out = out.to(like.dtype)
    if shape is not None:
        out = out.reshape(shape)
    if like.device.type != "cpu":
        out = out.to(like.device)
    return out


def check_tensor(tensor: Any, call: str) -> torch.Tensor:
    """``tensor`` itself where it is a ``torch.Tensor``; a clear error where it is not."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{call} takes torch.Tensor, not {type(tensor).__name__} (this is the horovod.torch API: "
                        "hvd_notebook.runtime takes numpy arrays and TensorFlow tensors).")
    if tensor.is_sparse:
        raise TypeError(f"{call}: sparse tensors are not supported; call .to_dense() first.")
    return tensor


def check_same_kind(tensors: list[torch.Tensor], call: str) -> None:
    """One grouped call takes tensors of one device type; mixed ones are refused before any communication."""
    devices = {t.device.type for t in tensors}
    if len(devices) > 1:
        raise ValueError(f"{call}: the tensors of one grouped call must all be on the same kind of device, not "
                         f"{' and '.join(sorted(devices))}; group them by device.")


__all__ = ["as_tensor", "check_same_kind", "check_tensor", "host_array"]
