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
    """Initialise the runtime on this process; a second call keeps the world it built.

    A collective call: every rank of the job (or of ``comm``) must make it. It builds the world once; a later call
    only registers the ``process_sets`` it is given. In a notebook the ranks call it at start, so a cell's
    ``hvd.init()`` keeps that world. Where TensorFlow is imported and Keras 3 is in use, it also makes Keras 3
    accept idioms of Horovod's Keras 2 code, such as ``BatchNormalization(fused=False)``.

    >>> import hvd_notebook.runtime as hvd
    >>> hvd.init()
    >>> hvd.rank() < hvd.size()
    True

    Args:
        comm: the ranks to run on. An ``mpi4py`` communicator, or a list of ranks of ``MPI.COMM_WORLD``. The
            default, None, uses ``MPI.COMM_WORLD``. With a list, only the listed ranks may call ``init``.
        process_sets: a list of ``hvd.ProcessSet`` to register, each given its id. Every rank passes the same sets;
            for a set built from a communicator, each rank passes its own. The string ``"dynamic"`` registers none
            but allows ``hvd.add_process_set`` and ``hvd.remove_process_set`` later. The default, None, registers
            none.

    Raises:
        TypeError: ``comm`` is neither an mpi4py communicator nor a list of ranks.
        ValueError: a ``comm`` list that is empty, names a rank outside the world, or leaves out this rank;
            ``process_sets`` that is not a list of ``hvd.ProcessSet`` or ``"dynamic"``; ranks that pass different
            process sets; a process set given twice; or a process set's communicator with ranks outside the world.
        NotImplementedError: a process set built from a communicator while ``comm`` is a list of ranks.
    """
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
    """Return the size of a process set as a TensorFlow op.

    In a graph the size is read when the op runs, so the graph may be built before ``hvd.init()``.

    Args:
        process_set_id: the ``process_set_id`` of a registered ``hvd.ProcessSet``. The default, 0, is the global
            set: every rank.
        name: the op's name in the graph. Defaults to None, TensorFlow's default name.

    Returns:
        A scalar int32 TensorFlow tensor. Eagerly it holds the value now; in a graph, the value when the op runs.

    Raises:
        ValueError: the runtime is not initialised, or no set has this id. In a graph, the op fails with this error
            when it runs.
    """
    return _query_op(lambda: _process_sets.size_of(process_set_id), name)


def rank_op(name: str | None = None) -> Any:
    """Return ``hvd.rank()`` as a TensorFlow op.

    In a graph the rank is read when the op runs, so the graph may be built before ``hvd.init()``.

    Args:
        name: the op's name in the graph. Defaults to None, TensorFlow's default name.

    Returns:
        A scalar int32 TensorFlow tensor. Eagerly it holds the value now; in a graph, the value when the op runs.

    Raises:
        ValueError: the runtime is not initialised. In a graph, the op fails with this error when it runs.
    """
    return _query_op(rank, name)


def local_size_op(name: str | None = None) -> Any:
    """Return ``hvd.local_size()`` as a TensorFlow op.

    In a graph the size is read when the op runs, so the graph may be built before ``hvd.init()``.

    Args:
        name: the op's name in the graph. Defaults to None, TensorFlow's default name.

    Returns:
        A scalar int32 TensorFlow tensor. Eagerly it holds the value now; in a graph, the value when the op runs.

    Raises:
        ValueError: the runtime is not initialised. In a graph, the op fails with this error when it runs.
    """
    return _query_op(local_size, name)


def local_rank_op(name: str | None = None) -> Any:
    """Return ``hvd.local_rank()`` as a TensorFlow op.

    In a graph the rank is read when the op runs, so the graph may be built before ``hvd.init()``.

    Args:
        name: the op's name in the graph. Defaults to None, TensorFlow's default name.

    Returns:
        A scalar int32 TensorFlow tensor. Eagerly it holds the value now; in a graph, the value when the op runs.

    Raises:
        ValueError: the runtime is not initialised. In a graph, the op fails with this error when it runs.
    """
    return _query_op(local_rank, name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """Tell, as a TensorFlow op, whether this process belongs to a process set.

    As in Horovod, the op gives an error code instead of raising.

    Args:
        process_set_id: the ``process_set_id`` of a registered ``hvd.ProcessSet``. The default, 0, is the global
            set: every rank.
        name: the op's name in the graph. Defaults to None, TensorFlow's default name.

    Returns:
        A scalar int32 TensorFlow tensor: 1 where this process belongs to the set, 0 where it does not. Before
        ``hvd.init()`` it is ``PROCESS_SET_ERROR_INIT`` (-1); for an unknown id, ``PROCESS_SET_ERROR_UNKNOWN_SET``
        (-3). Eagerly it holds the value now; in a graph, the value when the op runs.
    """
    return _query_op(lambda: _process_sets.included(process_set_id), name)
