"""The runtime's errors, the same in every binding (Horovod's ``horovod.common.exceptions`` and the
errors of a mismatched or refused call). A binding raises them as they are or as its framework's own
error class that keeps them as bases (an ``ErrorFamily``: ``tensorflow/mpi_ops.py``, ``torch/mpi_ops.py``)."""

from __future__ import annotations

from collections.abc import Callable


class MismatchError(ValueError):
    """Ranks called different collectives, or the same one with different arguments."""


class RefusedError(ValueError):
    """A rank refused its call (bad argument, unsupported dtype): every rank raises this."""

    def __init__(self, message: str = "", refused_here: bool = False) -> None:  # (TensorFlow's errors pass none)
        super().__init__(message)
        self.refused_here = refused_here


class HorovodInternalError(RuntimeError):
    """A collective failed because the world is being rebuilt; ``hvd.elastic.run`` resets on it (Horovod's name)."""


class StallError(RuntimeError):
    """A collective that cannot complete: it waited past HOROVOD_STALL_SHUTDOWN_TIME_SECONDS,
    or a rank it waits for has shut down."""


class HostsUpdatedInterrupt(RuntimeError):
    """The set of hosts changed: ``hvd.elastic.run`` resets without restoring the last commit.

    ``State.commit()`` and ``State.check_host_updates()`` raise it on every rank, as Horovod's.

    Args:
        skip_sync: True where the ranks that stay all have the same state already, because hosts were only removed.
            ``run`` then skips ``state.sync()`` after the reset. Defaults to False.
    """

    def __init__(self, skip_sync: bool = False) -> None:
        super().__init__("the set of hosts changed")
        self.skip_sync = skip_sync


class ErrorFamily:
    """How one binding raises the core's errors: ``class_for(error class)`` names the framework's class an
    error of that class is raised as (made with the core's class among its bases), or None where it stays
    as it is; asked once per class.

    >>> class Mismatch(MismatchError, RuntimeError): pass
    >>> family = ErrorFamily(lambda cls: Mismatch if issubclass(cls, MismatchError) else None)
    >>> error = family.convert(MismatchError("rank 1 called allgather"))
    >>> type(error).__name__, str(error), family.convert(StallError("late")).__class__.__name__
    ('Mismatch', 'rank 1 called allgather', 'StallError')
    """

    def __init__(self, class_for: Callable[[type[BaseException]], type[BaseException] | None]) -> None:
        self._class_for = class_for
        self._classes: dict[type[BaseException], type[BaseException] | None] = {}

    def convert(self, exc: BaseException) -> BaseException:
        """``exc`` as the framework's error, with its message and attributes; or ``exc`` itself."""
        cls = type(exc)
        if cls not in self._classes:
            self._classes[cls] = self._class_for(cls)
        made = self._classes[cls]
        if made is None:
            return exc
        converted = made(str(exc))
        converted.__dict__.update(exc.__dict__)  # (a refusal's refused_here)
        return converted
