"""Horovod's process sets: named subsets of the world's ranks that run collectives among themselves.

``hvd.ProcessSet([0, 2])`` (global ranks) or ``hvd.ProcessSet(comm)`` (an mpi4py communicator)
is registered by ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set`` and gets an id;
a collective given ``process_set=`` then runs on that set's own MPI sub-communicator, with its own
agreement (``Negotiator``) and backends (``MpiBackend``, and NCCL where the world has it), so that
its calls never pair with the world's. Registering and removing are collective over every rank of
the world, as in Horovod; ids are handed out in order and reused after a removal.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from numbers import Integral
from typing import Any

from ... import config
from . import world as _world

# what Horovod's process_set_included_op returns instead of 0 or 1
PROCESS_SET_ERROR_INIT = -1  # hvd.init() not called
PROCESS_SET_ERROR_UNKNOWN_SET = -3  # no process set of that id


class NotAMemberError(ValueError):
    """A rank called a collective on a process set it does not belong to."""


def _is_iterable(x: Any) -> bool:
    try:
        iter(x)
    except TypeError:
        return False
    return not isinstance(x, (str, bytes))


class ProcessSet:
    """Some ranks of the world that run collectives among themselves, as Horovod's ``hvd.ProcessSet``.

    A new set has no id. ``hvd.init(process_sets=[...])`` or ``hvd.add_process_set`` registers it and sets
    ``process_set_id``. Pass it to a collective's ``process_set`` argument then. Collectives still take global
    ranks: ``broadcast``'s ``root_rank`` is an ``hvd.rank()``.

    >>> evens = hvd.ProcessSet([0, 2])
    >>> hvd.init(process_sets=[evens])

    Args:
        ranks_or_comm: the set's global ranks, as a list of ints in any order; or an mpi4py communicator whose ranks
            form the set. A set built from a communicator can be registered by ``hvd.init`` only.

    Raises:
        ValueError: ``ranks_or_comm`` is a list holding something other than ints, or neither a list nor an mpi4py
            communicator.
    """

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Sequence[int] | Any) -> None:
        if _is_iterable(ranks_or_comm):
            ranks = list(ranks_or_comm)
            if any(isinstance(r, bool) or not isinstance(r, Integral) for r in ranks):
                raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py "
                                 f"Comm object, not {ranks_or_comm!r}.")
            self.ranks = sorted(int(r) for r in ranks)
            return
        from mpi4py import MPI

        if not isinstance(ranks_or_comm, MPI.Comm):
            raise ValueError("ProcessSet should be initialized with a list of process ranks or an mpi4py Comm "
                             f"object, not {type(ranks_or_comm).__name__}.")
        self.mpi_comm = ranks_or_comm

    def size(self) -> int | None:
        """Return the number of ranks in the set.

        Returns:
            An int, or None while the set is not registered.

        Raises:
            ValueError: the runtime is not initialised, or the set's id is not registered any more.
        """
        if self.process_set_id is None:
            return None
        return table().size_of(self.process_set_id)

    def rank(self) -> int | None:
        """Return this process's rank within the set.

        Collectives still take global ranks: ``broadcast``'s ``root_rank`` is an ``hvd.rank()``.

        Returns:
            An int from 0 to ``size() - 1``, or None while the set is not registered.

        Raises:
            ValueError: this process is not in the set, the runtime is not initialised, or the set's id is not
                registered any more.
        """
        if self.process_set_id is None:
            return None
        return table().rank_in(self.process_set_id)

    def included(self) -> bool | None:
        """Tell whether this process belongs to the set.

        Returns:
            True or False; None while the set's ranks are not known (a set built from a communicator, before
            ``hvd.init`` registers it).

        Raises:
            ValueError: the runtime is not initialised.
        """
        if self.ranks is None:
            return None
        return _world.current().rank in self.ranks

    def _invalidate(self) -> None:
        self.process_set_id = None

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


# ------------------------------------------------------------------ pure rules
def check_ranks(ranks: Sequence[int], world_size: int) -> tuple[int, ...]:
    """``ranks`` sorted, after Horovod's checks: non-empty, no rank twice, each within the world."""
    ranks = sorted(ranks)
    if not ranks:
        raise ValueError("a process set needs at least one rank.")
    twice = sorted({r for r in ranks if ranks.count(r) > 1})
    if twice:
        raise ValueError(f"Tried to register process set with duplicate rank: {twice[0]}.")
    outside = [r for r in ranks if not 0 <= r < world_size]
    if outside:
        raise ValueError(f"Tried to register process set with invalid rank: {outside[0]} (ranks are "
                         f"0..{world_size - 1}).")
    return tuple(ranks)


