"""The one error the cluster layer raises to the kernel side."""

from __future__ import annotations


class ClusterError(RuntimeError):
    """The cluster could not be started, or broke; the message says what to do.

    Args:
        message: what the user reads, saying what to do.
        mpi_init_failed: MPI_Init failed before any engine connected.
    """

    mpi_init_failed = False  # (LeaseDirError runs OSError's __init__, not this one)

    def __init__(self, message: str, mpi_init_failed: bool = False) -> None:
        super().__init__(message)
        self.mpi_init_failed = mpi_init_failed
