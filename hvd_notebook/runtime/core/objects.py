"""The calls that carry no tensor, the same in every binding: Python objects broadcast and gathered
(pickled, through MPI), the barrier, join, and the timeline."""

from __future__ import annotations

from typing import Any

from . import process_sets as _process_sets
from . import world as _world
from .rules import auto_name
from .signatures import BARRIER


def broadcast_object(obj: Any, root_rank: int = 0, name: str | None = None, process_set: Any = None) -> Any:
    """Every rank (of ``process_set``) gets ``root_rank``'s (picklable) Python object."""
    backends = _process_sets.backends(process_set, "hvd.broadcast_object")
    return backends.mpi.broadcast_object(obj, backends.root(root_rank),
                                        str(name) if name else auto_name("broadcast_object"))


def allgather_object(obj: Any, name: str | None = None, process_set: Any = None) -> list[Any]:
    """A list of every rank's (picklable) Python object, in rank order."""
    backends = _process_sets.backends(process_set, "hvd.allgather_object")
    return backends.mpi.allgather_object(obj, str(name) if name else auto_name("allgather_object"))


def barrier(process_set: Any = None) -> None:
    """Return once every rank (of ``process_set``) has called ``barrier()``."""
    # agreement needs every rank's contribution: it is a barrier in itself
    _process_sets.backends(process_set, "hvd.barrier").negotiator.check(BARRIER)


def join() -> int:
    """Say this rank has no more data: it takes part in the others' allreduces
    with zeros until every rank has joined. Returns the rank that joined last."""
    return _world.current().join()


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record every collective's phases on every rank until ``stop_timeline()``;
    ``mark_cycles`` also marks each agreement round."""
    _world.current().timeline.start(file_path, mark_cycles)


def stop_timeline() -> None:
    """Stop recording; rank 0 writes all ranks' events to the file given to
    ``start_timeline`` (a collective call: every rank must make it)."""
    _world.current().stop_timeline()
