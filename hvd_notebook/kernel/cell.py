"""One ``%%hvd`` cell in flight: its request to the ranks (the rank channel's ``CellRequest``), its deadline
and its dashboard; how it ends (a value, or an error of ``failures``) and how it stops ranks that are still
running. Its output goes through ``forwarding.CellOutput``, its ranks' events through ``cell_events``."""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..cluster import ClusterError
from ..cluster.launching.channel import ControllerSilent
from ..cluster.launching.cluster import MPICluster
from ..cluster.launching.replies import RankReply
from ..cluster.processes import stacks
from ..cluster.processes.workdir import ActivityState
from ..config import DashboardMode
from ..dashboard import Dashboard
from ..engine import breakpoints
from . import failures
from .cell_events import CellEvents
from .forwarding import CellOutput
from .signals import interrupts_as_a_flag

log = logging.getLogger(__name__)

POLL_S = 0.02  # how often a running cell's output is forwarded (results wake the loop at once)
LIVENESS_S = 0.5  # how often a running cell checks that its ranks' processes exist
INTERRUPT_GRACE_S = 3.0  # how long interrupted ranks get before the MPI world is restarted
DEATH_REPORT_S = 3.0  # how long to wait for mpiexec to report how dead ranks ended
SIMULTANEOUS_FAILURE_S = 0.2  # near-simultaneous failures on other ranks arrive within this
WHEREABOUTS_S = 1.0  # how long ranks get to write their stacks (a live rank's faulthandler answers at once)
OUTPUT_LAG_S = 5.0  # how long a finished cell waits for output that its results overtook


@dataclass
class RankValue:
    """The value of a cell's last expression on rank 0, shown like a normal cell's.

    Args:
        data: its representations by MIME type.
        metadata: their metadata.
    """

    data: dict[str, Any]
    metadata: dict[str, Any]

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> tuple[dict, dict]:
        return self.data, self.metadata

    def __repr__(self) -> str:
        return str(self.data.get("text/plain", ""))


class RankStopper:
    """Stops the ranks of a cell that still run: says where each is, interrupts them, and where they do not
    answer restarts the world (``cluster_lost`` where that failed); renews the collectives after a debugged
    rank quit.

    Args:
        cluster: the cluster whose ranks they are.
        still_running: whether a rank's part of the cell still runs (where the controller does not answer).
    """

    def __init__(self, cluster: MPICluster, still_running: Callable[[int], bool]) -> None:
        self.cluster, self.still_running = cluster, still_running
        self.cluster_lost = False  # the MPI world could not be restarted after an interrupt

    def interrupt(self, ranks: list[int]) -> str:
        """Interrupt ranks; a rank stuck in an MPI collective ignores SIGINT, so
        after a grace period restart the whole MPI world. Returns a note.

        Args:
            ranks: the ranks to interrupt.
        """
        if not ranks:
            return ""
        channel = self.cluster.channel
        try:  # (through the controller, which may not answer: then the world is restarted)
            channel.interrupt(ranks)
        except ClusterError:
            log.debug("the interrupt failed", exc_info=True)
        deadline = time.monotonic() + INTERRUPT_GRACE_S
        hub_answers = True
        while True:
            if hub_answers:
                try:
                    stuck = [rank for rank, busy in channel.busy(ranks).items() if busy]
                except ControllerSilent:  # (its hub; the requests and signals may still pass: they go another way)
                    hub_answers = False
            if not hub_answers:  # (then whether this cell's own requests came back decides)
                stuck = [rank for rank in ranks if self.still_running(rank)]
            if not stuck:
                return ""
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        why = failures.IGNORED_INTERRUPT if hub_answers else failures.SILENT_CONTROLLER
        try:
            self.cluster.restart()
        except ClusterError as exc:
            self.cluster_lost = True
            return failures.unresponsive(stuck, str(exc), why)
        return failures.unresponsive(stuck, why=why)

    def renew(self, ranks: list[int]) -> str:
        """After a debugged rank quit, where a rank was left half-way in a collective (interrupted while it
        waited for the quitting rank): fresh collectives on every rank, variables kept. A note for the user
        ("" where none was needed).

        Args:
            ranks: the ranks of the cell.
        """
        channel = self.cluster.channel
        try:
            if not any(channel.call_all(breakpoints.broken, ranks=ranks, timeout=10)):
                return ""
            channel.call_all(breakpoints.renew, timeout=60)
        except Exception as exc:
            return failures.not_renewed(f"{getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', exc)}")
        return failures.RENEWED

    def whereabouts(self, ranks: list[int]) -> dict[int, str]:
        """Where each of ``ranks`` on this host is now, a line each (``stacks.where`` of its Python stack;
        a signal and a file read per rank): rank -> line, without the ranks that did not answer.

        Args:
            ranks: the ranks to ask.
        """
        pids = {r.pid: r.rank for r in self.cluster.ranks if r.rank in ranks and r.here}
        if not pids:
            return {}
        try:
            dumps = stacks.collect(list(pids), timeout=WHEREABOUTS_S)
        except OSError:
            return {}
        return {pids[pid]: stacks.where(dump) for pid, (_, dump) in dumps.items() if dump.strip()}


