"""The runtime's errors, the same in every binding (Horovod's ``horovod.common.exceptions`` and the
errors of a mismatched or refused call). A binding raises them as they are or wraps them in its
framework's own error class (``tensorflow/mpi_ops.py``, ``torch/mpi_ops.py``), keeping these as bases."""

from __future__ import annotations


class MismatchError(ValueError):
    """Ranks called different collectives, or the same one with different arguments."""


class RefusedError(ValueError):
    """A rank refused its call (bad argument, unsupported dtype): every rank raises this."""

    def __init__(self, message: str, refused_here: bool = False) -> None:
        super().__init__(message)
        self.refused_here = refused_here


class HorovodInternalError(RuntimeError):
    """A collective failed because the world is being rebuilt; ``hvd.elastic.run`` resets on it (Horovod's name)."""


class StallError(RuntimeError):
    """A collective that cannot complete: it waited past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS,
    or a rank it waits for has shut down."""


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed: ``run`` resets without restoring the last commit (Horovod's name).
    ``skip_sync``: the ranks that stay all have the same state already (hosts were only removed)."""

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts changed")
        self.skip_sync = skip_sync
