"""The Horovod-compatible runtime for PyTorch: ``horovod.torch``'s API on the runtime's core.

``%%hvd`` cells of a ``--framework torch`` cluster call this ``hvd``; ``import horovod.torch as hvd``
gives it too where no real Horovod is installed. It also works in a plain script under mpiexec:

    import torch
    import hvd_notebook.runtime.torch as hvd
    hvd.init()
    model = torch.nn.Linear(4, 1)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

The process queries, process sets, timeline and ops are the core's, shared with the TensorFlow side
(one world per process, whichever framework's names started it). Modules: ``tensors`` (torch <->
numpy), ``mpi_ops`` (the collectives, their async forms and handles), ``dist_backend`` (the collectives
through ``torch.distributed``), ``group`` (its process groups), ``device`` (every CUDA call), ``functions`` (parameters,
optimizer state, objects), ``optimizer`` (``DistributedOptimizer``), ``compression``,
``sync_batch_norm`` (``SyncBatchNorm``). TensorFlow is never imported here.
"""

from ..core.debugger import breakpoint
from ..core.exceptions import HorovodInternalError, MismatchError, StallError
from ..core.noise_scale import noise_scale
from ..core.objects import start_timeline, stop_timeline
from ..core.ops import Adasum, Average, Max, Min, Product, Sum
from ..core.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .compression import Compression
from .ddp import NoiseScaleHook
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    rocm_built,
    shutdown,
    size,
    sparse_allreduce_async,
    synchronize,
)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError", "Max", "Min",
    "MismatchError", "NoiseScaleHook", "Product", "ProcessSet", "StallError", "Sum", "SyncBatchNorm",
    "add_process_set",
    "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_", "allreduce_async",
    "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "ccl_built",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "gloo_built", "gloo_enabled",
    "global_process_set", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_initialized", "join", "local_rank", "local_size", "mpi_built",
    "mpi_enabled", "mpi_threads_supported", "nccl_built", "noise_scale", "breakpoint", "poll", "rank", "reducescatter",
    "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "size", "sparse_allreduce_async", "start_timeline",
    "stop_timeline", "synchronize",
]
