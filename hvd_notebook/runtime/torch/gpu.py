"""PyTorch CUDA tensors through the core's NCCL backend (``nccl_backend``, which works on cupy arrays).

A tensor's device memory is handed to cupy as it is (an unowned cupy view of ``data_ptr()`` that
keeps the tensor alive: no copy, no trip through the host); results come back with
``torch.from_dlpack``. Ordering without a host wait: when a call is made (in the thread that
computed its inputs, an autograd hook's included), ``Ready`` records an event on that thread's
current PyTorch stream; the backend's stream waits for it before NCCL reads the inputs. The backend
synchronizes its stream before returning, so the results are complete when PyTorch reads them.
cupy has no bfloat16: those tensors are reduced as float32 (cast on the device, before the event)
and sent as their 16-bit patterns where nothing is reduced.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

_NUMPY_NAMES = {torch.float16: "float16", torch.float32: "float32", torch.float64: "float64", torch.int8: "int8",
                torch.uint8: "uint8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64",
                torch.bool: "bool"}


def on_nccl(tensors: list[torch.Tensor], backends: Any) -> bool:
    """Do these tensors go through NCCL (all on CUDA, in a world with NCCL)?"""
    return backends.nccl is not None and bool(tensors) and all(t.is_cuda for t in tensors)


def dtype_name(tensor: torch.Tensor) -> str:
    """The dtype's name as the agreement check names it (``bfloat16`` included)."""
    return str(tensor.dtype).removeprefix("torch.")


class Ready:
    """The point in the caller's stream after which a call's inputs are written, recorded when the
    call is made; ``wait(stream)`` makes the backend's cupy stream wait for it on the device."""

    def __init__(self, tensors: list[torch.Tensor], reducing: bool) -> None:
        self.inputs = [_widened(t) if reducing else _as_bits(t) for t in tensors]  # (cast before the event)
        self.device = tensors[0].device
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(self.device))

    def wait(self, stream: Any) -> None:
        _external(stream.ptr, self.device).wait_event(self.event)


@functools.lru_cache(maxsize=16)
def _external(pointer: int, device: torch.device) -> torch.cuda.ExternalStream:
    """PyTorch's handle on the backend's cupy stream, made once: making one per call was a tenth of a
    small call's time under py-spy (docs/gpus.md)."""
    return torch.cuda.ExternalStream(pointer, device=device)


def _widened(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.dtype == torch.bfloat16 else t


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def as_cupy(tensor: torch.Tensor) -> Any:
    """``tensor``'s device memory as a cupy array of its shape (no copy; the array keeps it alive)."""
    import cupy

    t = tensor if tensor.is_contiguous() else tensor.contiguous()
    memory = cupy.cuda.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t, t.device.index)
    return cupy.ndarray(tuple(t.shape), dtype=_NUMPY_NAMES[t.dtype], memptr=cupy.cuda.MemoryPointer(memory, 0))


def back(result: Any, like: torch.Tensor, reduced: bool) -> torch.Tensor:
    """A backend result as a tensor of ``like``'s dtype on its device (shared memory)."""
    out = torch.from_dlpack(result)
    if like.dtype == torch.bfloat16:
        return out.to(torch.bfloat16) if reduced else out.view(torch.bfloat16)
    return out


def allreduce(nccl: Any, ready: Ready, originals: list[torch.Tensor], op: int, prescale: float, postscale: float,
              names: list[str]) -> list[torch.Tensor]:
    outs = nccl.allreduce([as_cupy(t) for t in ready.inputs], op, prescale, postscale, names,
                          [dtype_name(t) for t in originals], wait=ready.wait)
    return [back(o, t, True) for o, t in zip(outs, originals)]


def allgather(nccl: Any, ready: Ready, originals: list[torch.Tensor], names: list[str]) -> list[torch.Tensor]:
    outs = nccl.allgather([as_cupy(t) for t in ready.inputs], names, [dtype_name(t) for t in originals],
                          wait=ready.wait)
    return [back(o, t, False) for o, t in zip(outs, originals)]


def broadcast(nccl: Any, ready: Ready, originals: list[torch.Tensor], root: int, names: list[str]) -> list[Any]:
    outs = nccl.broadcast([as_cupy(t) for t in ready.inputs], root, names, [dtype_name(t) for t in originals],
                          wait=ready.wait)
    return [back(o, t, False) for o, t in zip(outs, originals)]


def reducescatter(nccl: Any, ready: Ready, originals: list[torch.Tensor], op: int,
                  names: list[str]) -> list[torch.Tensor]:
    outs = nccl.reducescatter([as_cupy(t) for t in ready.inputs], op, names, [dtype_name(t) for t in originals],
                              wait=ready.wait)
    return [back(o, t, True) for o, t in zip(outs, originals)]


__all__ = ["Ready", "allgather", "allreduce", "as_cupy", "back", "broadcast", "dtype_name", "on_nccl",
           "reducescatter"]
