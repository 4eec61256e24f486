"""``SyncBatchNormalization``: Keras's ``BatchNormalization`` whose training statistics are those of
the global batch (every rank's rows together), as Horovod's ``hvd.SyncBatchNormalization``.

Each rank sums its rows and their squares per channel and counts them; one ``allreduce`` of
those three vectors gives every rank the global mean and variance, exact with unequal batch
sizes (Horovod averages the ranks' means instead, which weighs a small batch as much as a
large one). Inference uses the moving statistics, as ``BatchNormalization`` does.
"""

from __future__ import annotations

from typing import Any

from ... import keras_flavour
from ..core import basics
from ..core.ops import Sum
from ..tensorflow.bridges import tf as _tf
from ..tensorflow.mpi_ops import allreduce

keras = keras_flavour.keras()


@keras.saving.register_keras_serializable(package="hvd_notebook")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with the mean and variance of the batch of all ranks, as Horovod's layer.

    In training, each rank sums its rows and their squares per channel and counts them, and one allreduce of the
    three gives every rank the global mean and variance. They are exact with unequal batch sizes. Inference uses the
    moving statistics, as ``BatchNormalization`` does. On one rank it is ``BatchNormalization`` as it is.

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), hvd.SyncBatchNormalization()])

    Args:
        fused: accepted for Horovod's signature; it must stay False, as in Horovod.
        **kwargs: ``keras.layers.BatchNormalization``'s arguments, such as ``axis``, ``momentum`` and ``epsilon``.

    Raises:
        ValueError: ``fused`` is True or None, or ``synchronized=True`` is given: the layer is synchronised over the
            ranks already.
    """

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if kwargs.get("synchronized"):
            raise ValueError("SyncBatchNormalization(synchronized=True): the layer is synchronised over the "
                             "ranks already (Keras's synchronized= is for tf.distribute); omit it.")
        if keras_flavour.keras2():
            kwargs["fused"] = False  # (Keras 2's fused kernel computes the statistics itself)
        super().__init__(**kwargs)

    # Keras's one hook for the statistics of a training batch (neither Keras has a public one)
    if keras_flavour.keras2():
        def _calculate_mean_and_var(self, inputs: Any, reduction_axes: Any, keep_dims: bool,
                                    mask: Any = None) -> tuple[Any, Any]:
            if basics.size() == 1:
                return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
            return global_moments(inputs, mask, list(reduction_axes), keep_dims)
    else:
        def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
            if basics.size() == 1:
                return super()._moments(inputs, mask)
            rank = inputs.shape.rank
            return global_moments(inputs, mask, [i for i in range(rank) if i != self.axis % rank])


def global_moments(inputs: Any, mask: Any, axes: list[int], keep_dims: bool = False) -> tuple[Any, Any]:
    """Mean and variance over ``axes`` (every axis but the channels') of the rows of every rank; ``mask``
    (one dimension less than ``inputs``, as Keras's) leaves out masked positions."""
    tf = _tf()
    if mask is None:
        total = tf.reduce_sum(inputs, axes, keepdims=keep_dims)
        squares = tf.reduce_sum(tf.square(inputs), axes, keepdims=keep_dims)
        rows = tf.reduce_prod(tf.gather(tf.shape(inputs, out_type=tf.int64), axes))
        count = tf.fill(tf.shape(total), tf.cast(rows, inputs.dtype))
    else:
        weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), inputs.dtype), tf.shape(inputs))
        total = tf.reduce_sum(inputs * weights, axes, keepdims=keep_dims)
        squares = tf.reduce_sum(tf.square(inputs) * weights, axes, keepdims=keep_dims)
        count = tf.reduce_sum(weights, axes, keepdims=keep_dims)
    local = tf.stack([total, squares, count])
    total, squares, count = tf.unstack(allreduce(local, op=Sum))
    count = tf.maximum(count, 1.0)  # a channel with no rows anywhere: zeros, not NaN
    mean = total / count
    # E[x^2] - E[x]^2, as Keras's synchronized moments; rounding can make it a little negative
    variance = tf.maximum(squares / count - tf.square(mean), 0.0)
    return mean, variance


__all__ = ["SyncBatchNormalization", "global_moments"]