class RunningCell:
    """A cell sent to ``ranks``; ``wait()`` forwards its output and ends it.

    Args:
        cluster: the cluster whose ranks run it.
        code: the cell's code.
        ranks: the ranks it runs on.
        show: the ranks whose output the notebook shows.
        timeout: seconds it may run (None: no limit; time in a rank's debugger does not count).
        mode: the dashboard's mode.
        dashboard: the dashboard of the cell's first run, where this is a resumed cell.
        said: what the cell does now, for JupyterLab's panel (``panel.PanelLink.now``).

    >>> cell = RunningCell(cluster, "print(hvd.rank())", [0, 1], show={0}, timeout=None, mode=DashboardMode.TEXT)
    >>> value = cell.wait()
    """

    def __init__(self, cluster: MPICluster, code: str, ranks: list[int], show: set[int], timeout: float | None,
                 mode: DashboardMode, dashboard: Dashboard | None = None,
                 said: Callable[[ActivityState, str], None] = lambda state, detail: None) -> None:
        self.cluster, self.ranks, self.timeout = cluster, ranks, timeout
        self.said = said
        self.deadline = None if timeout is None else time.monotonic() + timeout
        # (a cell resumed after dead ranks goes on with the dashboard of its first run)
        self.dashboard = dashboard or (Dashboard(mode, ranks, shown=show) if mode != DashboardMode.NONE else None)
        self.request = cluster.channel.execute(code, ranks)
        self.finished_at: dict[int, float] = {}  # per rank: when the cell first saw it finished
        self.stopper = RankStopper(cluster, lambda rank: not self.request.done(rank))
        self.output = CellOutput(ranks, show, self.dashboard)
        self.events = CellEvents(cluster, said, self.stopper.whereabouts)

    @property
    def commits(self) -> list[str]:
        """Rank 0's hvd.elastic commit events, in order ("": the commit was removed)."""
        return self.events.commits

    @property
    def quit(self) -> list[int]:
        """The ranks whose debugger was quit (q): the cell ends on every rank."""
        return self.events.quit

    def wait(self) -> RankValue | None:
        """Forward output until every rank finished (rank 0's value) or one failed (an error). After
        ``RankDied`` the dashboard stays live: the session may resume the cell on it."""
        died = False
        try:
            with interrupts_as_a_flag() as interrupted:  # (also while interrupted ranks are being stopped)
                try:
                    failed = self._watch(interrupted)
                except KeyboardInterrupt:
                    print(failures.interrupted(*self._stop_running()), file=sys.stderr)
                    raise
            if failed:
                self._fail(failed)
            self.request.await_output(OUTPUT_LAG_S)
            self.pump(final=True)
        except failures.RankDied:
            died = True
            raise
        finally:
            if self.dashboard is not None and not died:
                self.dashboard.finish()
        result = self.request.reply(0).result if 0 in self.ranks else None
        return RankValue(result["data"], result.get("metadata", {})) if result else None

    def pump(self, final: bool = False) -> None:
        """Forward new output, events, progress and rich displays; ``final`` also forwards unfinished lines.
        (The lines first: what was printed before the dashboard or the output tabs appear stays above them.)

        Args:
            final: also forward unfinished lines (the cell ended).
        """
        replies = self.request.replies()
        self.output.lines(replies, final)
        self.events.take(replies, self.output.tabs)
        self.output.progress(replies, final)
        self.output.displays(replies)

    def _watch(self, interrupted: threading.Event) -> list[RankReply]:
        """Forward output until every rank is done (returns []) or some failed (returns their replies, first
        failure first); raises when ranks die or time runs out, and KeyboardInterrupt once ``interrupted`` is
        set."""
        next_liveness_check = time.monotonic() + LIVENESS_S
        while True:
            if interrupted.is_set():
                raise KeyboardInterrupt
            self.request.wait_any(POLL_S)  # wakes as soon as a rank finishes, else after POLL_S to stream output
            # one look at which ranks finished, each with its error: a rank that fails after it (while the output
            # is forwarded) is seen on the next round
            finished = [reply for reply in self.request.replies() if reply.done]
            now = time.monotonic()
            for reply in finished:
                self.finished_at.setdefault(reply.rank, now)
            failed = sorted((r for r in finished if r.error is not None), key=lambda r: self.finished_at[r.rank])
            self.pump()
            if failed or len(finished) == len(self.ranks):
                return failed
            if time.monotonic() > next_liveness_check:
                next_liveness_check = time.monotonic() + LIVENESS_S
                self._check_liveness()
            if self.deadline is not None and time.monotonic() > self.deadline + self.events.debugged_s:
                raise failures.cell_timeout(self.timeout or 0.0, *self._stop_running())

    def _check_liveness(self) -> None:
        """Raise where a rank's process is gone, or the controller's schedulers are."""
        dead = [r for r, ok in self.cluster.alive().items() if not ok and r in self.ranks]
        if dead:
            raise self._ranks_died(dead)
        if not self.cluster.channel.routes():
            raise self._controller_gone()

    def _fail(self, failed: list[RankReply]) -> None:
        """Raise the error of a cell that failed on the ranks of ``failed``."""
        if self.dashboard is not None:
            for reply in failed:
                self.dashboard.fail(reply.rank, failures.describe(reply.error), reply.error.traceback)
        died = [reply.rank for reply in failed if reply.error.engine_died]
        if died:
            # MPI ends the other ranks when one dies: name the one(s) that died first
            first = self.finished_at[died[0]]
            raise self._ranks_died([rank for rank in died if self.finished_at[rank] == first])
        if self.quit and any(reply.error.ename == "BdbQuit" for reply in failed):
            running, where, note = self._stop_running(wait_for_output_s=1.0)
            raise failures.debugger_quit(self.quit[0], running, where, note or self.stopper.renew(self.ranks))
        time.sleep(SIMULTANEOUS_FAILURE_S)
        errors = {reply.rank: reply.error for reply in self.request.replies()}
        raise failures.rank_error(errors, failed[0].rank, *self._stop_running(wait_for_output_s=1.0))

    @property
    def cluster_lost(self) -> bool:
        """The MPI world could not be restarted after an interrupt: the cluster is gone."""
        return self.stopper.cluster_lost

    def _stop_running(self, wait_for_output_s: float = 0.0) -> tuple[list[int], dict[int, str], str]:
        """Stop the ranks still running, then forward the last of the output. Returns those ranks, where
        each was (taken before the interrupt, which moves them) and a note for the user (empty when they
        stopped)."""
        self.events.ending = True
        running = [rank for rank in self.ranks if not self.request.done(rank)]
        where = self.stopper.whereabouts(running)
        note = self.stopper.interrupt(running)
        if wait_for_output_s:
            self.request.await_output(wait_for_output_s)
        self.pump(final=True)
        return running, where, note

    def _controller_gone(self) -> failures.RankDied:
        """The controller's schedulers are gone: no cell or result passes any more, and the engines would shut
        down only once they had missed its heartbeats for half a minute. End the world now and say why."""
        self.events.ending = True
        if self.dashboard is not None:
            for rank in self.ranks:
                self.dashboard.fail(rank, failures.CONTROLLER_GONE)
        self.cluster.end_world()
        self.pump(final=True)
        return failures.controller_gone(list(self.ranks))

    def _ranks_died(self, dead: list[int]) -> failures.RankDied:
        """A rank's process is gone (os._exit, a signal, out of memory): end the
        others too, so that none stays blocked in a collective, and let mpiexec
        report how each one ended."""
        self.events.ending = True
        if self.dashboard is not None:
            for rank in dead:
                self.dashboard.fail(rank, failures.DIED)
        self.cluster.end_world()
        deadline = time.monotonic() + DEATH_REPORT_S
        ended = self.cluster.exit_reports()
        while not all(r in ended for r in dead) and time.monotonic() < deadline:
            time.sleep(0.1)  # mpiexec's last words reach its log a moment after it exits
            ended = self.cluster.exit_reports()
        # what the ranks sent before they ended can arrive after the death was seen (on a loaded machine, rank 0's
        # hvd.elastic commit event did: the cell was then not resumed)
        self.pump(final=True)
        last_lines = []
        for rank in (rank for rank in self.ranks if rank in dead):
            printed = self.request.reply(rank).printed().strip().splitlines()[-5:]
            last_lines += [f"  [{rank}] {line}" for line in printed] or [f"  [{rank}] (nothing)"]
        return failures.ranks_died({r: ended.get(r, "") for r in dead},
                                   others=[rank for rank in self.ranks if rank not in dead],
                                   last_lines=last_lines, mpiexec_tail=self.cluster.mpiexec_output_tail())
