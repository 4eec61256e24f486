"""Every CUDA-specific call of the PyTorch binding, each a pass-through for CPU tensors.

A collective is ordered after the work that wrote its inputs without a host wait: ``mark`` records an event on
the caller's current stream when the call is made (in the caller's thread); the thread that packs and issues it
works ``enter``-ed on a side stream that waits for that event; ``after`` makes the caller's stream wait for a
``torch.distributed`` work (on NCCL, ``work.wait()`` is a stream wait, not a host wait; on gloo it waits for the
data to arrive, which is the data movement itself). A call's inputs stay referenced until its caller has waited,
so the caching allocator reuses their memory only behind that wait. A test's rule keeps ``torch.cuda`` out of
every other module of the binding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

_side_streams: dict[Any, Any] = {}  # one side stream per device, made once


def mark(tensors: list[torch.Tensor]) -> Any:
    """(An event recorded now on the current stream of ``tensors``' device, that device); None for CPU tensors."""
    if not tensors or not tensors[0].is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensors[0].device))
    return event, tensors[0].device


@contextlib.contextmanager
def enter(marks: list[Any]) -> Iterator[Any]:
    """Where the block's work runs: a side stream of the marks' device (not the calling thread's current one: a
    worker's is device 0) that first waits for each of ``marks`` (``mark``'s events); the current stream as it is
    for CPU tensors (no event). Yields the stream (None on CPU)."""
    marked = [m for m in marks if m is not None]
    if not marked:
        yield None
        return
    where = marked[0][1]
    side = _side_streams.get(where)
    if side is None:
        side = _side_streams[where] = torch.cuda.Stream(device=where)
    for event, _ in marked:
        side.wait_event(event)
    with torch.cuda.device(where), torch.cuda.stream(side):
        yield side


def after(work: Any, buffer: torch.Tensor) -> None:
    """The caller's current stream waits for ``work`` (a ``torch.distributed`` work) that fills ``buffer``: on
    NCCL a stream wait (and ``buffer``, made on a side stream, is kept for the caller's), on gloo the end of the
    data movement."""
    work.wait()
    if buffer.is_cuda:
        buffer.record_stream(torch.cuda.current_stream(buffer.device))


def working_device(nccl: bool) -> torch.device:
    """Where a joined rank's zeros are made: the current CUDA device on NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")


def to_host(tensors: list[torch.Tensor]) -> Any:
    """Scalar tensors' values on their way to the host: the floats at once for CPU tensors; for CUDA ones a
    copy into pinned memory queued on the current stream, with an event, read by ``read`` once it is there."""
    if not is_cuda(tensors):
        return [float(t) for t in tensors]
    values = torch.stack([t.float() for t in tensors])
    host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
    host.copy_(values, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(values.device))
    return host, event


def read(copy: Any) -> list[float] | None:
    """``to_host``'s values where they have reached the host; None while they are on their way (no wait)."""
    if isinstance(copy, list):
        return copy
    host, event = copy
    return host.tolist() if event.query() else None


def available() -> bool:
    """Is a CUDA device there for this process?"""
    return torch.cuda.is_available()


def is_cuda(tensors: list[torch.Tensor]) -> bool:
    """Are ``tensors`` on a CUDA device (the first decides: a call's tensors share one kind of device)?"""
    return bool(tensors) and tensors[0].is_cuda


__all__ = ["after", "available", "enter", "is_cuda", "mark", "read", "to_host", "working_device"]
