"""The TensorFlow binding: Horovod's ``horovod.tensorflow`` API on numpy arrays and TensorFlow tensors
(eager and inside ``tf.function`` or TF1 graphs), on the framework-free core (``runtime/core``). It is
what ``import horovod.tensorflow`` gives, and what ``hvd_notebook.runtime`` re-exports: the cells' ``hvd``.

Importing it imports neither TensorFlow nor Keras: a numpy-only script, and a PyTorch rank, never pay for
them. TensorFlow is imported by the first call that gets a TensorFlow tensor (``bridges.tf``).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..core.basics import (
    ccl_built,
    communicator,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    nccl_enabled,
    rank,
    rocm_built,
    shutdown,
    size,
)
from ..core.debugger import breakpoint
from ..core.exceptions import MismatchError, StallError
from ..core.noise_scale import noise_scale
from ..core.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .compression import Compression
from .mpi_ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    Sum,
    XLAUnsupportedError,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_object,
    broadcast_object_fn,
    broadcast_variables,
    grouped_allgather,
    grouped_allreduce,
    grouped_reducescatter,
    join,
    reducescatter,
    start_timeline,
    stop_timeline,
)
from .util import (
    _executing_eagerly as _executing_eagerly,  # Horovod's tests import this private name
)
from .util import init, local_rank_op, local_size_op, process_set_included_op, rank_op, size_op

# The one lazy loader of the runtime. Horovod's ``horovod.tensorflow`` holds ``DistributedOptimizer``,
# ``DistributedGradientTape`` and the rest below, and the cells' ``hvd`` adds Horovod's Keras names
# (``callbacks``, ``elastic``, ``SyncBatchNormalization``); all of them import Keras, which takes seconds and
# which a numpy-only script or a PyTorch rank must not pay for. Each is imported when first used.
LAZY_NAMES = {
    **dict.fromkeys(("DistributedOptimizer", "DistributedGradientTape", "PartialDistributedOptimizer",
                     "PartialDistributedGradientTape", "load_model", "shard", "scale_lr"), "..keras.training"),
    "SyncBatchNormalization": "..keras.sync_batch_norm",
    "BroadcastGlobalVariablesHook": ".tf1", "broadcast_global_variables": ".tf1",  # TF1 graphs
    "callbacks": "..keras.callbacks", "elastic": "..keras.elastic",  # modules
}


def __getattr__(name: str) -> Any:
    where = LAZY_NAMES.get(name)
    if where is None:
        raise AttributeError(f"module 'hvd_notebook.runtime' has no attribute {name!r}")
    module = importlib.import_module(where, __name__)
    return module if name in ("callbacks", "elastic") else getattr(module, name)


__all__ = [  # (and LAZY_NAMES, by attribute)
    "Adasum", "Average", "Compression", "Max", "Min", "MismatchError", "Product", "StallError", "Sum",
    "XLAUnsupportedError", "allgather", "allgather_object", "allreduce", "alltoall", "barrier", "broadcast",
    "broadcast_object", "broadcast_object_fn", "broadcast_variables", "communicator", "cross_rank", "cross_size",
    "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "init",
    "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
    "mpi_threads_supported", "nccl_built", "nccl_enabled", "rank", "reducescatter", "shutdown", "size",
    "start_timeline", "stop_timeline", "broadcast_", "ccl_built", "cuda_built", "ddl_built", "local_rank_op",
    "local_size_op", "process_set_included_op", "rank_op", "rocm_built", "size_op", "ProcessSet", "add_process_set",
    "global_process_set", "remove_process_set", "noise_scale", "breakpoint",
]
