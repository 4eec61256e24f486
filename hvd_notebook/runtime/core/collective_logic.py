"""What every backend does around its data movement, written once: the refusals every rank raises
together, the alltoall split check, and a fused allreduce's ``Work`` (``coordinator.Work``), which the
allreduces agreed right after it may join. ``mpi_backend`` (numpy over MPI) and ``array_backend`` (any
array module over any transport: cupy over NCCL on a GPU) both build on it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import ops
from .fusion import fused_label


def refuse_dtype(negotiator: Any, sig: Any, kind: str, name: str, dtype: np.dtype, reducing: bool = False,
                 why: str | None = None) -> None:
    """Raise on every rank where this rank's ``dtype`` cannot take part in the call ``sig``
    (``ops.dtype_refusal``'s reason, else ``why``, a transport's own).

    Args:
        negotiator: the ``negotiation.Negotiator`` of the call's communicator.
        sig: the call's signature.
        kind, name: the call ("allreduce") and the tensor's name, for the message.
        dtype: this rank's dtype.
        reducing: whether the call reduces (an allreduce) or only moves bytes.
        why: a reason of the transport's own (None: it takes every dtype ``ops`` does).
    """
    why = ops.dtype_refusal(dtype, reducing) or why
    if why:
        negotiator.refuse(sig, f"{kind} of '{name}': {why}")


def alltoall_splits(shape: tuple, splits: Any, size: int, name: str) -> np.ndarray:
    """Rows of a tensor of ``shape`` to send to each of ``size`` ranks: ``splits``
    checked, or equal parts where it is None."""
    if len(shape) == 0:
        raise ValueError(f"alltoall of '{name}': the tensor needs at least one dimension.")
    if splits is None:
        if shape[0] % size:
            raise ValueError(f"alltoall of '{name}': without splits, the first dimension ({shape[0]}) "
                             f"must divide evenly by the number of ranks ({size}).")
        return np.full(size, shape[0] // size, dtype=np.int64)
    splits = np.asarray(splits, dtype=np.int64).reshape(-1)
    if splits.size != size or splits.min() < 0 or splits.sum() != shape[0]:
        raise ValueError(f"alltoall of '{name}': splits {splits.tolist()} must have one non-negative entry "
                         f"per rank ({size}) summing to the first dimension ({shape[0]}).")
    return splits


class AllreduceWork:
    """One agreed (fused) allreduce's data movement, which the allreduces agreed right
    after it may join (``Coordinator.run_fused``): one reduction for all their arrays.

    Args:
        backend: what moves the data: ``reduce(arrays, op, prescale, postscale, label)`` returns the
            reduced buffer and each array's element offset in it.
        arrays: this call's arrays (one dtype).
        op, prescale, postscale: the call's reduction (agreed: part of its signature).
        label: the call's name, for the timeline.
    """

    __slots__ = ("backend", "arrays", "op", "prescale", "postscale", "label", "fusion_key", "nbytes", "solo",
                 "done", "result")

    def __init__(self, backend: Any, arrays: list[Any], op: int, prescale: float, postscale: float,
                 label: str) -> None:
        self.backend, self.arrays, self.label = backend, arrays, label
        self.op, self.prescale, self.postscale = op, prescale, postscale
        self.fusion_key = (arrays[0].dtype.str, op, prescale, postscale)  # (all agreed: part of the signatures)
        self.nbytes = sum(a.nbytes for a in arrays)
        self.solo, self.done = True, False
        self.result: tuple[Any, list[int]] = (np.empty(0), [])  # the reduced buffer, each array's offset

    def run(self, followers: list[AllreduceWork]) -> None:
        works = [self, *followers]
        arrays = [a for w in works for a in w.arrays]
        label = fused_label([w.label for w in works])
        buf, offsets = self.backend.reduce(arrays, self.op, self.prescale, self.postscale, label)
        start = 0
        for w in works:
            w.result = (buf, offsets[start:start + len(w.arrays)])
            start += len(w.arrays)
