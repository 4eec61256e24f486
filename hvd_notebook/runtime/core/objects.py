"""The calls that carry no tensor, the same in every binding: Python objects broadcast and gathered
(pickled, through MPI), the barrier, join, and the timeline."""

from __future__ import annotations

from typing import Any

from . import process_sets as _process_sets
from . import world as _world
from .rules import auto_name
from .signatures import BARRIER


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None) -> Any:
    """Give every rank the root's Python object.

    The object is pickled and sent through MPI, so it can be anything ``pickle`` takes.

    >>> config = hvd.broadcast_object(config if hvd.rank() == 0 else None, root_rank=0)

    Args:
        obj: the object to send. Only the root's is read; the other ranks may pass None.
        root_rank: the global rank whose object every rank gets. Defaults to 0.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes the next automatic name, so that nameless calls pair in call order.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.

    Returns:
        The root's object: ``obj`` itself on the root, an unpickled copy on the other ranks.

    Raises:
        ValueError: the runtime is not initialised; ``process_set`` is not a registered ``hvd.ProcessSet`` or does
            not hold this rank; or ``root_rank`` is not a rank of the world or of ``process_set``. A bad
            ``root_rank`` raises on every rank.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments.
            Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    backends = _process_sets.backends(process_set, "hvd.broadcast_object")
    return backends.mpi.broadcast_object(obj, backends.root(root_rank),
                                        str(name) if name else auto_name("broadcast_object"))


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """Gather every rank's Python object into a list, in rank order.

    The objects are pickled and sent through MPI, so they can be anything ``pickle`` takes.

    Args:
        obj: this rank's object.
        name: the name that pairs this call across ranks and labels it in the timeline and in errors. The default,
            None, takes the next automatic name, so that nameless calls pair in call order.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.

    Returns:
        A list with one object per rank, in rank order: ``size()`` items, or the set's size with ``process_set``.

    Raises:
        ValueError: the runtime is not initialised, or ``process_set`` is not a registered ``hvd.ProcessSet`` or
            does not hold this rank.
        MismatchError: the ranks called different collectives under this name, or this one with different arguments.
            Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    backends = _process_sets.backends(process_set, "hvd.allgather_object")
    return backends.mpi.allgather_object(obj, str(name) if name else auto_name("allgather_object"))


def barrier(process_set: Any = None) -> None:
    """Wait until every rank has called ``barrier()``.

    Args:
        process_set: the ``hvd.ProcessSet`` whose ranks wait for each other. The default, None, means every rank.

    Raises:
        ValueError: the runtime is not initialised, or ``process_set`` is not a registered ``hvd.ProcessSet`` or
            does not hold this rank.
        MismatchError: another rank called a different collective where this one called ``barrier()``. Every rank
            raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    # agreement needs every rank's contribution: it is a barrier in itself
    _process_sets.backends(process_set, "hvd.barrier").negotiator.check(BARRIER)


def join() -> int:
    """Say that this rank has no more data, and wait until every rank has said so.

    Until then this rank takes part in the other ranks' allreduces with zeros, so that ranks with more batches can
    go on. Only allreduces can be served so.

    Returns:
        The rank that joined last, as an int (the same on every rank), as in Horovod.

    Raises:
        ValueError: the runtime is not initialised.
        MismatchError: another rank called a collective other than an allreduce while this rank had joined, or the
            ranks' calls did not match. Every rank raises it.
        StallError: the call cannot complete: a rank it waits for has shut down, or the wait passed
            ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
        HorovodInternalError: another rank left this call to reset the world for ``hvd.elastic.run``.
    """
    return _world.current().join()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start recording this rank's collectives in a timeline, until ``stop_timeline()``.

    Each collective is recorded as its phases (agreement, copies, the MPI or NCCL call), with the tensors' names and
    sizes. Call it on every rank: each rank records its own events, and ``stop_timeline`` writes them all to one
    file. A second call starts the recording afresh.

    Args:
        file_path: the Chrome-trace JSON file that rank 0 writes at ``stop_timeline()``. Perfetto and
            ``chrome://tracing`` load it.
        mark_cycles: also mark each agreement round with an instant event, ``CYCLE_START``. Defaults to False.

    Raises:
        ValueError: the runtime is not initialised.
    """
    _world.current().timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording, and write every rank's events to the timeline file on rank 0.

    A collective call: every rank must make it. Rank 0 writes the file given to its ``start_timeline``, with one
    track per rank. Where rank 0 was not recording, nothing is written.

    Raises:
        ValueError: the runtime is not initialised.
        OSError: rank 0 cannot write the file.
    """
    _world.current().stop_timeline()
