"""The state of one initialised world: its communicators, the agreement check,
the timeline, both backends, join, and init/shutdown.

``hvd.init()`` builds one ``World`` (a collective call) and ``hvd.shutdown()``
frees it; everything above asks ``current()`` for it. Modelled on Horovod's
framework-free ``common/basics.py`` and JAX's ``distributed.State``.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from ... import config
from ...rankwatch import RankWatch
from . import nccl_backend, rules
from .mpi_backend import MpiBackend
from .negotiation import Negotiator
from .signatures import AllreduceCall, Signature
from .timeline import Timeline, write_trace

NOT_INITIALIZED = "hvd_notebook's runtime has not been initialized; call hvd.init() first."


class Backends:
    """A communicator with its agreement (``Negotiator``) and backends (``mpi``, and ``nccl`` where every rank
    has a GPU): the world's, or one process set's (``process_sets.SetBackends``). A collective runs on either."""

    def __init__(self, comm: Any, local_rank: int, timeline: Timeline, nccl: bool = True) -> None:
        self.comm, self.timeline = comm, timeline
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        # now, while every rank is here: the negotiator duplicates a communicator, a
        # blocking collective that must not wait for a rank's first hvd.allreduce
        self.negotiator = Negotiator(comm, timeline)
        self.mpi = MpiBackend(comm, self.negotiator, timeline)
        # NCCL joins every rank too (collective): where each rank has a GPU, GPU tensors reduce there
        self.nccl = nccl_backend.start(comm, local_rank, self.negotiator, timeline) if nccl else None
        self.serving: dict[str, Any] = {}  # a binding's own backends, by the ``via`` their signatures name (join)

    def root(self, root_rank: int) -> int:
        """This communicator's rank of the global rank ``root_rank`` (collectives take global ranks, as Horovod's)."""
        return root_rank

    def free(self) -> None:
        """Release NCCL and the communicator (collective)."""
        if self.nccl is not None:
            self.nccl.free()
            self.nccl = None
        self.negotiator.free()
        self.comm.Free()


class World(Backends):
    """Every rank of a job (or of the communicator given to ``init``), split by host."""

    def __init__(self, comm: Any, local_comm: Any, cross_comm: Any, homogeneous: bool, parent: Any) -> None:
        from mpi4py import MPI

        self.MPI = MPI
        self.local_comm = local_comm  # ranks on this host
        self.cross_comm = cross_comm  # ranks with the same local rank, one per host
        self.homogeneous = homogeneous
        super().__init__(comm, local_comm.Get_rank(), Timeline())  # comm: every rank of this job
        self.process_sets: Any = None  # the process sets' table (process_sets.py), built by hvd.init()
        self.parent = parent  # the communicator ``create`` duplicated (what hvd.elastic's reset builds on)

    @classmethod
    def create(cls, comm: Any) -> World:
        """Split ``comm`` (duplicated) by host and build the world on it (collective)."""
        from mpi4py import MPI

        parent, comm = comm, comm.Dup()
        local_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        cross_comm = comm.Split(local_comm.Get_rank(), key=comm.Get_rank())
        local_sizes = comm.allgather(local_comm.Get_size())
        return cls(comm, local_comm, cross_comm, len(set(local_sizes)) == 1, parent)

    def leave(self, resetting: bool = False) -> None:
        """Tell the other ranks, on the world and on each process set of this rank, that this
        one is done (or, ``resetting``, builds a new world for ``hvd.elastic``): a rank still
        waiting for it in a collective fails, naming it (with ``HorovodInternalError``)."""
        sets = self.process_sets.backends.values() if self.process_sets is not None else ()
        for negotiator in [self.negotiator, *(backends.negotiator for backends in sets)]:
            negotiator.stall.leave(negotiator.seq, self.rank, resetting)

    def free(self) -> None:
        """Write a running timeline, then release the process sets, NCCL and the communicators (collective)."""
        if self.timeline.active:
            self.stop_timeline()
        if self.process_sets is not None:
            self.process_sets.free()
            self.process_sets = None
        super().free()
        for c in (self.cross_comm, self.local_comm):
            c.Free()

    # ----------------------------------------------------------- timeline
    def stop_timeline(self) -> None:
        """Stop recording; rank 0 writes every rank's events (collective)."""
        path, events = self.timeline.take()
        gathered = self.comm.gather(events, root=0)
        if self.rank == 0 and path is not None:
            write_trace(path, gathered)

    # ------------------------------------------------------------------ join
    def join(self) -> int:
        """Take part, with zeros, in the other ranks' allreduces until every rank has joined; return the rank
        that joined last, as Horovod does: of the ranks no round saw joined before the last one, the one that
        waited least (they all stop waiting together, so it arrived last)."""

        def serve(sig: Signature) -> None:
            call = AllreduceCall.of(sig)
            backend = self.serving.get(call.via) or (self.nccl if call.via == "NCCL" else self.mpi)
            backend.allreduce_zeros(call)

        start = time.monotonic()
        last = self.negotiator.join(serve)
        ends = self.comm.allgather((time.monotonic() - start, rules.next_auto_number()))
        rules.continue_auto_names_from(max(number for _, number in ends))
        return min(last, key=lambda r: (ends[r][0], -r))


