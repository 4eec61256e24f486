"""The Horovod-compatible runtime that ``%%hvd`` cells call ``hvd``.

Its API contract is ``horovod.tensorflow``: the same names, arguments and
defaults, so cell code written for Horovod runs unchanged. It also works in a
plain script started with ``mpiexec -n 2 python train.py``.
"""

from .basics import (
    communicator,
    cross_rank,
    cross_size,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    rank,
    shutdown,
    size,
)

__all__ = [
    "communicator",
    "cross_rank",
    "cross_size",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "rank",
    "shutdown",
    "size",
]
