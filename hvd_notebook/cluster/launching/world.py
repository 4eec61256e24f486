"""One launched world: an ipyparallel controller and one launcher's world of engines (``mpiexec`` or
``srun``), with the cluster directory, the reaper and the PIDs of every process it started.

``MPICluster`` holds the world its cells run on, and, where it keeps one, the warm standby's world; a
restart that promotes the standby is a swap of the two. A world launches, waits for its engines (failing
fast with the launcher's own words: ``diagnosis``), bootstraps or warms them up, says which ranks are
alive and how they ended, and stops: every process of it killed by PID, its directory removed.
"""

from __future__ import annotations

import logging
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...config import ClusterOptions
from ...messages import RankReport
from ..errors import ClusterError
from ..node import shm
from ..processes.pids import PidRegistry, kill_all, pid_alive
from ..processes.reaper import start_reaper
from ..processes.workdir import WorkDir, new_cluster_id
from . import diagnosis
from .channel import RankChannel, without_signing_warning
from .launch import CURVE_ARG, EngineWorld, make_ipp_cluster
from .placements import Placement
from .shape import ClusterShape

log = logging.getLogger(__name__)

STOP_GRACE_S = 0.5  # between SIGTERM and SIGKILL when stopping: nothing of a stopped world is kept
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
    def from_bootstrap(cls, engine_id: int, report: RankReport) -> RankInfo:
        """The rank that ``engine.bootstrap.bootstrap`` described in ``report``, on engine ``engine_id``.

        Args:
            engine_id: the rank's engine.
            report: what its bootstrap reported.
        """
        reported = {k: getattr(report, k) for k in cls.__dataclass_fields__ if k not in ("engine_id", "here")}
        return cls(engine_id=engine_id, here=report.host == socket.gethostname(), **reported)


