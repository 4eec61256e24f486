"""The Horovod-compatible runtime that ``%%hvd`` cells call ``hvd``.

Its API contract is ``horovod.tensorflow``: the same names, arguments and
defaults, so cell code written for Horovod runs unchanged. It also works in a
plain script started with ``mpiexec -n 2 python train.py``.

    import hvd_notebook.runtime as hvd
    hvd.init()
    total = hvd.allreduce(np.ones(3), op=hvd.Sum)   # array([2., 2., 2.]) on 2 ranks

Layers, each importing only those above it in this list (tests/unit/test_runtime_units.py checks):

- ``ops`` (op vocabulary, scaling), ``timeline``, ``topology``; ``signatures``, ``fusion``;
  settings come from ``hvd_notebook.config``
- ``matching`` (which waiting calls run, in which order: a pure decision), ``coordinator`` (each call a
  request; the waiting threads take turns running agreement rounds: collectives matched by name)
- ``negotiation`` (one round's hash exchange, the stall inspector, the turn each call takes),
  ``bridges`` (DLPack)
- ``mpi_backend`` and ``nccl_backend``: each built from (communicator, negotiator, timeline)
- ``world``: the state of one ``hvd.init()``: communicators, both backends, join
- ``process_sets``: ``hvd.ProcessSet`` and the table of a world's sets, each on its own communicator
- ``basics`` (process queries), ``compression``; ``collectives``; ``gradients``; ``tf1`` (TF1 graphs);
  ``training``, ``callbacks``, ``sync_batch_norm``, ``elastic_callbacks``; ``elastic`` (``hvd.elastic``)
"""

from .basics import (
    _executing_eagerly as _executing_eagerly,  # Horovod's tests import this private name
)
from .basics import (
    ccl_built,
    communicator,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_rank_op,
    local_size,
    local_size_op,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    nccl_enabled,
    process_set_included_op,
    rank,
    rank_op,
    rocm_built,
    shutdown,
    size,
    size_op,
)
from .collectives import (
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
from .compression import Compression
from .process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .signatures import MismatchError, StallError


def __getattr__(name: str):  # the Keras parts import Keras and TensorFlow: only when used
    if name in ("DistributedOptimizer", "DistributedGradientTape", "PartialDistributedOptimizer",
                "PartialDistributedGradientTape", "load_model", "shard", "scale_lr"):
        from . import training as _training

        return getattr(_training, name)
    if name == "SyncBatchNormalization":
        from .sync_batch_norm import SyncBatchNormalization

        return SyncBatchNormalization
    if name in ("BroadcastGlobalVariablesHook", "broadcast_global_variables"):  # TF1 graphs
        from . import tf1 as _tf1

        return getattr(_tf1, name)
    if name in ("callbacks", "elastic"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'hvd_notebook.runtime' has no attribute {name!r}")

__all__ = [
    "Adasum", "Average", "BroadcastGlobalVariablesHook", "Compression", "DistributedGradientTape",
    "DistributedOptimizer", "Max", "Min", "MismatchError", "Product", "StallError", "Sum", "XLAUnsupportedError",
    "allgather", "allgather_object", "allreduce", "alltoall", "barrier", "broadcast", "broadcast_global_variables",
    "broadcast_object", "broadcast_object_fn", "broadcast_variables",
    "callbacks", "communicator", "cross_rank", "cross_size", "elastic",
    "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allreduce", "grouped_reducescatter", "init",
    "is_homogeneous", "is_initialized", "join", "load_model", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "nccl_enabled", "rank", "reducescatter", "scale_lr",
    "shard", "shutdown", "size", "start_timeline", "stop_timeline",
    "broadcast_", "ccl_built", "cuda_built", "ddl_built", "local_rank_op", "local_size_op", "process_set_included_op",
    "rank_op", "rocm_built", "size_op",
    "PartialDistributedGradientTape", "PartialDistributedOptimizer", "SyncBatchNormalization",
    "ProcessSet", "add_process_set", "global_process_set", "remove_process_set",
]