def sets_to_register(world_size: int, from_comms: Iterable[tuple[int, ...]],
                     from_ranks: Iterable[Sequence[int]], registered: Iterable[tuple[int, ...]]) -> list[tuple]:
    """The new process sets an ``init`` registers, in id order, as Horovod orders them: the distinct
    sets of every rank's communicators (sorted), then those given as ranks; none twice, none that
    is registered already (the global set included)."""
    seen = set(registered) | {tuple(range(world_size))}
    new = []
    for ranks in sorted(set(from_comms)) + [check_ranks(r, world_size) for r in from_ranks]:
        if ranks not in seen:
            seen.add(ranks)
            new.append(ranks)
    return new


class IdPool:
    """Process set ids as Horovod hands them out: the next number, or the oldest one freed."""

    def __init__(self) -> None:
        self.next = 1
        self.freed: deque[int] = deque()

    def take(self) -> int:
        if self.freed:
            return self.freed.popleft()
        self.next += 1
        return self.next - 1

    def give_back(self, process_set_id: int) -> None:
        self.freed.append(process_set_id)


# ------------------------------------------------------------------ one set on one rank
class SetBackends(_world.Backends):
    """This rank's part in one process set: the set's communicator, agreement and backends."""

    def __init__(self, comm: Any, ranks: tuple[int, ...], world: _world.World) -> None:
        # (collective over the set: every member has a GPU where the world's NCCL runs)
        super().__init__(comm, world.local_comm.Get_rank(), world.timeline, nccl=world.nccl is not None)
        self.ranks = ranks

    def root(self, root_rank: int) -> int:
        try:
            return self.ranks.index(int(root_rank))
        except ValueError:
            raise ValueError(f"root_rank={root_rank!r} is not in the process set (ranks {list(self.ranks)}).") \
                from None


# ------------------------------------------------------------------ the table of one world
class ProcessSetTable:
    """Every process set registered in one world, by id (0 is the world itself). Registering and
    removing are collective over the world, on a communicator of their own."""

    def __init__(self, world: _world.World, dynamic: bool) -> None:
        self.world, self.dynamic = world, dynamic
        self.comm = world.comm.Dup()  # (collective: built at init, while every rank is there)
        self.ranks: dict[int, tuple[int, ...]] = {0: tuple(range(world.size))}
        self.backends: dict[int, SetBackends] = {}  # the sets this rank belongs to
        self.ids = IdPool()

    def register(self, sets: list[tuple[int, ...]]) -> list[int]:
        """Give each set an id and, on its members, its communicator and backends (collective); the ids."""
        ids = []
        for ranks in sets:
            process_set_id = self.ids.take()
            color = 0 if self.world.rank in ranks else self.world.MPI.UNDEFINED
            sub = self.comm.Split(color, key=self.world.rank)
            if sub != self.world.MPI.COMM_NULL:
                self.backends[process_set_id] = SetBackends(sub, ranks, self.world)
            self.ranks[process_set_id] = ranks
            ids.append(process_set_id)
        return ids

    def id_of(self, ranks: Sequence[int]) -> int | None:
        return next((i for i, r in self.ranks.items() if r == tuple(ranks)), None)

    def agree(self, what: str, doing: str, request: Any) -> None:
        """Raise unless process sets may change after ``init``, and on every rank unless every rank asks the
        same (collective)."""
        if not self.dynamic:
            raise ValueError("Set HOROVOD_DYNAMIC_PROCESS_SETS=1 (or call hvd.init(process_sets=\"dynamic\")) to "
                             f"allow {doing} process sets after Horovod initialization.")
        requests = self.comm.allgather(request)
        if any(r != requests[0] for r in requests):
            differing = ", ".join(f"rank {i}: {r!r}" for i, r in enumerate(requests))
            raise ValueError(f"{what} must be called on every rank with the same process sets; got {differing}.")

    def add(self, ranks: Sequence[int]) -> int | None:
        """Register one set (collective); None where a set of these ranks exists already."""
        self.agree("hvd.add_process_set", "adding", sorted(ranks))
        ranks = check_ranks(ranks, self.world.size)
        if self.id_of(ranks) is not None:
            return None
        return self.register([ranks])[0]

    def remove(self, process_set_id: int) -> bool:
        """Free one set (collective); False where no set has this id."""
        self.agree("hvd.remove_process_set", "removing", process_set_id)
        if process_set_id not in self.ranks:
            return False
        del self.ranks[process_set_id]
        backends = self.backends.pop(process_set_id, None)
        if backends is not None:
            backends.free()
        self.ids.give_back(process_set_id)
        return True

    def size_of(self, process_set_id: int) -> int:
        return len(self._ranks_of(process_set_id))

    def rank_in(self, process_set_id: int) -> int:
        ranks = self._ranks_of(process_set_id)
        if self.world.rank not in ranks:
            raise ValueError("Process is not part of provided process set.")
        return ranks.index(self.world.rank)

    def _ranks_of(self, process_set_id: int) -> tuple[int, ...]:
        ranks = self.ranks.get(process_set_id)
        if ranks is None:
            raise ValueError(f"Process set {process_set_id} does not exist or has not been registered.")
        return ranks

    def backends_of(self, process_set: ProcessSet, call: str) -> SetBackends:
        """The set's backends on this rank; raises for an unknown set or a rank outside it."""
        process_set_id = process_set.process_set_id
        backends = self.backends.get(process_set_id) if process_set_id is not None else None
        if backends is not None:
            return backends
        if process_set_id is None or process_set_id not in self.ranks:
            raise ValueError(f"{call}: process set provided does not exist, or has not been registered: "
                             f"{process_set}. Register it with hvd.init(process_sets=[...]) or "
                             "hvd.add_process_set(...).")
        raise NotAMemberError(f"{call}: rank {self.world.rank} is not a member of the provided process set "
                              f"(ranks {list(self.ranks[process_set_id])}).")

    def free(self) -> None:
        """Release every set's communicators, then the table's own (collective)."""
        for backends in self.backends.values():
            backends.free()
        self.backends.clear()
        self.comm.Free()