class LaunchedWorld:
    """A controller and the engines of ``shape`` placed by ``placement``, pinned to its GPUs (one per local rank).

    Args:
        placement: where the ranks go and how they are launched.
        shape: how many ranks, on which GPUs.
        options: the cluster's options (its engines' start timeout, backend, framework).
    """

    def __init__(self, placement: Placement, shape: ClusterShape, options: ClusterOptions) -> None:
        self.placement, self.shape, self.options = placement, shape, options
        self.n, self.gpus = shape.ranks, list(shape.gpus)
        self.ipp_cluster: Any = None
        self._channel: RankChannel | None = None  # every message to the ranks, once launched
        self.workdir: Path | None = None  # the cluster directory while it runs
        self.ranks: list[RankInfo] = []
        self._engines: EngineWorld | None = None
        self._pids = PidRegistry()
        self._warm_pids: set[int] = set()  # the engines of a warm standby (``warm_up``)
        self._reaper: subprocess.Popen | None = None

    # ----------------------------------------------------------------- start
    def start(self, cluster_id: str, deadline: float) -> list[RankInfo]:
        """Launch (in the cluster directory ``cluster_id``), wait for every engine and bootstrap them; the
        ranks. A ClusterError where it fails (its ``mpi_init_failed`` says whether MPI_Init did); nothing of
        the world is left running then."""
        try:
            workdir = self._launch(cluster_id)
            self._bootstrap(self._wait_for_engines(deadline), deadline)
            workdir.make_private()
        except BaseException:
            self.stop()
            raise
        return self.ranks

    def warm_up(self, cancelled: threading.Event) -> None:
        """Bring the world up as a warm standby: controller and engines up, every rank's imports done and
        device pinned, but no runtime initialised, no GPU context and no lease (``engine.bootstrap.warm_up``).
        A ClusterError where it fails or ``cancelled`` is set; nothing of it is left running then."""
        from ...engine.bootstrap import warm_up

        deadline = time.monotonic() + self.options.start_timeout
        try:
            workdir = self._launch(new_cluster_id())
            workdir.mark_standby()
            engine_ids = self._wait_for_engines(deadline, cancelled)
            self._warm_pids = set(on_engines(self.channel, engine_ids, (deadline, self.options.start_timeout),
                                             cancelled, warm_up, self.gpus, self.options.backend,
                                             self.options.framework))
            self._pids.add(*self._warm_pids)
            workdir.make_private()
        except BaseException:
            self.stop()
            raise

    def promote(self) -> None:
        """Finish a warm standby's bootstrap (``hvd.init()`` and what follows it): the world cells run on."""
        WorkDir(self.workdir).mark_standby(False)
        self._bootstrap(sorted(self.channel.registered()), time.monotonic() + self.options.start_timeout)

    def _launch(self, cluster_id: str) -> WorkDir:
        """Make the cluster directory, start the reaper, the controller and the engines (without waiting
        for them); the directory."""
        controller_ip = self.placement.controller_ip()
        self.placement.check_room(self.n)  # (ranks without room in /dev/shm die of SIGBUS)
        workdir = WorkDir.create(cluster_id)
        self.workdir, self._pids.workdir = workdir.path, workdir
        self.ipp_cluster = make_ipp_cluster(self.placement, cluster_id, workdir.profile, self.n, controller_ip)
        self._reaper = start_reaper(workdir)
        with without_signing_warning(encrypted=CURVE_ARG in self.ipp_cluster.controller_args):
            self.ipp_cluster.start_controller_sync()
            self._pids.add(self.ipp_cluster.controller.pid)
            self._channel = RankChannel(self.ipp_cluster.connect_client_sync())
            engine_set = self.ipp_cluster.start_engines_sync(self.n)
        self._engines = EngineWorld(self.ipp_cluster.engines[engine_set])
        self._pids.add(self._engines.pid)
        return workdir

    def _wait_for_engines(self, deadline: float, cancelled: threading.Event | None = None) -> list[int]:
        """Engine ids of the whole world once every rank has registered; a ClusterError saying why as soon
        as the launcher has exited, or at the deadline."""
        engines, shm_checked = self._engines, 0.0
        while len(registered := self.channel.registered()) < self.n:
            if cancelled is not None and cancelled.is_set():
                raise ClusterError("the standby was cancelled")
            if time.monotonic() - shm_checked > SHM_CHECK_S:  # a rank on a planted segment never registers
                self._check_shm()
                shm_checked = time.monotonic()
            code = engines.exit_code()
            if code is not None:
                output = engines.output()
                raise ClusterError(
                    diagnosis.launcher_exited(self.placement.launcher_name, code, self.n, len(registered),
                                              self.placement.diagnose(output), engines.command, output),
                    mpi_init_failed=not registered and diagnosis.mpi_init_failed(output),
                )
            if time.monotonic() > deadline:
                raise ClusterError(diagnosis.engines_late(self.n, len(registered), self.options.start_timeout,
                                                          engines.command, engines.output()))
            time.sleep(0.05)
        self._pids.remember_descendants()
        self.channel.watch_routes(self.ipp_cluster.controller.pid)
        return sorted(registered)

    def _bootstrap(self, engine_ids: list[int], deadline: float) -> None:
        """Run the engine bootstrap on every rank and keep what each reports."""
        from ...engine.bootstrap import bootstrap

        until = (max(deadline, time.monotonic() + 1.0), self.options.start_timeout)
        results = on_engines(self.channel, engine_ids, until, None, bootstrap, self.gpus, self.options.backend,
                             self.ipp_cluster.controller_ip, self.options.framework)
        sizes = sorted({r.size for r in results})
        if sizes != [self.n] or sorted(r.rank for r in results) != list(range(self.n)):
            raise ClusterError(diagnosis.not_one_world(self.n, sizes, self.placement.command))
        self.ranks = sorted(map(RankInfo.from_bootstrap, engine_ids, results), key=lambda r: r.rank)
        self.channel.bind({r.rank: r.engine_id for r in self.ranks})
        self._pids.add(*(r.pid for r in self.ranks if r.here))  # a pid on another host is not ours to kill
        self._check_shm()  # before any cell runs

    def _check_shm(self) -> None:
        """``shm.ShmError`` where a process of the world here has another user's shared memory (or memory
        others may read) open or mapped."""
        shm.check_world(self.launcher_pid, (r.pid for r in self.ranks if r.here), gforker=self.placement.gforker,
                        n=self.n)

    # ----------------------------------------------------------------- state
    @property
    def channel(self) -> RankChannel:
        """Every message to the ranks (a ClusterError before the launch or after the stop)."""
        if self._channel is None:
            raise ClusterError("this world's ranks are not running (not launched yet, or stopped)")
        return self._channel

    @property
    def launcher_pid(self) -> int | None:
        """The launcher's own process (``mpiexec`` or ``srun``), once launched."""
        return self._engines.pid if self._engines is not None else None

    def pids(self) -> set[int]:
        """Every process of the world seen so far (controller, launcher, its helpers, engines and their
        nannies, the reaper)."""
        return self._pids.remember_descendants() | ({self._reaper.pid} if self._reaper is not None else set())

    def engines_whole(self) -> bool:
        """The launcher still runs, every engine is registered, and (for a standby) each is alive."""
        return (self._engines is not None and self._engines.exit_code() is None and self._channel is not None
                and len(self.channel.registered()) == self.n and all(map(pid_alive, self._warm_pids)))

    def alive(self) -> dict[int, bool]:
        """Per rank: is its engine process still there? (On another host: is its engine still registered,
        i.e. answering the controller's heartbeats?)"""
        registered = self._channel.registered() if self._channel is not None else set()
        return {r.rank: pid_alive(r.pid) if r.here else r.engine_id in registered for r in self.ranks}

    def output_tail(self, lines: int = 20) -> str:
        """The last lines the launcher and the engines wrote to the launcher's log."""
        return diagnosis.tail(self._engines.output() if self._engines is not None else "", lines)

    def exit_reports(self) -> dict[int, str]:
        """How each rank ended, where the launcher said so: rank -> "exit code 7" or "signal Kill"."""
        return self.placement.exit_reports(self._engines.output() if self._engines is not None else "")

    # ------------------------------------------------------------------ end
    def end(self, timeout: float = 2.0) -> None:
        """Kill the ranks still alive (an MPI world cannot go on once one of its ranks died) and give the
        launcher a moment to report how each one ended."""
        kill_all({r.pid for r in self.ranks if r.here}, grace=0.0)  # the launcher ends the ranks elsewhere
        if self._engines is not None:
            self._engines.wait(timeout)

    def stop(self) -> None:
        """Kill every process of the world by PID (SIGTERM to all at once, SIGKILL after a short grace:
        ipyparallel's launchers would stop them one after the other, and a kernel shut down by Jupyter is
        soon killed itself), then settle ipyparallel's bookkeeping and remove the cluster directory."""
        pids = self.pids()
        if self._channel is not None:
            try:
                self._channel.close()
            except Exception:
                log.debug("closing the client failed", exc_info=True)
            self._channel = None
        kill_all(pids, grace=STOP_GRACE_S)
        if self.ipp_cluster is not None:
            try:  # its processes are gone: this only settles ipyparallel's bookkeeping
                self.ipp_cluster.stop_cluster_sync()
            except Exception:
                log.debug("ipyparallel's stop failed", exc_info=True)
            self.ipp_cluster = None
        self._pids.clear()
        if self._engines is not None and self.placement.gforker:
            shm.remove_world(self._engines.pid, self.n)  # its ranks are gone: their segments now, not in a minute
        self._engines, self.ranks = None, []
        if self.workdir is not None:
            WorkDir(self.workdir).remove()
            self.workdir = None
        if self._reaper is not None:
            self._reaper.kill()
            self._reaper.wait()
            self._reaper = None