_lock = threading.Lock()
_current: World | None = None


def current() -> World:
    """The initialised world; raises before ``init()``."""
    world = _current
    if world is None:
        raise ValueError(NOT_INITIALIZED)
    return world


def is_initialized() -> bool:
    """Is there a world (between ``init()`` and ``shutdown()``)?"""
    return _current is not None


def init(comm: Any = None) -> None:
    """Build the world (collective); a second call does nothing. ``comm``: an mpi4py
    communicator or a list of world ranks instead of ``MPI.COMM_WORLD``."""
    global _current
    with _lock:
        if _current is not None:
            return
        _current = World.create(_communicator(comm))
        _name_the_rank_in_uncaught_errors(_current.rank, _current.size)
        _watch_this_rank(_current)
    path = config.TIMELINE.text()
    if path:
        _current.timeline.start(path, config.TIMELINE_MARK_CYCLES.flag())


def _name_the_rank_in_uncaught_errors(rank: int, size: int) -> None:
    """A script's uncaught exception ends its rank, and mpiexec then ends the others without
    saying which rank failed: say it before the traceback (Python's own hook, wrapped once)."""
    previous = sys.excepthook
    if getattr(previous, "names_the_rank", False):
        return

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        print(f"{config.PREFIX} rank {rank} of {size} failed with {kind.__name__}: {value}", file=sys.stderr,
              flush=True)
        previous(kind, value, tb)

    hook.names_the_rank = True  # type: ignore[attr-defined]
    sys.excepthook = hook


_watch: RankWatch | None = None


def _watch_this_rank(world: World) -> None:
    """Under a plain mpiexec, a watcher names this rank if it ends without a word (``hvd_notebook.rankwatch``)."""
    global _watch
    if _watch is None and world.size > 1 and config.RANK_WATCH.flag():
        job = world.comm.bcast(f"{socket.gethostname()}-{os.getpid()}", root=0)  # one name for the job's watchers
        _watch = RankWatch(job, world.rank, world.size)
        atexit.register(_say_goodbye)


def _say_goodbye() -> None:
    global _watch
    if _watch is not None:
        _watch.goodbye()
        _watch = None


def shutdown(resetting: bool = False) -> Any:
    """Free the world; ``init()`` may be called again later. ``resetting``: for ``hvd.elastic``, whose
    ranks all build a new world at once. Returns the communicator the world was built on (or None)."""
    global _current
    with _lock:
        world, _current = _current, None
    if world is not None:
        world.leave(resetting)
        world.free()
    _say_goodbye()
    return None if world is None else world.parent


def _communicator(comm: Any) -> Any:
    from mpi4py import MPI

    if comm is None:
        return MPI.COMM_WORLD
    if isinstance(comm, Sequence) and not isinstance(comm, (str, bytes)):
        return _comm_from_ranks(MPI, list(comm))
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"hvd.init(comm=...) takes an mpi4py communicator or a list of ranks, "
                        f"not {type(comm).__name__}.")
    return comm


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


@atexit.register
def _leave_at_exit() -> None:
    """When the process ends in a world: write a timeline started by HOROVOD_TIMELINE, and
    tell the other ranks that this one is done."""
    world = _current
    if world is not None:
        if world.timeline.active:
            world.stop_timeline()
        world.leave()