# ------------------------------------------------------------------ the API
_lock = threading.Lock()


def table() -> ProcessSetTable:
    """The process sets of the initialised world (created with it by ``init``)."""
    world = _world.current()
    if world.process_sets is None:
        raise ValueError(_world.NOT_INITIALIZED)
    return world.process_sets


def backends(process_set: Any, call: str) -> Any:
    """What a collective on ``process_set`` runs on: the world for the global set (or None), else the set's
    own communicator and backends. Raises ``NotAMemberError`` on a rank outside the set."""
    if process_set is None or process_set is global_process_set:
        return _world.current()
    if not isinstance(process_set, ProcessSet):
        raise ValueError(f"{call}(process_set={process_set!r}): process_set takes a hvd.ProcessSet "
                         "(hvd.global_process_set, or one registered with hvd.init(process_sets=[...]) or "
                         "hvd.add_process_set(...)).")
    if process_set.process_set_id == 0:
        return _world.current()
    return table().backends_of(process_set, call)


def check(process_set: Any, call: str) -> None:
    """Refuse, before any communication, a ``process_set=`` that is not a ``ProcessSet``."""
    if process_set is not None and not isinstance(process_set, ProcessSet):
        backends(process_set, call)


def init(comm: Any = None, process_sets: Any = None) -> None:
    """``hvd.init``: build the world (a second call keeps it) and register ``process_sets``, a list of
    ``ProcessSet`` or ``"dynamic"`` (collective: every rank passes the same sets, or its own communicator)."""
    dynamic = isinstance(process_sets, str) and process_sets.lower() == "dynamic"
    if dynamic:
        os.environ[config.DYNAMIC_PROCESS_SETS.name] = "1"  # as Horovod: later add/remove are allowed
    sets = [] if process_sets is None or dynamic else list(process_sets)
    if any(not isinstance(ps, ProcessSet) for ps in sets):
        raise ValueError(f"hvd.init(process_sets={process_sets!r}) takes a list of hvd.ProcessSet or \"dynamic\".")
    via_comm = [ps for ps in sets if ps.ranks is None]
    if via_comm and comm is not None and _is_iterable(comm):
        raise NotImplementedError("At this time process sets defined via MPI communicators are only supported "
                                  "when calling hvd.init() with comm set to a global MPI communicator.")
    _world.init(comm)
    world = _world.current()
    with _lock:
        if world.process_sets is None:
            world.process_sets = ProcessSetTable(world, config.DYNAMIC_PROCESS_SETS.flag())
    found = world.process_sets
    found.dynamic = found.dynamic or dynamic
    global_process_set.ranks = list(range(world.size))
    _register_at_init(found, sets)


