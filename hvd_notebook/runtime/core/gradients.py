"""Each collective's gradient as Horovod defines it, written once for every binding.

A binding's differentiable collective (``tf.custom_gradient`` in ``tensorflow/``, a
``torch.autograd.Function`` in ``torch/``) calls the rule of its collective with ``Ops``: the few
operations the rules are made of, on the binding's own tensors, among the ranks of the call's
process set. The rules never see a framework:

    # tensorflow/mpi_ops.py's grouped_allgather: the rule its custom gradient calls
    lambda ops, dys, xs: _gradients.allgather(ops, dys, [tf.shape(x)[0] for x in xs])
"""

from __future__ import annotations

from typing import Any, Protocol

from .ops import Average, Sum


class Ops(Protocol):
    """What the rules need of a binding, among the ranks of one process set."""

    size: int  # of the process set

    def grouped_allreduce(self, tensors: list[Any], *, op: int, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list[Any]:
        """The binding's (differentiable) grouped allreduce."""

    def grouped_allgather(self, tensors: list[Any]) -> list[Any]:
        """The binding's grouped allgather (along the first dimension)."""

    def alltoall(self, tensor: Any, splits: Any) -> Any:
        """The binding's alltoall: rows ``splits[r]`` of ``tensor`` to rank r; what arrived."""

    def own_rows(self, gathered: Any, rows: Any) -> Any:
        """This rank's block of a tensor gathered along its first dimension, where its own part had ``rows`` rows."""


def allreduce(ops: Ops, grads: list[Any], op: int, prescale: float, postscale: float) -> list[Any]:
    """The gradient of an allreduce is the same allreduce of the gradient."""
    return ops.grouped_allreduce(grads, op=op, prescale_factor=prescale, postscale_factor=postscale)


def allgather(ops: Ops, grads: list[Any], rows: list[Any]) -> list[Any]:
    """The gradient of an allgather: averaged over the ranks, then each rank keeps its own rows
    (``rows``: how many each input had)."""
    averaged = ops.grouped_allreduce(grads, op=Average)
    return [ops.own_rows(g, r) for g, r in zip(averaged, rows)]


def broadcast(ops: Ops, grad: Any, is_root: bool) -> Any:
    """The gradient of a broadcast: averaged over the ranks, and it flows back to the root only."""
    averaged = ops.grouped_allreduce([grad], op=Average)[0]
    return averaged if is_root else averaged * 0


def alltoall(ops: Ops, grad: Any, received: Any) -> Any:
    """The gradient of an alltoall: each rank's rows go back to the rank they came from (``received``:
    how many rows came from each rank)."""
    return ops.alltoall(grad, received)


def reducescatter(ops: Ops, grads: list[Any], op: int, prescale: float, postscale: float) -> list[Any]:
    """The gradient of a reducescatter: every rank's rows gathered, times the size for a Sum and both scale
    factors."""
    factor = (ops.size if op == Sum else 1) * prescale * postscale
    return ops.grouped_allgather([g if factor == 1 else g * factor for g in grads])
