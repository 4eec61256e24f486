"""``hvd.init`` for TensorFlow ranks, the process queries as TensorFlow ops (``rank_op``, ``size_op`` and
friends), read when the op runs, and ``_executing_eagerly``, which Horovod's own tests import from
``horovod.tensorflow.util``."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from ... import keras_flavour
from ..core import basics as _basics
from ..core import process_sets as _process_sets
from ..core.basics import local_rank, local_size, rank
from .bridges import tf as _tf


def init(comm: Any = None, process_sets: Any = None) -> None:
    """``hvd.init`` (``core/basics.init``). Where TensorFlow is in use with Keras 3, Keras's
    ``BatchNormalization`` then takes what Horovod's code written for Keras 2 does
    (``keras_patches.patch_keras2_idioms``)."""
    _basics.init(comm, process_sets)
    if "tensorflow" in sys.modules and not keras_flavour.keras2():  # (tf_keras takes Keras 2's code as it is)
        try:
            from ... import keras_patches

            keras_patches.patch_keras2_idioms()
        except ImportError:  # TensorFlow without Keras: nothing to patch
            pass


def optimizer_variables(optimizer: Any) -> list[Any]:
    """A Keras optimizer's variables: a property in Keras 3 and in Keras 2's newer optimizers, a method in
    Keras 2's legacy ones (and TF's)."""
    variables = optimizer.variables
    return list(variables() if callable(variables) else variables)


def _executing_eagerly() -> bool:
    """True when TensorFlow runs eagerly here (not while building a graph or tracing a ``tf.function``);
    Horovod's own tests import it from ``horovod.tensorflow.util``."""
    return _tf().executing_eagerly()


def _query_op(query: Callable[[], int], name: str | None) -> Any:
    """An int32 scalar op whose value ``query()`` gives when the op runs (in a graph: at ``session.run``)."""
    tf = _tf()
    if tf.executing_eagerly():
        return tf.constant(query(), dtype=tf.int32, name=name)
    out = tf.numpy_function(lambda: np.int32(query()), [], tf.int32, stateful=True, name=name)
    out.set_shape([])
    return out


def size_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """The size of the process set ``process_set_id`` (0: every rank) as a TensorFlow op, read when the op
    runs (a graph may be built before ``init()``)."""
    return _query_op(lambda: _process_sets.size_of(process_set_id), name)


def rank_op(name: str | None = None) -> Any:
    """``rank()`` as a TensorFlow op, read when the op runs."""
    return _query_op(rank, name)


def local_size_op(name: str | None = None) -> Any:
    """``local_size()`` as a TensorFlow op, read when the op runs."""
    return _query_op(local_size, name)


def local_rank_op(name: str | None = None) -> Any:
    """``local_rank()`` as a TensorFlow op, read when the op runs."""
    return _query_op(local_rank, name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """1 if this process belongs to the process set ``process_set_id``, as a TensorFlow op; as Horovod,
    an error code instead: ``PROCESS_SET_ERROR_INIT`` before ``init()``, ``PROCESS_SET_ERROR_UNKNOWN_SET``
    for an unknown set."""
    return _query_op(lambda: _process_sets.included(process_set_id), name)
