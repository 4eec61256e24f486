"""Where this process sits in the MPI world, readable before ``init()``: the
engine bootstrap pins a rank's GPU by its local rank before the runtime starts."""

from __future__ import annotations


def local_rank_before_init() -> tuple[int, int, int]:
    """World rank, and rank and size among the ranks on this host, from MPI itself."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.Get_rank())
    try:
        return world.Get_rank(), local.Get_rank(), local.Get_size()
    finally:
        local.Free()


def initialize_mpi() -> tuple[int, int]:
    """Initialise MPI now (mpi4py does it on import): a rank whose MPI_Init fails then ends
    before any of a script's own code has run, so the launch can be tried again. This process's
    rank and the world's size."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
