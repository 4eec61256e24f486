"""Horovod's Keras module on the runtime: what ``horovod.tensorflow.keras`` and ``horovod.keras`` give.

The same process queries and training classes as the runtime (``hvd.callbacks``, ``DistributedOptimizer``,
``PartialDistributedOptimizer``, ``SyncBatchNormalization``, ``load_model``), and the Keras module's own
collectives, which take any tensor-like value (numpy array, list, number) and return a tensor:
``allreduce(value, name=None, average=None, ...)``, ``allgather``, ``broadcast``, ``reducescatter``, and
``broadcast_global_variables(root_rank)``. Importing it imports Keras (as Horovod's does).
"""

from __future__ import annotations

from typing import Any

from ... import keras_flavour
from ..core.basics import (
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    rocm_built,
    shutdown,
    size,
)
from ..core.debugger import breakpoint
from ..core.noise_scale import noise_scale
from ..core.objects import start_timeline, stop_timeline
from ..core.ops import Adasum, Average, Sum
from ..core.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from ..tensorflow import mpi_ops as collectives
from ..tensorflow.bridges import tf as _tf
from ..tensorflow.compression import Compression
from ..tensorflow.tf1 import broadcast_global_variables as _graph_broadcast_global_variables
from ..tensorflow.util import init
from . import callbacks, elastic
from .sync_batch_norm import SyncBatchNormalization
from .training import DistributedOptimizer, PartialDistributedOptimizer, load_model


def _evaluated(result: Any) -> Any:
    """As Horovod's Keras module: eagerly the result itself; in a TF1 graph, its value in the default
    session, or under Keras 2 in Keras's own session (``K.get_session()``, as Horovod's); under Keras 3, which
    has no session, without a default one the tensor, for the caller's session to run."""
    tf = _tf()
    if tf.executing_eagerly():
        return result
    session = tf.compat.v1.get_default_session()
    if session is None and keras_flavour.keras2():
        session = tf.compat.v1.keras.backend.get_session()
    return result if session is None else session.run(result)


def allreduce(value: Any, name: str | None = None, average: bool | None = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0, op: int | None = None, compression: Any = Compression.none) -> Any:
    """Reduce a tensor-like value over all ranks, by default to its average.

    This is Horovod's Keras ``allreduce``: ``value`` becomes a tensor first, and in a graph the result is evaluated.
    Otherwise it is ``hvd.allreduce`` of the TensorFlow binding.

    Args:
        value: a tensor, a numpy array, a list or a number: anything ``tf.constant`` takes. Every rank passes one of
            the same shape and dtype.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order.
        average: Horovod's deprecated form of ``op``: True means ``hvd.Average``, False ``hvd.Sum``. Give ``op`` or
            ``average``, not both.
        prescale_factor: a factor applied to each rank's value before the reduction. Defaults to 1.0.
        postscale_factor: a factor applied to the result after the reduction. Defaults to 1.0.
        op: the reduction: ``hvd.Average``, ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``. With neither
            ``op`` nor ``average``, ``hvd.Average``.
        compression: ``hvd.Compression.none`` (the default), or ``hvd.Compression.fp16`` to send floating values as
            float16.

    Returns:
        The reduced value, of ``value``'s shape and dtype. Eagerly, a ``tf.Tensor``. In a TF1 graph, its value as a
        numpy array, evaluated in the default session, or in Keras 2's session where there is none. Under Keras 3
        with no default session, the tensor itself, for the caller's session to run.

    Raises:
        ValueError: ``tf.constant`` cannot make a tensor of ``value``; the runtime is not initialised; ``op`` and
            ``average`` are both given, or ``op`` is not an op; or a rank's value cannot be reduced, in which case
            every rank raises.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
        MismatchError: the ranks' calls do not match. Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    return _evaluated(collectives.allreduce(_tf().constant(value), average=average, compression=compression,
                                            op=op, prescale_factor=prescale_factor,
                                            postscale_factor=postscale_factor, name=name))


def allgather(value: Any, name: str | None = None) -> Any:
    """Concatenate a tensor-like value from every rank along its first dimension.

    This is Horovod's Keras ``allgather``: ``value`` becomes a tensor first, and in a graph the result is evaluated.
    Otherwise it is ``hvd.allgather`` of the TensorFlow binding.

    Args:
        value: a tensor, a numpy array or a list: anything ``tf.constant`` takes, of at least one dimension. The
            first dimension may differ between ranks; the others and the dtype may not.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order.

    Returns:
        Every rank's value concatenated in rank order. Eagerly, a ``tf.Tensor``. In a TF1 graph, its value as a
        numpy array, evaluated in the default session, or in Keras 2's session where there is none. Under Keras 3
        with no default session, the tensor itself, for the caller's session to run.

    Raises:
        ValueError: ``tf.constant`` cannot make a tensor of ``value``; the runtime is not initialised, or a rank's
            value is a scalar or of a dtype that cannot be sent, in which case every rank raises.
        MismatchError: the ranks' calls do not match. Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    return _evaluated(collectives.allgather(_tf().constant(value), name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """Give every rank the root rank's tensor-like value.

    This is Horovod's Keras ``broadcast``: ``value`` becomes a tensor first, and in a graph the result is evaluated.
    Otherwise it is ``hvd.broadcast`` of the TensorFlow binding.

    Args:
        value: a tensor, a numpy array, a list or a number: anything ``tf.constant`` takes. Every rank passes one of
            the same shape and dtype; only the root's values are read.
        root_rank: the rank whose value every rank gets.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order.

    Returns:
        The root's value, of ``value``'s shape and dtype. Eagerly, a ``tf.Tensor``. In a TF1 graph, its value as a
        numpy array, evaluated in the default session, or in Keras 2's session where there is none. Under Keras 3
        with no default session, the tensor itself, for the caller's session to run.

    Raises:
        ValueError: ``tf.constant`` cannot make a tensor of ``value``; the runtime is not initialised, or
            ``root_rank`` is not a rank, in which case every rank raises.
        MismatchError: the ranks' calls do not match. Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    return _evaluated(collectives.broadcast(_tf().constant(value), root_rank, name=name))


