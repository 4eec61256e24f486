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
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psutil

from ..config import ClusterOptions
from . import diagnosis, leases, policy, shm
from .errors import ClusterError
from .gpus import detect_gpus, resolve_gpus
from .launch import EngineWorld, make_ipp_cluster
from .pids import PidRegistry, kill_all
from .placement import HostList, choose_placement
from .reaper import start_reaper
from .standby import WarmStandby, choose, wanted
from .workdir import WorkDir, new_cluster_id

log = logging.getLogger(__name__)

STOP_GRACE_S = 0.5  # between SIGTERM and SIGKILL when stopping: nothing of a stopped cluster is kept
SHM_CHECK_S = 0.25  # between looks at the shared memory of a world that is starting


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
    framework: str = ""  # e.g. "torch 2.13.0+cpu, torch.distributed gloo"
    ip: str = ""  # the rank's address on its route to the controller
    here: bool = True  # on the kernel's host (its pid means something here)

    @classmethod
    def from_bootstrap(cls, engine_id: int, report: dict[str, Any]) -> RankInfo:
        """The rank that ``engine.bootstrap.bootstrap`` described in ``report``."""
        reported = {k: report[k] for k in cls.__dataclass_fields__ if k not in ("engine_id", "here") and k in report}
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
        try:
            self.rules = policy.load()  # the node's fair-sharing rules, read afresh at each start
        except policy.PolicyError as exc:
            raise ClusterError(str(exc)) from None
        if options.timeout <= 0:
            raise ClusterError(f"--timeout {options.timeout}: give a positive number of seconds.")
        self.placement = choose_placement(options)
        n = self.placement.ranks(self.host_gpus)  # None: settled at start, one rank per free GPU
        self.options = options if n is None else replace(options, n=n)
        self.mpiexec = self.placement.command
        self.standby_choice = choose(options, self.placement)
        self._standby: WarmStandby | None = None
        self.gpus: list[str] = []
        self.ipp_cluster: Any = None
        self.client: Any = None
        self.ranks: list[RankInfo] = []
        self.workdir: Path | None = None  # the cluster directory while it runs
        self._lease: leases.Lease | None = None
        self._world: EngineWorld | None = None
        self._pids = PidRegistry()
        self._warm_pids: set[int] = set()  # the engines of a launched standby (``launch_standby``)
        self._reaper: subprocess.Popen | None = None

    @property
    def n(self) -> int:
        """The number of ranks (None before ``start`` where free GPUs settle it)."""
        return self.options.n  # type: ignore[return-value]

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
        def start() -> list[RankInfo] | ClusterError:
            try:
                return self._start_once()
            except ClusterError as exc:
                if exc.mpi_init_failed:
                    return exc
                raise

        ended = diagnosis.tries_where_mpi_init_fails(start, lambda r: isinstance(r, ClusterError),
                                                     "any engine connected")
        if isinstance(ended, ClusterError):
            raise ClusterError(f"MPI_Init failed on a rank in two tries in a row. The second: {ended}",
                               mpi_init_failed=True) from None
        return ended

    def _start_once(self) -> list[RankInfo]:
        deadline = time.monotonic() + self.options.timeout
        cluster_id = new_cluster_id()
        if self._lease is None:  # (a restart keeps the lease, and so the GPUs, it had)
            self.gpus, self._lease = self.placement.take_gpus(self.host_gpus, self.options.n,
                                                              f"kernel {os.getpid()}, {cluster_id}", self.rules)
        if self._lease is not None:
            self.options = replace(self.options, n=len(self.gpus))  # a restart of this cluster keeps its shape
        try:
            workdir = self._launch(cluster_id, deadline)
            self._bootstrap(self._wait_for_engines(deadline), deadline)
            workdir.make_private()
        except BaseException:
            self.stop()
            raise
        return self.ranks

    def _launch(self, cluster_id: str, deadline: float) -> WorkDir:
        """Make the cluster directory, start the reaper, the controller and the world of engines
        (without waiting for them); the directory."""
        controller_ip = self.placement.controller_ip()
        self.placement.check_room(self.n)  # (ranks without room in /dev/shm die of SIGBUS)
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
        return workdir

    def launch_standby(self, gpus: list[str], cancelled: threading.Event) -> None:
        """Bring this (not started) cluster up as the warm standby of a cluster that holds ``gpus``:
        controller and engines up, every rank's imports done and device pinned, but no runtime
        initialised, no GPU context and no lease of its own (``engine.bootstrap.warm_up``). A
        ClusterError where it fails or ``cancelled`` is set; nothing of it is left running then."""
        from ..engine.bootstrap import warm_up

        deadline = time.monotonic() + self.options.timeout
        self.gpus = list(gpus)
        try:
            workdir = self._launch(new_cluster_id(), deadline)
            workdir.mark_standby()
            ar = self.client[self._wait_for_engines(deadline, cancelled)].apply_async(warm_up, self.gpus,
                                                                                    self.options.backend,
                                                                                    self.options.framework)
            while not ar.wait(0.1):
                if cancelled.is_set() or time.monotonic() > deadline:
                    raise ClusterError("the standby was cancelled" if cancelled.is_set()
                                       else diagnosis.setup_late(self.options.timeout))
            try:
                self._warm_pids = set(ar.get())
            except Exception as exc:
                raise ClusterError(diagnosis.setup_failed(exc)) from None
            self._pids.add(*self._warm_pids)
            workdir.make_private()
        except BaseException:
            self.stop()
            raise

    def _wait_for_engines(self, deadline: float, cancelled: threading.Event | None = None) -> list[int]:
        """Engine ids of the whole world once every rank has registered; a ClusterError
        saying why as soon as the launcher has exited, or at the deadline."""
        world, shm_checked = self._world, 0.0
        while len(registered := set(self.client.ids)) < self.n:
            if cancelled is not None and cancelled.is_set():
                raise ClusterError("the standby was cancelled")
            if time.monotonic() - shm_checked > SHM_CHECK_S:  # a rank on a planted segment never registers
                self._check_shm()
                shm_checked = time.monotonic()
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

    def _start_standby(self) -> None:
        if wanted(self.standby_choice, self.placement, self.n):
            self._standby = WarmStandby(lambda: MPICluster(self.options), self.gpus)

    def _promote(self, warm: MPICluster) -> bool:
        """Make the launched standby ``warm`` this cluster's world (its processes, directory and
        client), and finish every rank's bootstrap: ``hvd.init()`` and what follows it. False
        (and nothing of it left running) where that failed."""
        self.ipp_cluster, self.client, self.workdir = warm.ipp_cluster, warm.client, warm.workdir
        self._world, self._pids, self._reaper = warm._world, warm._pids, warm._reaper
        try:
            WorkDir(self.workdir).mark_standby(False)
            self._bootstrap(sorted(self.client.ids), time.monotonic() + self.options.timeout)
            return True
        except Exception:  # (a rank of it died just now): the caller starts cold
            log.info("promoting the warm standby failed", exc_info=True)
            self._stop_keeping_lease()
            return False
        except BaseException:
            self.stop()
            raise

    def _bootstrap(self, engine_ids: list[int], deadline: float) -> None:
        """Run the engine bootstrap on every rank and keep what each reports."""
        from ..engine.bootstrap import bootstrap

        ar = self.client[engine_ids].apply_async(bootstrap, self.gpus, self.options.backend,
                                                 self.ipp_cluster.controller_ip, self.options.framework)
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
        self._check_shm()  # before any cell runs

    def _check_shm(self) -> None:
        """``shm.ShmError`` where a process of the world here has another user's shared memory (or memory
        others may read) open or mapped."""
        world = self._world
        shm.check_world(world.pid if world is not None else None, (r.pid for r in self.ranks if r.here),
                        gforker=self.placement.gforker, n=self.n)

    # ----------------------------------------------------------------- state
    def engine_ids(self, ranks: list[int] | None = None) -> list[int]:
        """Engine ids of the given MPI ranks (all ranks when None)."""
        by_rank = {r.rank: r.engine_id for r in self.ranks}
        return [by_rank[r] for r in (sorted(by_rank) if ranks is None else ranks)]

    def pids(self) -> set[int]:
        """Every process of this cluster seen so far (controller, mpiexec, its
        helpers, engines and their nannies, the reaper; its standby's)."""
        standby = self._standby.pids() if self._standby is not None else set()
        return (self._pids.remember_descendants() | ({self._reaper.pid} if self._reaper is not None else set())
                | standby)

    @property
    def standby(self) -> WarmStandby | None:
        """The warm standby world that the next restart promotes, where there is one."""
        return self._standby

    @property
    def standby_state(self) -> str:
        """The warm standby: ``off``, ``starting``, ``ready`` or ``failed: why``."""
        return self._standby.state if self._standby is not None else "off"

    def engines_whole(self) -> bool:
        """The launcher still runs, every engine is registered, and (for a standby) each is alive."""
        return (self._world is not None and self._world.exit_code() is None and self.client is not None
                and len(set(self.client.ids)) == self.n and all(map(_running, self._warm_pids)))

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
        """End the world and bring up a fresh controller and MPI world of the same shape
        on the same GPUs (every rank's state is lost): the warm standby where there is one
        (waiting for it where it is still starting), else a cold start. A fresh controller
        means no stale registrations of the old engines can be mistaken for the new ones."""
        standby, self._standby = self._standby, None
        warm = standby.take(self.options.timeout) if standby is not None else None
        self._stop_keeping_lease()  # the same GPUs: the standby's ranks are pinned to them
        try:
            if self._drop_gone_gpus() and warm is not None:
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

    def _min_np(self) -> int:
        return self.options.min_np or self.n

    def _shrink(self, n: int, why: str) -> None:
        """Go on with ``n`` ranks, where ``--min-np`` allows it; else a ClusterError saying ``why``."""
        if n < self._min_np():
            raise ClusterError(f"{why}: {n} rank(s) could go on, fewer than the {self._min_np()} that --min-np "
                               f"asks for. Start again with what is left (%hvd start --restart -n {n}), or with "
                               f"--min-np {max(n, 1)} to let restarts go on with fewer ranks.")
        print(f"[hvd_notebook] {why}: the new world has {n} rank(s) instead of {self.n} "
              f"(--min-np {self._min_np()}).", file=sys.stderr, flush=True)
        self.options = replace(self.options, n=n)

    def _drop_gone_gpus(self) -> bool:
        """Where the driver no longer lists some of the cluster's GPUs (fallen off the bus, reset,
        taken away): drop them from the lease and the shape. Whether the shape changed."""
        present = set(detect_gpus()) if self.gpus else set()
        gone = [g for g in self.gpus if g not in present]
        if not present or not gone:  # (no GPUs, or the driver cannot tell)
            return False
        self._shrink(len(self.gpus) - len(gone), f"GPU(s) {','.join(gone)} are no longer listed by the driver")
        self.gpus = [g for g in self.gpus if g not in gone]
        if self._lease is not None:
            self._lease.drop(gone)
        return True

    def _start_cold_or_smaller(self) -> None:
        """A cold start; where it fails on hosts that no longer answer and ``--min-np`` allows, again
        on the hosts that do."""
        try:
            self._start_cold()
        except ClusterError as exc:
            if not isinstance(self.placement, HostList) or self._min_np() >= self.n:
                raise
            gone = self.placement.host_failures()
            if not gone:
                raise
            kept = self.placement.without(list(gone))
            self._shrink(min(self.n, kept.slots) if kept.hosts else 0, "; ".join(gone.values()))
            self.placement = kept
            self.options = replace(self.options, hosts=kept.options.hosts, hostfile=None)
            try:
                self._start_cold()
            except ClusterError as again:
                raise ClusterError(f"{again}\n(The first try, on every host: {exc})") from None

    def _stop_keeping_lease(self) -> None:
        lease, self._lease = self._lease, None
        self.stop()
        self._lease = lease

    def stop(self) -> None:
        """Kill every process of the cluster by PID (SIGTERM to all at once, SIGKILL
        after a short grace: ipyparallel's launchers would stop them one after the
        other, and a kernel shut down by Jupyter is soon killed itself), then settle
        ipyparallel's bookkeeping and remove the cluster directory; its standby too."""
        if self._standby is not None:
            self._standby.cancel()
            self._standby = None
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
        if self._world is not None and self.placement.gforker:
            shm.remove_world(self._world.pid, self.n)  # its ranks are gone: their segments now, not in a minute
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
        shm.remove_orphaned()  # the killed ranks' MPICH segments (of this and earlier worlds) in /dev/shm


def _running(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
