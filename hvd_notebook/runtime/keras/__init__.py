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
    """Reduce a tensor-like ``value`` over all ranks (default: average)."""
    return _evaluated(collectives.allreduce(_tf().constant(value), average=average, compression=compression,
                                            op=op, prescale_factor=prescale_factor,
                                            postscale_factor=postscale_factor, name=name))


def allgather(value: Any, name: str | None = None) -> Any:
    """Concatenate a tensor-like ``value`` from every rank along the first dimension."""
    return _evaluated(collectives.allgather(_tf().constant(value), name=name))


def broadcast(value: Any, root_rank: int, name: str | None = None) -> Any:
    """``root_rank``'s tensor-like ``value`` on every rank."""
    return _evaluated(collectives.broadcast(_tf().constant(value), root_rank, name=name))


def reducescatter(value: Any, name: str | None = None, op: int = Average) -> Any:
    """Reduce a tensor-like ``value`` over ranks and keep this rank's block of rows."""
    return _evaluated(collectives.reducescatter(_tf().constant(value), op=op, name=name))


def broadcast_global_variables(root_rank: int) -> Any:
    """Broadcast every global variable of the TF1 graph from ``root_rank`` (in its default session, where
    there is one). Eagerly there are no global variables: as Horovod, a ``RuntimeError`` says what to use."""
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
