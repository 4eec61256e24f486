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
from .nccl_backend import nccl_importable


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Initialise the runtime on this process; a second call keeps the world it built.

    A collective call: every rank of the job (or of ``comm``) must make it. It builds the world once; a later call
    only registers the ``process_sets`` it is given. In a notebook the ranks call it at start, so a cell's
    ``hvd.init()`` keeps that world.

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
    _process_sets.init(comm, process_sets)


def shutdown() -> None:
    """Release the runtime's communicators; ``hvd.init()`` may be called again later.

    Every rank should call it. A rank still waiting for this one in a collective then fails with ``StallError`` and
    names this rank, instead of waiting for ever. A running timeline is written first. Calling it before ``init``
    does nothing.
    """
    _world.shutdown()


def is_initialized() -> bool:
    """Tell whether the runtime is initialised on this process.

    Returns:
        True between ``hvd.init()`` and ``hvd.shutdown()``, else False.
    """
    return _world.is_initialized()


def rank() -> int:
    """Return this process's rank among all ranks of the job.

    Returns:
        An int from 0 to ``size() - 1``.

    Raises:
        ValueError: ``hvd.init()`` has not been called, or ``hvd.shutdown()`` has been called since.
    """
    return _world.current().rank


def size() -> int:
    """Return the number of ranks in the job.

    Returns:
        An int, 1 or more.

    Raises:
        ValueError: ``hvd.init()`` has not been called, or ``hvd.shutdown()`` has been called since.
    """
    return _world.current().size


def local_rank() -> int:
    """Return this process's rank among the ranks on its host.

    Use it to choose this rank's GPU.

    Returns:
        An int from 0 to ``local_size() - 1``.

    Raises:
        ValueError: ``hvd.init()`` has not been called, or ``hvd.shutdown()`` has been called since.
    """
    return _world.current().local_comm.Get_rank()


def local_size() -> int:
    """Return the number of ranks on this process's host.

    Returns:
        An int, 1 or more.

    Raises:
        ValueError: ``hvd.init()`` has not been called, or ``hvd.shutdown()`` has been called since.
    """
    return _world.current().local_comm.Get_size()


def cross_rank() -> int:
    """Return the index of this process's host among the hosts.

    The hosts counted are those with a rank of this process's local rank.

    Returns:
        An int from 0 to ``cross_size() - 1``.

    Raises:
        ValueError: ``hvd.init()`` has not been called, or ``hvd.shutdown()`` has been called since.
    """
    return _world.current().cross_comm.Get_rank()


def cross_size() -> int:
    """Return the number of hosts that have a rank with this process's local rank.

    Returns:
        An int, 1 or more. On a homogeneous job it is the number of hosts.

    Raises:
        ValueError: ``hvd.init()`` has not been called, or ``hvd.shutdown()`` has been called since.
    """
    return _world.current().cross_comm.Get_size()


def is_homogeneous() -> bool:
    """Tell whether every host runs the same number of ranks.

    Returns:
        True where every host has the same ``local_size()``, else False.

    Raises:
        ValueError: ``hvd.init()`` has not been called, or ``hvd.shutdown()`` has been called since.
    """
    return _world.current().homogeneous


def mpi_threads_supported() -> bool:
    """Tell whether MPI was initialised with ``MPI_THREAD_MULTIPLE``.

    Returns:
        True where MPI's thread level is ``MPI_THREAD_MULTIPLE``, else False.

    Raises:
        ValueError: ``hvd.init()`` has not been called, or ``hvd.shutdown()`` has been called since.
    """
    world = _world.current()
    return world.MPI.Query_thread() == world.MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """Tell whether the runtime coordinates through MPI.

    Returns:
        Always True: the built-in backend always coordinates through MPI.
    """
    return True


def mpi_built() -> bool:
    """Tell whether the runtime was built with MPI.

    Returns:
        Always True: the built-in backend is built on mpi4py.
    """
    return True


def nccl_built() -> bool:
    """Tell whether NCCL is available to the runtime.

    NCCL is available where cupy's NCCL bindings are installed (the ``[gpu]`` extra). GPU tensors are then reduced
    by NCCL, on every rank that has a GPU. The check does not import cupy.

    Returns:
        True where cupy's NCCL bindings can be imported, else False.
    """
    return nccl_importable()


def nccl_enabled() -> bool:
    """Tell whether this world reduces GPU tensors with NCCL.

    Returns:
        True when the world has an NCCL communicator, which needs a GPU on every rank; else False.

    Raises:
        ValueError: ``hvd.init()`` has not been called, or ``hvd.shutdown()`` has been called since.
    """
    return _world.current().nccl is not None


def gloo_enabled() -> bool:
    """Tell whether the runtime coordinates through Gloo.

    Returns:
        Always False: the built-in runtime coordinates through MPI only.
    """
    return False


def gloo_built() -> bool:
    """Tell whether the runtime was built with Gloo.

    Returns:
        Always False: the built-in runtime has no Gloo.
    """
    return False


def communicator() -> Any:
    """Return the runtime's mpi4py communicator.

    Returns:
        An ``mpi4py.MPI.Comm``: a duplicate of the communicator given to ``hvd.init()``, or of ``MPI.COMM_WORLD``.
        It is freed by ``hvd.shutdown()``.

    Raises:
        ValueError: ``hvd.init()`` has not been called, or ``hvd.shutdown()`` has been called since.
    """
    return _world.current().comm


def cuda_built() -> bool:
    """Tell whether GPU tensors can be reduced on the GPUs.

    As Horovod's ``cuda_built`` says whether Horovod was built with CUDA, this says whether cupy's NCCL bindings are
    installed.

    Returns:
        True where cupy's NCCL bindings can be imported, else False.
    """
    return nccl_importable()


def rocm_built() -> bool:
    """Tell whether the runtime was built with ROCm.

    Returns:
        Always False: the built-in runtime has no ROCm support.
    """
    return False


def ccl_built() -> bool:
    """Tell whether the runtime was built with oneCCL.

    Returns:
        Always False: the built-in runtime has no oneCCL support.
    """
    return False


def ddl_built() -> bool:
    """Tell whether the runtime was built with IBM DDL.

    Returns:
        Always False: the built-in runtime has no DDL support.
    """
    return False
