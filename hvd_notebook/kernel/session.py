"""One session per notebook kernel: owns the cluster, runs ``%%hvd`` cells on
the ranks (``cell.RunningCell``), and copies variables to and from them."""

from __future__ import annotations

import atexit
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from ..cluster import ClusterError, ClusterOptions
from ..cluster.launching.cluster import MPICluster
from ..cluster.launching.world import RankInfo
from ..config import PREFIX, DashboardMode
from ..dashboard import Dashboard
from ..messages import RankStatus
from ..private import UnsafePathError
from . import failures, sweep, transfers
from .cell import RankValue
from .failures import CellTimeout, HvdError, NoClusterError, RankDied, RankError
from .panel import PanelLink
from .recovery import ElasticCommits, RecordedCell
from .runner import CellRunner
from .suspending import Suspension
from .tenancy import Tenancy, released_message

__all__ = ["CellTimeout", "HvdError", "NoClusterError", "RankDied", "RankError", "RankValue", "RecordedCell",
           "Session"]

log = logging.getLogger(__name__)


class Session:
    """The notebook kernel's view of its cluster. Get it with ``Session.get()``."""

    _instance: Session | None = None

    def __init__(self) -> None:
        self.cluster: MPICluster | None = None
        self.options: ClusterOptions | None = None
        self.history: list[RecordedCell] = []  # what a replay runs on a new world (``replay``)
        self.runner = CellRunner(self)  # runs the cells, their resets and replays
        self.commits = ElasticCommits()  # rank 0's last hvd.elastic commit: a cell resumes from it
        self.tenancy = Tenancy(self._release)  # the node's card of the cluster; stops it when its time is up
        self.released: str | None = None  # why the cluster was stopped (the rules, the panel), for the next command
        self.panel = PanelLink(self)  # what JupyterLab's panel sees and asks
        self.failed_ranks: list[int] = []  # the ranks that raised in the last cell that failed (%hvd debug)
        self.suspension = Suspension(self)  # %hvd suspend, and the resume at the next %%hvd cell
        self._lock = threading.RLock()  # held by every command that uses the cluster (``in_use``)
        atexit.register(self.shutdown)

    @classmethod
    def get(cls) -> Session:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    # ------------------------------------------------------------- lifecycle
    def start(self, options: ClusterOptions, restart: bool = False) -> list[RankInfo]:
        """Start a cluster (replacing a running one with ``restart``); its ranks."""
        if self.cluster is not None:
            if not restart:
                raise failures.already_running(self.cluster.n)
            self.stop()
        self.commits.forget()  # (a fresh start: nothing before it is resumed)
        try:
            cluster = MPICluster(replace(options, env=(*options.env, self.commits.environment())))
            cluster.start()
        except (ClusterError, UnsafePathError) as exc:  # (no private folder could be had)
            raise HvdError(f"The cluster did not start: {exc}") from None
        self.cluster, self.options, self.history, self.released = cluster, options, [], None
        self.failed_ranks = []
        self._announce(cluster)
        return cluster.ranks

    def _announce(self, cluster: MPICluster, restarted: bool = False) -> None:
        """The node's card of the cluster (a restart keeps the start time its lease counts from)."""
        self.tenancy.begin(cluster.workdir, cluster.n, cluster.gpus, cluster.rules, keep_start=restarted)
        self.panel.begin(cluster)

    @contextmanager
    def in_use(self, wait: bool = True) -> Iterator[bool]:
        """Hold the cluster for a command: the release watch waits until it ends. ``wait=False``: only where
        nothing holds it now; yields whether it is held."""
        held = self._lock.acquire(blocking=wait)
        try:
            yield held
        finally:
            if held:
                self._lock.release()

    def _release(self, why: str) -> bool:
        """The node's rules stop the cluster (from the watch's thread): False where it is in use."""
        with self.in_use(wait=False) as held:
            if not held or self.cluster is None or self.suspension.on_idle(why):  # (suspended, where the rules say)
                return not held
            gpus = list(self.cluster.gpus)
            self.stop()
            self.released = released_message(why, time.time(), gpus)
            log.warning("hvd cluster stopped by the node's rules: %s", why)
            return True

    def restart(self) -> list[RankInfo]:
        """Start again with the options of the last start (the recorded cells are kept for ``replay``)."""
        with self.in_use():
            return self.restart_held()

    def restart_held(self) -> list[RankInfo]:
        """``restart`` for a caller that holds the cluster already (``in_use``): a reset within a cell."""
        if self.options is None:
            raise HvdError("Nothing to restart: no cluster was started in this kernel. Run %hvd start.")
        history = self.history
        if self.cluster is None:  # lost (a restart after an interrupt failed), or released: start afresh
            ranks = self.start(self.options)
        else:
            try:
                ranks = self.cluster.restart()  # promotes its warm standby where it has one
            except ClusterError as exc:
                self.cluster = None
                self.tenancy.end()
                raise HvdError(f"The cluster did not restart: {exc}") from None
            self._announce(self.cluster, restarted=True)
        self.history = history
        return ranks

    def replay(self, say: Callable[[str], None] = print) -> int:
        """Run the recorded cells again, in order, on the ranks of now (after a restart, which lost every rank's
        variables): quietly, a line each through ``say``; a cell that fails stops it. The number replayed."""
        with self.in_use():
            self.require()
            return self.runner.replay_all(say)

    def fresh_world(self, n: int, keep: bool = False) -> list[RankInfo]:
        """A fresh world of ``n`` ranks with the recorded set-up cells replayed on it (``sweep.fresh_world``)."""
        return sweep.fresh_world(self, n, keep)

    def lose_cluster(self) -> None:
        """The cluster's world is gone and could not be restarted (after an interrupt): forget it."""
        self.cluster = None
        self.tenancy.end()

    def stop(self) -> bool:
        """Stop the cluster; False when none was running."""
        cluster, self.cluster = self.cluster, None
        self.released = None
        if cluster is None:
            return False
        try:
            cluster.stop()
        finally:
            self.tenancy.end()
            self.panel.end()
        return True

    def shutdown(self) -> None:
        """atexit: the kernel is going away; leave nothing behind."""
        try:
            self.suspension.on_kernel_end() or self.stop()  # (a cluster started with --keep is suspended)
        except Exception:  # never let clean-up raise at interpreter exit
            log.exception("stopping the hvd cluster at exit failed")
        self.commits.remove()
        self.panel.close()

    def require(self) -> MPICluster:
        """The running cluster, or NoClusterError."""
        if self.cluster is None:
            raise self.suspension.no_cluster(self.released)
        return self.cluster

    # ----------------------------------------------------------------- cells
    def run_cell(
        self,
        code: str,
        ranks: list[int] | None = None,
        output_ranks: list[int] | None = None,
        timeout: float | None = None,
        progress: str | None = DashboardMode.AUTO,
        record: bool = True,
    ) -> RankValue | None:
        """Run ``code`` on the ranks at once, streaming output; rank 0's value of the last expression (``busy``).

        Args:
            code: the cell's code.
            ranks: the ranks that run it; None for all.
            output_ranks: the ranks whose output is shown; None for all.
            timeout: seconds before the cell fails, or None.
            progress: the dashboard's mode (``config.DashboardMode``).
            record: ``replay`` runs the cell again once it completed (``%%hvd --no-replay``: False).
        """
        with self.busy():
            try:
                return self.runner.run(code, ranks, output_ranks, timeout, progress, record)
            except RankError as exc:
                self.failed_ranks = exc.ranks
                raise

    @contextmanager
    def busy(self) -> Iterator[MPICluster]:
        """Hold the running cluster for a cell (or a sweep): the node's card says it is busy meanwhile;
        where its lease ran out, it stops after."""
        with self.in_use():
            self.suspension.resume_pending(say=print)  # (this kernel's suspended cluster comes back first)
            cluster = self.require()
            self.tenancy.cell(busy=True)
            self.panel.cell_starts()
            try:
                yield cluster
            finally:
                self.tenancy.cell(busy=False)
                self.panel.cell_ends()
                why = self.tenancy.due()
                if why is not None and self._release(why):
                    print(f"{PREFIX} {self.released or self.suspension.note}", file=sys.stderr, flush=True)

    def run_measured(self, code: str, dashboard: Dashboard, timeout: float | None = None) -> None:
        """Run ``code`` once on every rank with its progress into ``dashboard`` (a point of a ``%%hvd
        sweep``): no rank's output shown, not recorded for replay, not resumed; its failure raised."""
        with self.in_use():
            self.runner.measured(code, dashboard, timeout)

    # ------------------------------------------------------------- transfers
    def pull(self, name: str, rank: int = 0) -> Any:
        """The value of ``name`` on ``rank`` (``transfers.pull``)."""
        return transfers.pull(self.require(), name, rank)

    def push(self, name: str, value: Any) -> None:
        """Set ``name`` to ``value`` on every rank (``transfers.push``)."""
        transfers.push(self.require(), name, value)

    def status(self) -> list[RankStatus]:
        """One row per rank (``transfers.status``)."""
        return transfers.status(self.require())
