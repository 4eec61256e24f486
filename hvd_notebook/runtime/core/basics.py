"""Process queries of the Horovod-compatible runtime: init, rank, size and friends.

Names, arguments and errors follow ``horovod.tensorflow``; each is a thin
question to the world (``world.py``): the communicator given to ``init`` split
by shared-memory node to find the local ranks, and by local rank to find the
cross ranks.
"""

from __future__ import annotations

from typing import Any

from . import process_sets as _process_sets
from . import world as _world
from .nccl_backend import cupy_importable


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Initialise the runtime on this process; calling it again keeps the world.

    ``comm`` is an ``mpi4py`` communicator or a list of world ranks to use
    instead of ``MPI.COMM_WORLD``, as in Horovod. ``process_sets`` is a list of
    ``hvd.ProcessSet`` to register (also on a world that exists already, as in a
    notebook whose ranks called ``init`` at start), or ``"dynamic"`` to allow
    ``add_process_set``/``remove_process_set`` later.

    >>> import hvd_notebook.runtime as hvd
    >>> hvd.init()
    >>> hvd.rank() < hvd.size()
    True
    """
    _process_sets.init(comm, process_sets)


def shutdown() -> None:
    """Release the runtime's communicators; ``init()`` may be called again later."""
    _world.shutdown()


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return _world.is_initialized()


def rank() -> int:
    """This process's rank among all ranks, 0 to ``size() - 1``."""
    return _world.current().rank


def size() -> int:
    """Number of ranks in the job."""
    return _world.current().size


def local_rank() -> int:
    """This process's rank among the ranks on its host (which GPU to use)."""
    return _world.current().local_comm.Get_rank()


def local_size() -> int:
    """Number of ranks on this process's host."""
    return _world.current().local_comm.Get_size()


def cross_rank() -> int:
    """Index of this process's host among the hosts (for ranks of equal local rank)."""
    return _world.current().cross_comm.Get_rank()


def cross_size() -> int:
    """Number of hosts that have a rank with this process's local rank."""
    return _world.current().cross_comm.Get_size()


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    return _world.current().homogeneous


def mpi_threads_supported() -> bool:
    """True when MPI was initialised with MPI_THREAD_MULTIPLE."""
    world = _world.current()
    return world.MPI.Query_thread() == world.MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """The built-in backend always coordinates through MPI."""
    return True


def mpi_built() -> bool:
    """The built-in backend is built on mpi4py."""
    return True


def nccl_built() -> bool:
    """True where cupy's NCCL bindings are installed (the ``[gpu]`` extra): GPU tensors
    are then reduced by NCCL on every rank that has a GPU. Found without importing cupy."""
    return cupy_importable()


def nccl_enabled() -> bool:
    """True when this world has an NCCL communicator (every rank has a GPU)."""
    return _world.current().nccl is not None


def gloo_enabled() -> bool:
    """False: the built-in runtime coordinates through MPI only."""
    return False


def gloo_built() -> bool:
    """False: the built-in runtime has no Gloo."""
    return False


def communicator() -> Any:
    """The runtime's mpi4py communicator (a duplicate of the one given to ``init``)."""
    return _world.current().comm


def cuda_built() -> bool:
    """True where GPU tensors can be reduced on the GPUs (cupy's NCCL bindings installed), as
    Horovod's ``cuda_built`` says whether it was built with CUDA."""
    return cupy_importable()


def rocm_built() -> bool:
    """False: no ROCm support."""
    return False


def ccl_built() -> bool:
    """False: no oneCCL support."""
    return False


def ddl_built() -> bool:
    """False: no IBM DDL support."""
    return False