def _register_at_init(found: ProcessSetTable, sets: list[ProcessSet]) -> None:
    """Register the sets given to ``init`` and give each object its id; a set given twice is refused."""
    world = found.world
    comms = {id(ps): _ranks_of_comm(ps.mpi_comm, world) for ps in sets if ps.ranks is None}
    from_ranks = [tuple(ps.ranks) for ps in sets if ps.ranks is not None]
    gathered = found.comm.allgather((list(comms.values()), from_ranks))
    if any(g[1] != from_ranks for g in gathered):
        raise ValueError("hvd.init(process_sets=...) must be given the same process sets on every rank; got "
                         + ", ".join(f"rank {i}: {g[1]}" for i, g in enumerate(gathered)) + ".")
    from_comms = [ranks for g in gathered for ranks in g[0]]
    found.register(sets_to_register(world.size, from_comms, from_ranks, found.ranks.values()))
    seen = {0}
    for i, ps in enumerate(sets):
        if ps.ranks is None:
            ps.ranks = list(comms[id(ps)])
        ps.process_set_id = found.id_of(ps.ranks)
        if ps.process_set_id in seen:
            ps._invalidate()
            raise ValueError(f"Horovod could not be initialized because process_sets entry number {i} is a "
                             f"duplicate: {ps}")
        seen.add(ps.process_set_id)


def _ranks_of_comm(comm: Any, world: _world.World) -> tuple[int, ...]:
    """The world ranks of ``comm``'s members."""
    group, world_group = comm.Get_group(), world.comm.Get_group()
    ranks = group.Translate_ranks(list(range(comm.Get_size())), world_group)
    group.Free()
    world_group.Free()
    if any(r == world.MPI.UNDEFINED for r in ranks):
        raise ValueError("a process set's MPI communicator has ranks outside the world given to hvd.init().")
    return tuple(sorted(ranks))


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a process set after ``hvd.init()`` and return it.

    A collective call over every rank of the world: each rank passes the same ranks. Adding sets after ``init`` must
    be allowed, by ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or by ``hvd.init(process_sets="dynamic")``.

    >>> evens = hvd.add_process_set([0, 2])
    >>> hvd.allreduce(x, process_set=evens)  # on ranks 0 and 2 only

    Args:
        process_set: an ``hvd.ProcessSet`` built from a list of ranks, or the list of global ranks itself.

    Returns:
        The ``hvd.ProcessSet``, with its ``process_set_id`` set: the object passed, or a new one built from the
        list.

    Raises:
        ValueError: dynamic process sets are not allowed; ranks pass different sets; the ranks are empty, repeat a
            rank or name a rank outside the world; a set of these ranks is registered already; or the runtime is not
            initialised.
        NotImplementedError: ``process_set`` was built from an MPI communicator.
    """
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    if process_set.ranks is None:
        raise NotImplementedError("Dynamically adding process sets defined by an MPI communicator is not "
                                  "implemented. Please build the process set via a list of ranks.")
    process_set_id = table().add(process_set.ranks)
    if process_set_id is None:
        raise ValueError(f"Attempted to add a duplicate process set: {process_set}")
    process_set.process_set_id = process_set_id
    return process_set


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a process set added before, and free its communicators.

    A collective call over every rank of the world: each rank passes the same set. Removing sets needs dynamic
    process sets, as ``add_process_set`` does. The object's ``process_set_id`` is cleared; its id may be given to a
    later set.

    Args:
        process_set: the ``hvd.ProcessSet`` to remove.

    Returns:
        True where the set was removed. False for ``hvd.global_process_set``, for a set that was never registered,
        and for one removed already.

    Raises:
        ValueError: dynamic process sets are not allowed; ranks pass different sets; or the runtime is not
            initialised.
    """
    process_set_id = process_set.process_set_id
    if process_set_id is None or process_set_id == 0:
        return False
    process_set._invalidate()
    return table().remove(process_set_id)


def size_of(process_set_id: int) -> int:
    """Number of ranks in the set ``process_set_id`` (0: the world)."""
    return _world.current().size if process_set_id == 0 else table().size_of(process_set_id)


def included(process_set_id: int) -> int:
    """1 or 0 as this process belongs to the set, or Horovod's error codes (before ``init``, unknown set)."""
    if not _world.is_initialized():
        return PROCESS_SET_ERROR_INIT
    if process_set_id == 0:
        return 1
    ranks = table().ranks.get(process_set_id)
    if ranks is None:
        return PROCESS_SET_ERROR_UNKNOWN_SET
    return int(_world.current().rank in ranks)


__all__ = ["ProcessSet", "add_process_set", "global_process_set", "remove_process_set"]
