"""Start, watch, stop and restart one ipyparallel cluster of MPI engines.

An ``MPICluster`` holds what a restart keeps (the options as asked for; its shape, ``shape.ClusterShape``,
resolved once at its first start; the placement of ranks on hosts; the GPU lease) and the ``LaunchedWorld``
its cells run on (``world``: the controller and the launcher's world of engines, their directory, reaper and
PIDs), and where it keeps one, the warm standby's world (``standby``). A start that fails with MPI_Init is
tried once more; a restart ends the world and promotes the standby (a swap of two worlds) or starts a new
one, on fewer ranks where ``--min-np`` allows and GPUs or hosts are gone.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from ...config import ClusterOptions
from ..errors import ClusterError
from ..node import policy, shm
from ..node.gpus import resolve_gpus
from ..processes.workdir import new_cluster_id
from . import diagnosis
from .channel import RankChannel
from .placements import choose_placement
from .shape import ClusterShape, Holding
from .standby import WarmStandby, choose, wanted
from .world import NO_WORLD, LaunchedWorld, NoWorld, RankInfo

log = logging.getLogger(__name__)

__all__ = ["MPICluster", "RankInfo"]


class MPICluster:
    """An ipyparallel controller plus one ``mpiexec`` world of engines.

    >>> cluster = MPICluster(ClusterOptions(n=2))
    >>> ranks = cluster.start()          # blocks until every rank is bootstrapped
    >>> cluster.channel.call(0, os.getpid, timeout=10)
    4242
    >>> cluster.stop()                   # nothing of it is left running

    Args:
        options: what ``%hvd start`` asked for.
    """

    def __init__(self, options: ClusterOptions) -> None:
        self.host_gpus = resolve_gpus(options.gpus)  # what may be used; start() takes the free ones
        self.rules = policy.load()  # the node's fair-sharing rules, read afresh at each start
        if options.start_timeout <= 0:
            raise ClusterError(f"--timeout {options.start_timeout}: give a positive number of seconds.")
        self.options = options  # as asked for: never rewritten (what the cluster became is ``shape``)
        self.placement = choose_placement(options)
        self._asked = self.placement.ranks(self.host_gpus)  # None: settled at start, one rank per free GPU
        self.holding = Holding(options.min_np)  # its shape, once resolved, and its GPUs' lease
        self.mpiexec = self.placement.command
        self.standby_choice = choose(options, self.placement)
        self.standby: WarmStandby | None = None  # the warm standby world that the next restart promotes
        self.world: LaunchedWorld | NoWorld = NO_WORLD  # the world cells run on

    @property
    def shape(self) -> ClusterShape | None:
        """How many ranks on which GPUs: resolved at the first start, read from here (None before it)."""
        return self.holding.shape

    @property
    def n(self) -> int | None:
        """The number of ranks (None before ``start`` where free GPUs settle it)."""
        return self.shape.ranks if self.shape is not None else self._asked

    @property
    def gpus(self) -> list[str]:
        """The GPU ids the ranks pin by local rank (none before ``start``, and for CPU ranks)."""
        return list(self.shape.gpus) if self.shape is not None else []

    @property
    def channel(self) -> RankChannel:
        """Every message to the ranks of the world (a ClusterError without one)."""
        return self.world.channel

    @property
    def ranks(self) -> list[RankInfo]:
        return self.world.ranks

    @property
    def workdir(self) -> Path | None:
        """The cluster directory while it runs."""
        return self.world.workdir

    # ----------------------------------------------------------------- start
    def start(self) -> list[RankInfo]:
        """Start controller and engines, wait for all, bootstrap them, then launch the
        warm standby in the background where one is wanted; on any failure stop
        everything that was started and raise ``ClusterError``."""
        self._start_cold()
        self._start_standby()
        return self.ranks

    def _start_cold(self) -> list[RankInfo]:
        """A start, tried once more where MPI_Init itself failed before any engine connected (that
        failure can be transient: ``diagnosis.tries_where_mpi_init_fails``)."""
        ended = diagnosis.tries_where_mpi_init_fails(_init_failure_returned(self._start_once),
                                                     lambda r: isinstance(r, ClusterError), "any engine connected")
        if isinstance(ended, ClusterError):
            raise ClusterError(f"MPI_Init failed on a rank in two tries in a row. The second: {ended}",
                               mpi_init_failed=True) from None
        return ended

    def _start_once(self) -> list[RankInfo]:
        cluster_id = new_cluster_id()
        shape = self.holding.take(self.placement, self.host_gpus, self._asked,  # (a restart keeps what it had)
                                  f"kernel {os.getpid()}, {cluster_id}", self.rules)
        deadline = time.monotonic() + self.options.start_timeout  # (after a wait in the queue for GPUs)
        self.world = LaunchedWorld(self.placement, shape, self.options)
        try:
            return self.world.start(cluster_id, deadline)
        except BaseException:
            self.stop()
            raise

    def _start_standby(self) -> None:
        if wanted(self.standby_choice, self.placement, self.n):
            placement, shape, options = self.placement, self.holding.current(), self.options
            self.standby = WarmStandby(lambda: LaunchedWorld(placement, shape, options))

    def _promote(self, warm: LaunchedWorld) -> bool:
        """Make the launched standby ``warm`` this cluster's world and finish every rank's bootstrap:
        ``hvd.init()`` and what follows it. False (and nothing of it left running) where that failed."""
        self.world = warm
        try:
            warm.promote()
            return True
        except Exception:  # (a rank of it died just now): the caller starts cold
            log.info("promoting the warm standby failed", exc_info=True)
            self._end_world()
            return False
        except BaseException:
            self.stop()
            raise

    # ----------------------------------------------------------------- state
    def pids(self) -> set[int]:
        """Every process of this cluster seen so far (controller, mpiexec, its
        helpers, engines and their nannies, the reaper; its standby's)."""
        standby = self.standby.pids() if self.standby is not None else set()
        return self.world.pids() | standby

    @property
    def standby_state(self) -> str:
        """The warm standby: ``off``, ``starting``, ``ready`` or ``failed: why``."""
        return self.standby.state if self.standby is not None else "off"

    def settle(self, timeout: float) -> None:
        """Wait (up to ``timeout`` seconds) until the warm standby, where one is starting, has started or
        failed: its launch takes CPU that a measurement (a sweep's point) would count against the ranks."""
        if self.standby is not None:
            self.standby.settle(timeout)

    def mpiexec_output_tail(self, lines: int = 20) -> str:
        """The last lines mpiexec and the engines wrote to the launcher's log."""
        return self.world.output_tail(lines)

    def alive(self) -> dict[int, bool]:
        """Per rank: is its engine process still there? (On another host: is its engine still registered?)"""
        return self.world.alive()

    def end_world(self, timeout: float = 2.0) -> None:
        """Kill the ranks still alive (an MPI world cannot go on once one of its ranks died) and give
        mpiexec a moment to report how each one ended."""
        self.world.end(timeout)

    def exit_reports(self) -> dict[int, str]:
        """How each rank ended, where the launcher said so: rank -> "exit code 7" or "signal Kill"."""
        return self.world.exit_reports()

    # ------------------------------------------------------------------ stop
    def restart(self) -> list[RankInfo]:
        """End the world and bring up a fresh controller and MPI world of the same shape on the same GPUs (every
        rank's state is lost): the warm standby where there is one (waited for where it still starts), else a
        cold start. (With a fresh controller, no stale registration of an old engine passes for a new one.)"""
        standby, self.standby = self.standby, None
        warm = standby.take(self.options.start_timeout) if standby is not None else None
        self._end_world()  # the same GPUs (the lease is kept): the standby's ranks are pinned to them
        try:
            if self.holding.drop_gone_gpus() and warm is not None:
                warm.stop()  # it has the old shape
                warm = None
        except BaseException:  # fewer GPUs than --min-np: nothing is kept
            if warm is not None:
                warm.stop()
            self.stop()
            raise
        if warm is None or not self._promote(warm):
            self._start_cold_or_smaller()  # (a start that fails stops everything, the lease too)
        self._start_standby()
        return self.ranks

    def _start_cold_or_smaller(self) -> None:
        """A cold start; where it fails on hosts that no longer answer and ``--min-np`` allows, again
        on the hosts that do."""
        try:
            self._start_cold()
        except ClusterError as exc:
            shape = self.holding.current()
            smaller = self.placement.without_failures() if shape.min_ranks < shape.ranks else None
            if smaller is None:
                raise
            kept, room, why = smaller
            self.holding.shrink(min(shape.ranks, room), why)
            self.placement = kept
            try:
                self._start_cold()
            except ClusterError as again:
                raise ClusterError(f"{again}\n(The first try, on every host: {exc})") from None

    def _end_world(self) -> None:
        """Stop the world cells ran on (its standby stays, and the lease: a restart takes the same GPUs)."""
        world, self.world = self.world, NO_WORLD
        world.stop()
        shm.remove_orphaned()  # the killed ranks' MPICH segments (of this and earlier worlds) in /dev/shm

    def stop(self) -> None:
        """Stop every process of the cluster, its standby's too (each world killed by PID, its directory
        removed), and release the lease."""
        if self.standby is not None:
            self.standby.cancel()
            self.standby = None
        self._end_world()
        self.holding.release()


def _init_failure_returned(start_once: Callable[[], list[RankInfo]]) -> Callable[[], list[RankInfo] | ClusterError]:
    """``start_once`` returning, not raising, the ClusterError of an MPI_Init that failed (to be tried again)."""
    def start() -> list[RankInfo] | ClusterError:
        try:
            return start_once()
        except ClusterError as exc:
            if exc.mpi_init_failed:
                return exc
            raise

    return start