def on_engines(channel: RankChannel, engine_ids: list[int], deadline: tuple[float, float],
               cancelled: threading.Event | None, func: Any, *args: Any) -> list[Any]:
    """``func(*args)`` on each engine (a bootstrap step): their results, or a ClusterError where one fails,
    the ``deadline`` (its time, and the start timeout it came from) passes or ``cancelled`` is set first.

    Args:
        channel: the world's channel.
        engine_ids: the engines to call.
        deadline: (its time, the start timeout it came from).
        cancelled: set to give up early, or None.
        func: the function they run.
        *args: its arguments.
    """
    ar = channel.on_engines(engine_ids, func, *args)
    while not ar.wait(0.1):
        if cancelled is not None and cancelled.is_set():
            raise ClusterError("the standby was cancelled")
        if time.monotonic() > deadline[0]:
            raise ClusterError(diagnosis.setup_late(deadline[1]))
    try:
        return ar.get()
    except Exception as exc:
        raise ClusterError(diagnosis.setup_failed(exc)) from None


class NoWorld:
    """The world of a cluster with none running (before its start, after its stop, between the end of one
    world and the start of the next): no ranks and no processes; every message to the ranks fails with a
    ClusterError that says what to do."""

    ranks: list[RankInfo] = []
    workdir: Path | None = None
    ipp_cluster: Any = None

    @property
    def channel(self) -> RankChannel:
        raise ClusterError("the cluster has no world of ranks running (it was stopped, or a restart failed): "
                           "%hvd restart starts it again")

    def pids(self) -> set[int]:
        return set()

    def alive(self) -> dict[int, bool]:
        return {}

    def output_tail(self, lines: int = 20) -> str:
        return diagnosis.tail("", lines)

    def exit_reports(self) -> dict[int, str]:
        return {}

    def end(self, timeout: float = 2.0) -> None:
        """Nothing runs: nothing to end."""

    def stop(self) -> None:
        """Nothing runs: nothing to stop."""


NO_WORLD = NoWorld()