def reducescatter(value: Any, name: str | None = None, op: int = Average) -> Any:
    """Reduce a tensor-like value over all ranks, and keep this rank's block of rows.

    This is Horovod's Keras ``reducescatter``: ``value`` becomes a tensor first, and in a graph the result is
    evaluated. Otherwise it is ``hvd.reducescatter`` of the TensorFlow binding: the rows are split as evenly as
    possible, the first ``rows % size`` ranks getting one more.

    Args:
        value: a tensor, a numpy array or a list: anything ``tf.constant`` takes, of at least one dimension. Every
            rank passes one of the same shape and dtype.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes an automatic name, so that nameless calls pair in call order.
        op: the reduction: ``hvd.Average`` (the default), ``hvd.Sum``, ``hvd.Min``, ``hvd.Max`` or ``hvd.Product``.

    Returns:
        This rank's block of rows of the reduced value. Eagerly, a ``tf.Tensor``. In a TF1 graph, its value as a
        numpy array, evaluated in the default session, or in Keras 2's session where there is none. Under Keras 3
        with no default session, the tensor itself, for the caller's session to run.

    Raises:
        ValueError: ``tf.constant`` cannot make a tensor of ``value``; the runtime is not initialised, or ``op`` is
            not one of the five ops above, or a rank's value is a scalar or cannot be reduced, in which case every
            rank raises.
        MismatchError: the ranks' calls do not match. Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    return _evaluated(collectives.reducescatter(_tf().constant(value), op=op, name=name))


def broadcast_global_variables(root_rank: int) -> Any:
    """Broadcast every global variable of the TF1 graph from the root rank.

    This is Horovod's Keras ``broadcast_global_variables``. The broadcast op is built and run in the default
    session, or in Keras 2's session where there is none.

    Args:
        root_rank: the rank whose values every rank gets.

    Returns:
        What running the op in the session returns. Under Keras 3 with no default session, the op itself, for the
        caller's session to run.

    Raises:
        RuntimeError: TensorFlow runs eagerly, where there are no global variables. Use
            ``hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)`` in ``model.fit``, or
            ``hvd.broadcast_variables(model.variables, root_rank)``.
        ValueError: the runtime is not initialised.
        MismatchError: the ranks' calls do not match. Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    if _tf().executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() does not support eager execution. Please use "
                           "`hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank)` in model.fit, or "
                           "`hvd.broadcast_variables(model.variables, root_rank)`.")
    return _evaluated(_graph_broadcast_global_variables(root_rank))


__all__ = [
    "Adasum", "Average", "Compression", "Sum", "allgather", "allreduce", "broadcast", "broadcast_global_variables",
    "ccl_built", "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled", "init",
    "is_initialized", "local_rank", "local_size", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built",
    "rank", "reducescatter", "rocm_built", "shutdown", "size", "start_timeline", "stop_timeline",
    "ProcessSet", "add_process_set", "global_process_set", "remove_process_set",
    "DistributedOptimizer", "PartialDistributedOptimizer", "SyncBatchNormalization", "callbacks", "elastic",
    "load_model", "noise_scale", "breakpoint",
]
