"""``SyncBatchNormalization``: Keras's ``BatchNormalization`` whose training statistics are those of
the global batch (every rank's rows together), as Horovod's ``hvd.SyncBatchNormalization``.

Each rank sums its rows and their squares per channel and counts them; one ``allreduce`` of
those three vectors gives every rank the global mean and variance, exact with unequal batch
sizes (Horovod averages the ranks' means instead, which weighs a small batch as much as a
large one). Inference uses the moving statistics, as ``BatchNormalization`` does.
"""

from __future__ import annotations

from typing import Any

import keras

from ..core import basics
from ..core.ops import Sum
from ..tensorflow.bridges import tf as _tf
from ..tensorflow.mpi_ops import allreduce


@keras.saving.register_keras_serializable(package="hvd_notebook")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with the mean and variance of the batch of all ranks in training.

    >>> model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16), hvd.SyncBatchNormalization()])

    Takes ``BatchNormalization``'s arguments; ``fused`` exists for Horovod's signature and
    must stay False, as in Horovod.
    """

    def __init__(self, fused: bool | None = False, **kwargs: Any) -> None:
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True.")
        if kwargs.get("synchronized"):
            raise ValueError("SyncBatchNormalization(synchronized=True): the layer is synchronised over the "
                             "ranks already (Keras's synchronized= is for tf.distribute); omit it.")
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        # Keras's one hook for the statistics of a training batch (it has no public one)
        if basics.size() == 1:
            return super()._moments(inputs, mask)
        return global_moments(inputs, mask, self.axis)


def global_moments(inputs: Any, mask: Any, axis: int) -> tuple[Any, Any]:
    """Mean and variance per channel (``axis``) over the rows of every rank; ``mask`` (one dimension
    less than ``inputs``, as Keras's) leaves out masked positions."""
    tf = _tf()
    rank = inputs.shape.rank
    axes = [i for i in range(rank) if i != axis % rank]
    if mask is None:
        total, squares = tf.reduce_sum(inputs, axes), tf.reduce_sum(tf.square(inputs), axes)
        rows = tf.size(inputs, out_type=tf.int64) // tf.shape(inputs, out_type=tf.int64)[axis]
        count = tf.fill(tf.shape(total), tf.cast(rows, inputs.dtype))
    else:
        weights = tf.broadcast_to(tf.cast(tf.expand_dims(mask, -1), inputs.dtype), tf.shape(inputs))
        total, squares = tf.reduce_sum(inputs * weights, axes), tf.reduce_sum(tf.square(inputs) * weights, axes)
        count = tf.reduce_sum(weights, axes)
    local = tf.stack([total, squares, count])
    total, squares, count = tf.unstack(allreduce(local, op=Sum))
    count = tf.maximum(count, 1.0)  # a channel with no rows anywhere: zeros, not NaN
    mean = total / count
    # E[x^2] - E[x]^2, as Keras's synchronized moments; rounding can make it a little negative
    variance = tf.maximum(squares / count - tf.square(mean), 0.0)
    return mean, variance


__all__ = ["SyncBatchNormalization", "global_moments"]
