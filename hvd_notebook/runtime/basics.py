"""Process queries of the Horovod-compatible runtime: init, rank, size and friends.

Names, arguments and errors follow ``horovod.tensorflow``; the implementation is
mpi4py: the world (or a sub-communicator) is split by shared-memory node to
find the local ranks, and by local rank to find the cross ranks.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_NOT_INITIALIZED = "hvd_notebook's runtime has not been initialized; call hvd.init() first."


@dataclass(frozen=True)
class _World:
    comm: Any  # mpi4py.MPI.Comm: every rank of this job
    local_comm: Any  # ranks on this host
    cross_comm: Any  # ranks with the same local rank, one per host
    homogeneous: bool


_lock = threading.Lock()
_world: _World | None = None


def init(comm: Any = None) -> None:
    """Initialise the runtime on this process; calling it again does nothing.

    ``comm`` is an ``mpi4py`` communicator or a list of world ranks to use
    instead of ``MPI.COMM_WORLD``, as in Horovod.

    >>> import hvd_notebook.runtime as hvd
    >>> hvd.init()
    >>> hvd.rank() < hvd.size()
    True
    """
    global _world
    with _lock:
        if _world is not None:
            return
        from mpi4py import MPI

        if comm is None:
            comm = MPI.COMM_WORLD
        elif isinstance(comm, Sequence) and not isinstance(comm, (str, bytes)):
            comm = _comm_from_ranks(MPI, list(comm))
        elif not isinstance(comm, MPI.Comm):
            raise TypeError(
                f"hvd.init(comm=...) takes an mpi4py communicator or a list of ranks, "
                f"not {type(comm).__name__}."
            )
        comm = comm.Dup()
        local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        cross_comm = comm.Split(local_comm.Get_rank(), key=comm.Get_rank())
        local_sizes = comm.allgather(local_comm.Get_size())
        _world = _World(comm, local_comm, cross_comm, len(set(local_sizes)) == 1)
    from . import mpi_backend

    # now, while every rank is here: it duplicates a communicator, a blocking
    # collective that must not wait for a rank's first hvd.allreduce
    rt = mpi_backend.runtime()
    # NCCL joins every rank too (collective): where each rank has a GPU, GPU tensors reduce there
    rt.start_nccl(_world.local_comm.Get_rank())
    timeline = os.environ.get("HOROVOD_TIMELINE")
    if timeline:
        from .collectives import start_timeline

        start_timeline(timeline, mark_cycles=os.environ.get("HOROVOD_TIMELINE_MARK_CYCLES", "0") == "1")


def _comm_from_ranks(MPI: Any, ranks: list[int]) -> Any:
    world = MPI.COMM_WORLD
    bad = [r for r in ranks if not 0 <= int(r) < world.Get_size()]
    if bad or not ranks:
        raise ValueError(
            f"hvd.init(comm={ranks!r}): ranks must be a non-empty list within "
            f"0..{world.Get_size() - 1}."
        )
    group = world.Get_group().Incl(sorted(set(int(r) for r in ranks)))
    sub = world.Create_group(group) if world.Get_rank() in ranks else None
    if sub is None or sub == MPI.COMM_NULL:
        raise ValueError(
            f"hvd.init(comm={ranks!r}) was called on world rank {world.Get_rank()}, "
            "which is not in the list; call it only on the listed ranks."
        )
    return sub


def shutdown() -> None:
    """Release the runtime's communicators; ``init()`` may be called again later."""
    global _world
    if _world is None:
        return
    from . import collectives, mpi_backend

    if mpi_backend.runtime().timeline.active:
        collectives.stop_timeline()
    mpi_backend.reset()
    with _lock:
        if _world is None:
            return
        for c in (_world.cross_comm, _world.local_comm, _world.comm):
            c.Free()
        _world = None


def is_initialized() -> bool:
    """True between ``init()`` and ``shutdown()``."""
    return _world is not None


def _w() -> _World:
    if _world is None:
        raise ValueError(_NOT_INITIALIZED)
    return _world


def rank() -> int:
    """This process's rank among all ranks, 0 to ``size() - 1``."""
    return _w().comm.Get_rank()


def size() -> int:
    """Number of ranks in the job."""
    return _w().comm.Get_size()


def local_rank() -> int:
    """This process's rank among the ranks on its host (which GPU to use)."""
    return _w().local_comm.Get_rank()


def local_size() -> int:
    """Number of ranks on this process's host."""
    return _w().local_comm.Get_size()


def cross_rank() -> int:
    """Index of this process's host among the hosts (for ranks of equal local rank)."""
    return _w().cross_comm.Get_rank()


def cross_size() -> int:
    """Number of hosts that have a rank with this process's local rank."""
    return _w().cross_comm.Get_size()


def is_homogeneous() -> bool:
    """True when every host runs the same number of ranks."""
    return _w().homogeneous


def mpi_threads_supported() -> bool:
    """True when MPI was initialised with MPI_THREAD_MULTIPLE."""
    from mpi4py import MPI

    _w()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled() -> bool:
    """The built-in backend always coordinates through MPI."""
    return True


def mpi_built() -> bool:
    """The built-in backend is built on mpi4py."""
    return True


def nccl_built() -> bool:
    """True where cupy's NCCL bindings are installed (the ``[gpu]`` extra): GPU tensors
    are then reduced by NCCL on every rank that has a GPU. Found without importing cupy."""
    from .nccl_backend import cupy_importable

    return cupy_importable()


def nccl_enabled() -> bool:
    """True when this world has an NCCL communicator (every rank has a GPU)."""
    from . import mpi_backend

    _w()
    return mpi_backend.runtime().nccl is not None


def gloo_enabled() -> bool:
    """False: the built-in runtime coordinates through MPI only."""
    return False


def gloo_built() -> bool:
    return False


def communicator() -> Any:
    """The runtime's mpi4py communicator (a duplicate of the one given to ``init``)."""
    return _w().comm
