"""Start, watch, stop and restart one ipyparallel cluster of MPI engines.

The controller and the world of engines come from ipyparallel's launchers
(``launch``), placed on hosts by a ``placement``; on top of them this adds what
a shared notebook server needs: a private cluster directory (``workdir``), a
start that fails fast with the launcher's own words (``diagnosis``), and a stop
that proves, by PID, that nothing of the cluster is left (``pids``).
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from ..config import ClusterOptions
from . import diagnosis, leases
from .errors import ClusterError
from .gpus import resolve_gpus
from .launch import EngineWorld, make_ipp_cluster
from .pids import PidRegistry, kill_all
from .placement import choose_placement
from .reaper import start_reaper
from .workdir import WorkDir, new_cluster_id

log = logging.getLogger(__name__)

STOP_GRACE_S = 0.5  # between SIGTERM and SIGKILL when stopping: nothing of a stopped cluster is kept


@dataclass
class RankInfo:
    """One engine as its bootstrap described it."""

    rank: int
    engine_id: int
    host: str
    pid: int
    device: str
    local_rank: int
    local_size: int
    intra_op_threads: int
    inter_op_threads: int
    backend: str
    ip: str = ""  # the rank's address on its route to the controller
    here: bool = True  # on the kernel's host (its pid means something here)

    @classmethod
    def from_bootstrap(cls, engine_id: int, report: dict[str, Any]) -> RankInfo:
        """The rank that ``engine.bootstrap.bootstrap`` described in ``report``."""
        reported = {k: report[k] for k in cls.__dataclass_fields__ if k not in ("engine_id", "here")}
        return cls(engine_id=engine_id, here=report["host"] == socket.gethostname(), **reported)


class MPICluster:
    """An ipyparallel controller plus one ``mpiexec`` world of engines.

    >>> cluster = MPICluster(ClusterOptions(n=2))
    >>> ranks = cluster.start()          # blocks until every rank is bootstrapped
    >>> cluster.client[:].apply_sync(lambda: 1)
    [1, 1]
    >>> cluster.stop()                   # nothing of it is left running
    """

    def __init__(self, options: ClusterOptions) -> None:
        self.host_gpus = resolve_gpus(options.gpus)  # what may be used; start() takes the free ones
        if options.timeout <= 0:
            raise ClusterError(f"--timeout {options.timeout}: give a positive number of seconds.")
        self.placement = choose_placement(options)
        n = self.placement.ranks(self.host_gpus)  # None: settled at start, one rank per free GPU
        self.options = options if n is None else replace(options, n=n)
        self.mpiexec = self.placement.command
        self.gpus: list[str] = []
        self.ipp_cluster: Any = None
        self.client: Any = None
        self.ranks: list[RankInfo] = []
        self.workdir: Path | None = None  # the cluster directory while it runs
        self._lease: leases.Lease | None = None
        self._world: EngineWorld | None = None
        self._pids = PidRegistry()
        self._reaper: subprocess.Popen | None = None

    @property
    def n(self) -> int:
        """The number of ranks (None before ``start`` where free GPUs settle it)."""
        return self.options.n  # type: ignore[return-value]

    # ----------------------------------------------------------------- start
    def start(self) -> list[RankInfo]:
        """Start controller and engines, wait for all, bootstrap them; on any
        failure stop everything that was started and raise ``ClusterError``.
        Where MPI_Init itself failed before any engine connected, try once more:
        that failure can be transient (UCX's address exchange under gforker)."""
        try:
            return self._start_once()
        except ClusterError as exc:
            if not exc.mpi_init_failed:
                raise
        print("[hvd_notebook] MPI_Init failed on a rank before any engine connected; "
              "starting the ranks once more.", file=sys.stderr, flush=True)
        try:
            return self._start_once()
        except ClusterError as exc:
            if not exc.mpi_init_failed:
                raise
            raise ClusterError(f"MPI_Init failed on a rank in two tries in a row. The second: {exc}",
                               mpi_init_failed=True) from None

    def _start_once(self) -> list[RankInfo]:
        deadline = time.monotonic() + self.options.timeout
        cluster_id = new_cluster_id()
        controller_ip = self.placement.controller_ip()
        self.gpus, self._lease = self.placement.take_gpus(self.host_gpus, self.options.n,
                                                          f"kernel {os.getpid()}, {cluster_id}")
        if self._lease is not None:
            self.options = replace(self.options, n=len(self.gpus))  # a restart of this cluster keeps its shape
        try:
            workdir = WorkDir.create(cluster_id)
            self.workdir, self._pids.workdir = workdir.path, workdir
            self.ipp_cluster = make_ipp_cluster(self.placement, cluster_id, workdir.profile, self.n, controller_ip)
            self._reaper = start_reaper(workdir)
            self.ipp_cluster.start_controller_sync()
            self._pids.add(self.ipp_cluster.controller.pid)
            self.client = self.ipp_cluster.connect_client_sync()
            engine_set = self.ipp_cluster.start_engines_sync(self.n)
            self._world = EngineWorld(self.ipp_cluster.engines[engine_set])
            self._pids.add(self._world.pid)
            self._bootstrap(self._wait_for_engines(deadline), deadline)
            workdir.make_private()
        except BaseException:
            self.stop()
            raise
        return self.ranks

    def _wait_for_engines(self, deadline: float) -> list[int]:
        """Engine ids of the whole world once every rank has registered; a ClusterError
        saying why as soon as the launcher has exited, or at the deadline."""
        world = self._world
        while len(registered := set(self.client.ids)) < self.n:
            code = world.exit_code()
            if code is not None:
                output = world.output()
                raise ClusterError(
                    diagnosis.launcher_exited(self.placement.launcher_name, code, self.n, len(registered),
                                              self.placement.diagnose(output), world.command, output),
                    mpi_init_failed=not registered and diagnosis.mpi_init_failed(output),
                )
            if time.monotonic() > deadline:
                raise ClusterError(diagnosis.engines_late(self.n, len(registered), self.options.timeout,
                                                          world.command, world.output()))
            time.sleep(0.05)
        self._pids.remember_descendants()
        return sorted(registered)

    def _bootstrap(self, engine_ids: list[int], deadline: float) -> None:
        """Run the engine bootstrap on every rank and keep what each reports."""
        from ..engine.bootstrap import bootstrap

        ar = self.client[engine_ids].apply_async(bootstrap, self.gpus, self.options.backend,
                                                 self.ipp_cluster.controller_ip)
        if not ar.wait(max(1.0, deadline - time.monotonic())):
            raise ClusterError(diagnosis.setup_late(self.options.timeout))
        try:
            results = ar.get()
        except Exception as exc:
            raise ClusterError(diagnosis.setup_failed(exc)) from None
        sizes = sorted({r["size"] for r in results})
        if sizes != [self.n] or sorted(r["rank"] for r in results) != list(range(self.n)):
            raise ClusterError(diagnosis.not_one_world(self.n, sizes, self.mpiexec))
        self.ranks = sorted(map(RankInfo.from_bootstrap, engine_ids, results), key=lambda r: r.rank)
        self._pids.add(*(r.pid for r in self.ranks if r.here))  # a pid on another host is not ours to kill

    # ----------------------------------------------------------------- state
    def engine_ids(self, ranks: list[int] | None = None) -> list[int]:
        """Engine ids of the given MPI ranks (all ranks when None)."""
        by_rank = {r.rank: r.engine_id for r in self.ranks}
        return [by_rank[r] for r in (sorted(by_rank) if ranks is None else ranks)]

    def pids(self) -> set[int]:
        """Every process of this cluster seen so far (controller, mpiexec, its
        helpers, engines and their nannies, the reaper)."""
        return self._pids.remember_descendants() | ({self._reaper.pid} if self._reaper is not None else set())

    def mpiexec_output_tail(self, lines: int = 20) -> str:
        """The last lines mpiexec and the engines wrote to the launcher's log."""
        return diagnosis.tail(self._world.output() if self._world is not None else "", lines)

    def alive(self) -> dict[int, bool]:
        """Per rank: is its engine process still there? (On another host: is its
        engine still registered, i.e. answering the controller's heartbeats?)"""
        registered = set(self.client.ids) if self.client is not None else set()
        return {r.rank: _running(r.pid) if r.here else r.engine_id in registered for r in self.ranks}

    def end_world(self, timeout: float = 2.0) -> None:
        """Kill the ranks still alive (an MPI world cannot go on once one of its
        ranks died) and give mpiexec a moment to report how each one ended."""
        kill_all({r.pid for r in self.ranks if r.here}, grace=0.0)  # mpiexec ends the ranks elsewhere
        if self._world is not None:
            self._world.wait(timeout)

    def exit_reports(self) -> dict[int, str]:
        """How each rank ended, where the launcher said so: rank -> "exit code 7" or "signal Kill"."""
        return diagnosis.exit_reports(self._world.output() if self._world is not None else "")

    # ------------------------------------------------------------------ stop
    def restart(self) -> list[RankInfo]:
        """End everything and start a fresh controller and MPI world of the same
        shape (every rank's state is lost). A fresh controller means no stale
        registrations of the old engines can be mistaken for the new ones."""
        self.stop()
        return self.start()

    def stop(self) -> None:
        """Kill every process of the cluster by PID (SIGTERM to all at once, SIGKILL
        after a short grace: ipyparallel's launchers would stop them one after the
        other, and a kernel shut down by Jupyter is soon killed itself), then settle
        ipyparallel's bookkeeping and remove the cluster directory."""
        pids = self.pids()
        if self.client is not None:
            try:
                self.client.close(linger=0)
            except Exception:
                log.debug("closing the client failed", exc_info=True)
            self.client = None
        kill_all(pids, grace=STOP_GRACE_S)
        if self.ipp_cluster is not None:
            try:  # its processes are gone: this only settles ipyparallel's bookkeeping
                self.ipp_cluster.stop_cluster_sync()
            except Exception:
                log.debug("ipyparallel's stop failed", exc_info=True)
            self.ipp_cluster = None
        self._pids.clear()
        self._world, self.ranks = None, []
        if self.workdir is not None:
            WorkDir(self.workdir).remove()
            self.workdir = None
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait()
            self._reaper = None
        if self._lease is not None:
            self._lease.release()
            self._lease = None


def _running(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
