"""The one gradient reduction behind every ``DistributedOptimizer`` (Keras 3 and
TF1) and ``DistributedGradientTape``: dense gradients in one fused
``grouped_allreduce``, sparse ones allgathered, as Horovod does."""

from __future__ import annotations

from typing import Any

from ..core import basics
from ..core.ops import Average, Sum, check_op
from .mpi_ops import allreduce, grouped_allreduce


def reduce_gradients(grads: list[Any], op: int, compression: Any, sparse_as_dense: bool,
                     predivide: float, process_set: Any = None) -> list[Any]:
    """Average (or sum) ``grads`` over ranks (of ``process_set``: on a rank outside it, or in a set of
    one rank, they stay as they are, as Horovod's); None stays None, ``tf.IndexedSlices`` are
    allgathered unless ``sparse_as_dense``."""
    import tensorflow as tf

    check_op(op)
    if process_set is not None and process_set.process_set_id is not None and \
            not (process_set.included() and process_set.size() > 1):
        return list(grads)
    size = basics.size() if process_set is None or process_set.process_set_id is None else process_set.size()
    prescale, postscale, reduce_op = 1.0, 1.0, op
    if op == Average and predivide != 1.0:  # as Horovod: divide before and after the sum
        prescale, postscale, reduce_op = 1.0 / predivide, predivide / size, Sum
    out: list[Any] = list(grads)
    dense = []
    for i, g in enumerate(grads):
        if g is None:
            continue
        if isinstance(g, tf.IndexedSlices):
            if sparse_as_dense:
                out[i] = g = tf.convert_to_tensor(g)
            else:
                out[i] = allreduce(g, op=op, process_set=process_set)
                continue
        dense.append(i)
    if dense:
        reduced = grouped_allreduce([out[i] for i in dense], op=reduce_op, compression=compression,
                                    prescale_factor=prescale, postscale_factor=postscale, process_set=process_set)
        for i, r in zip(dense, reduced):
            out[i] = r
    return out


__all__ = ["reduce_gradients"]
