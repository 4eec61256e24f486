"""The one gradient reduction behind every ``DistributedOptimizer`` (Keras 3 and
TF1) and ``DistributedGradientTape``: dense gradients in one fused
``grouped_allreduce``, sparse ones allgathered, as Horovod does; on the way, the
two squared norms the gradient noise scale needs (``core.noise_scale``)."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..core import basics
from ..core import noise_scale as _noise_scale
from ..core.ops import Adasum, Average, Sum, check_op
from .compression import Compression
from .mpi_ops import allreduce, grouped_allreduce


@dataclass
class TrainingStep:
    """The Keras training step being traced: its batch size (a scalar tensor), and the estimator its
    gradient reduction measured the noise scale into, if it did."""

    batch: Any
    noise: _noise_scale.NoiseScale | None = None


_step: contextvars.ContextVar[TrainingStep | None] = contextvars.ContextVar("hvd_training_step", default=None)


@contextlib.contextmanager
def training_step(batch: Any) -> Iterator[TrainingStep]:
    """While a Keras ``train_step`` is traced: the reductions inside take ``batch`` as their batch size."""
    token = _step.set(TrainingStep(batch))
    try:
        yield _step.get()
    finally:
        _step.reset(token)


def reduce_gradients(grads: list[Any], op: int, compression: Any, sparse_as_dense: bool,
                     predivide: float, process_set: Any = None, noise: _noise_scale.NoiseScale | None = None,
                     passes: int = 1, unscale: Any = None) -> list[Any]:
    """Average (or sum) ``grads`` over ranks (of ``process_set``: on a rank outside it, or in a set of
    one rank, they stay as they are, as Horovod's); None stays None, ``tf.IndexedSlices`` are
    allgathered unless ``sparse_as_dense``.

    With a ``noise`` estimator (and the measurement on, ``noise_scale.enabled``), the step's squared
    norms go to it: this rank's, reduced in the same fused call as the gradients, and the average's.
    Inside a Keras ``training_step`` its batch size is the samples per backward pass; ``passes`` are the
    passes accumulated into ``grads``, ``unscale`` the factor that undoes a loss scale."""
    import tensorflow as tf

    check_op(op)
    if process_set is not None and process_set.process_set_id is not None and \
            not (process_set.included() and process_set.size() > 1):
        return list(grads)
    size = basics.size() if process_set is None or process_set.process_set_id is None else process_set.size()
    measure = noise is not None and op != Adasum and _noise_scale.enabled(size)
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
    extra = []
    if measure:
        local_sq = tf.reshape(_squared_norm([g for g in grads if g is not None]), [1])
        if compression is Compression.none:  # travels in the gradients' fusion buffer
            extra = [local_sq]
        else:  # (fp16 could overflow a squared norm)
            local_sq = allreduce(local_sq, op=op, prescale_factor=prescale, postscale_factor=postscale,
                                 process_set=process_set)
    if dense or extra:
        reduced = grouped_allreduce([out[i] for i in dense] + extra, op=reduce_op, compression=compression,
                                    prescale_factor=prescale, postscale_factor=postscale, process_set=process_set)
        for i, r in zip(dense, reduced):
            out[i] = r
        if extra:
            local_sq = reduced[-1]
    if measure:
        global_sq = _squared_norm([g for g in out if g is not None])
        if op == Sum:  # the reduction summed: the averages are 1/size of it
            local_sq, global_sq = local_sq / size, global_sq / (size * size)
        if unscale is not None:
            factor = tf.cast(unscale, tf.float32) ** 2
            local_sq, global_sq = local_sq * factor, global_sq * factor
        step = _step.get()
        if step is not None:
            step.noise = noise
        _record(noise, tf.reshape(local_sq, []), global_sq, size, None if step is None else step.batch, passes)
    return out


def _squared_norm(grads: list[Any]) -> Any:
    """The squared L2 norm of all of ``grads`` together, as a float32 scalar, computed where they live;
    a ``tf.IndexedSlices`` counts as the dense gradient it stands for (repeated rows summed first)."""
    import tensorflow as tf

    terms = []
    for g in grads:
        if isinstance(g, tf.IndexedSlices):
            rows, where = tf.unique(g.indices)
            g = tf.math.unsorted_segment_sum(g.values, where, tf.shape(rows)[0])
        terms.append(tf.reduce_sum(tf.square(tf.cast(g, tf.float32))))
    return tf.add_n(terms) if terms else tf.zeros([])


def _record(noise: _noise_scale.NoiseScale, local_sq: Any, global_sq: Any, size: int, batch: Any,
            passes: int) -> None:
    """Hand the step's norms to the estimator on the host (inside ``tf.function`` too)."""
    import tensorflow as tf

    def record(local: Any, global_: Any, *samples: Any) -> None:
        _noise_scale.record(noise, float(local), float(global_), size, int(samples[0]) if samples else None, passes)

    inputs = [local_sq, global_sq] + ([tf.cast(batch, tf.int64)] if batch is not None else [])
    if tf.executing_eagerly():
        record(*(t.numpy() for t in inputs))
    else:
        tf.numpy_function(record, inputs, [], stateful=True)


def noise_scale_of(noise: _noise_scale.NoiseScale) -> Any:
    """The estimator's current figure as a float32 tensor (NaN while it has none), read on the host after
    the step's own record (inside ``tf.function``, stateful ops run in program order)."""
    import tensorflow as tf

    def read() -> Any:
        value = noise.value()
        return np.float32("nan" if value is None else value)

    return tf.numpy_function(read, [], tf.float32, stateful=True)


def telling_batch(train_step: Any) -> Any:
    """Keras's ``Model.train_step`` (Keras 3's or Keras 2's) that tells the gradient reduction inside its batch
    size, so that a ``DistributedOptimizer`` knows how many samples its gradients stand for, and adds the noise
    scale it measured to the step's logs (``history.history["noise_scale"]``, the progress bar, the dashboard)."""
    import tensorflow as tf

    @functools.wraps(train_step)
    def wrapper(self: Any, data: Any) -> Any:
        leaves = tf.nest.flatten(data)
        with training_step(tf.shape(leaves[0])[0] if leaves else None) as step:
            logs = train_step(self, data)
        if step.noise is not None and isinstance(logs, dict):
            logs = {**logs, "noise_scale": noise_scale_of(step.noise)}
        return logs

    return wrapper


__all__ = ["reduce_gradients", "telling_batch", "training_step"]
