"""One ``%%hvd`` cell in flight: its request on each rank, the output streams
it forwards, its deadline and its dashboard; how it ends (a value, or an error
of ``failures``) and how it stops ranks that are still running."""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

from ..cluster import ClusterError
from ..cluster.launching.channel import ControllerSilent
from ..cluster.launching.cluster import MPICluster
from ..cluster.processes import stacks
from ..cluster.processes.workdir import ActivityState
from ..config import WARNING_PREFIX, DashboardMode
from ..dashboard import Dashboard
from ..engine import breakpoints
from ..messages import EventKind, ProgressUpdate, RankEvent
from . import debugging, failures

log = logging.getLogger(__name__)

POLL_S = 0.02  # how often a running cell's output is forwarded (results wake the loop at once)
LIVENESS_S = 0.5  # how often a running cell checks that its ranks' processes exist
INTERRUPT_GRACE_S = 3.0  # how long interrupted ranks get before the MPI world is restarted
DEATH_REPORT_S = 3.0  # how long to wait for mpiexec to report how dead ranks ended
SIMULTANEOUS_FAILURE_S = 0.2  # near-simultaneous failures on other ranks arrive within this
WHEREABOUTS_S = 1.0  # how long ranks get to write their stacks (a live rank's faulthandler answers at once)


@dataclass
class RankValue:
    """The value of a cell's last expression on rank 0, shown like a normal cell's."""

    data: dict[str, Any]
    metadata: dict[str, Any]

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> tuple[dict, dict]:
        return self.data, self.metadata

    def __repr__(self) -> str:
        return str(self.data.get("text/plain", ""))


class OutputStream:
    """Forwards one rank's accumulated stdout or stderr, a complete line at a time,
    each line prefixed with the rank (unless not ``prefixed``)."""

    def __init__(self, rank: int, name: str, write: Callable[[str], Any], prefixed: bool = True):
        self.prefix = f"[{rank}] " if prefixed else ""
        self.name = name
        self.write = write
        self.sent = 0

    def update(self, text: str, final: bool = False) -> None:
        """Forward what ``text`` (all of it so far) has beyond what was sent; the
        last, unfinished line only when ``final``."""
        if len(text) < self.sent:  # ipyparallel collapsed a '\r' line: resend from its start
            self.sent = text.rfind("\n", 0, len(text)) + 1
        end = len(text) if final else text.rfind("\n") + 1
        if end <= self.sent:
            return
        chunk = text[self.sent:end]
        self.sent = end
        lines = chunk.splitlines(keepends=True)
        text = "".join(self.prefix + line for line in lines)
        self.write(text if text.endswith("\n") else text + "\n")


@dataclass
class RankRequest:
    """One rank's part of a cell: its result and ipyparallel's record of its output.

    ipyparallel drops its client-side records of a request once its output is
    complete; ``metadata`` holds this one's record for as long as the cell needs it.
    """

    rank: int
    result: Any  # this rank's AsyncResult (from AsyncResult.split)
    metadata: dict[str, Any]
    displayed: int = 0  # how many of its rich outputs were shown
    finished_at: float | None = None  # when the cell first saw it finished

    @property
    def done(self) -> bool:
        return self.result.done()

    @property
    def error(self) -> Any:
        """The RemoteError (or EngineError) this rank's request ended with, or None."""
        if not self.result.done():
            return None
        return self.result.exception()

    def printed(self) -> str:
        return (self.metadata["stdout"] or "") + (self.metadata["stderr"] or "")


class RankStopper:
    """Stops the ranks of a cell that still run: says where each is, interrupts them, and where they do not
    answer restarts the world (``cluster_lost`` where that failed); renews the collectives after a debugged
    rank quit."""

    def __init__(self, cluster: MPICluster, still_running: Callable[[int], bool]) -> None:
        self.cluster, self.still_running = cluster, still_running
        self.cluster_lost = False  # the MPI world could not be restarted after an interrupt

    def interrupt(self, ranks: list[int]) -> str:
        """Interrupt ranks; a rank stuck in an MPI collective ignores SIGINT, so
        after a grace period restart the whole MPI world. Returns a note."""
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
        ("" where none was needed)."""
        channel = self.cluster.channel
        try:
            if not any(channel.apply(breakpoints.broken, ranks=ranks).get(timeout=10)):
                return ""
            channel.apply(breakpoints.renew).get(timeout=60)
        except Exception as exc:
            return failures.not_renewed(f"{getattr(exc, 'ename', type(exc).__name__)}: {getattr(exc, 'evalue', exc)}")
        return failures.RENEWED

    def whereabouts(self, ranks: list[int]) -> dict[int, str]:
        """Where each of ``ranks`` on this host is now, a line each (``stacks.where`` of its Python stack;
        a signal and a file read per rank): rank -> line, without the ranks that did not answer."""
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

    >>> cell = RunningCell(cluster, "print(hvd.rank())", [0, 1], show={0}, timeout=None, mode=DashboardMode.TEXT)
    >>> value = cell.wait()
    """

    def __init__(self, cluster: MPICluster, code: str, ranks: list[int], show: set[int], timeout: float | None,
                 mode: DashboardMode, dashboard: Dashboard | None = None,
                 said: Callable[[ActivityState, str], None] = lambda state, detail: None) -> None:
        self.cluster = cluster
        self.said = said  # what the cell does now, for JupyterLab's panel (``panel.PanelLink.now``)
        self._stalled_at: int | None = None  # the ranks' progress count when a stall was told (none since: None)
        self.ranks = ranks
        self.show = show
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        # (a cell resumed after dead ranks goes on with the dashboard of its first run)
        self.dashboard = dashboard or (Dashboard(mode, ranks, shown=show) if mode != DashboardMode.NONE else None)
        self._told: dict[int, int] = {}  # per rank: the seq of the last of its events shown
        self._located: set[int] = set()  # ranks whose whereabouts a stall warning made us show
        self._stops: dict[int, int] = {}  # per rank: the number of its last breakpoint stop taken
        self.ending = False  # the cell is being ended: a rank's breakpoint is not opened any more
        self.quit: list[int] = []  # the ranks whose debugger was quit (q): the cell ends on every rank
        self.commits: list[str] = []  # rank 0's hvd.elastic commit events, in order ("": the commit was removed)
        self.async_result, parts = cluster.channel.execute(code, ranks)
        self.requests = [RankRequest(rank, part, part.metadata) for rank, part in zip(ranks, parts)]
        self.stopper = RankStopper(cluster, lambda rank: not self.requests[self.ranks.index(rank)].done)
        self.streams = [
            (req, OutputStream(req.rank, name, getattr(sys, name).write))
            for req in self.requests if req.rank in show for name in ("stdout", "stderr")
        ]
        board = self.dashboard
        self.copies = [  # every rank's whole output, for its tab under the dashboard (widgets mode)
            (req, OutputStream(req.rank, name, functools.partial(board.output, req.rank, name), prefixed=False))
            for req in self.requests for name in ("stdout", "stderr")
        ] if board is not None and board.records_output else []

    def wait(self) -> RankValue | None:
        """Forward output until every rank finished (rank 0's value) or one failed (an error). After
        ``RankDied`` the dashboard stays live: the session may resume the cell on it."""
        died = False
        try:
            with _interrupts_as_a_flag() as interrupted:  # (also while interrupted ranks are being stopped)
                try:
                    failed = self._watch(interrupted)
                except KeyboardInterrupt:
                    print(failures.interrupted(*self._stop_running()), file=sys.stderr)
                    raise
            if failed:
                self._fail(failed)
            self.async_result.wait_for_output(5.0)  # results can overtake the last lines of output
            self.pump(final=True)
        except failures.RankDied:
            died = True
            raise
        finally:
            if self.dashboard is not None and not died:
                self.dashboard.finish()
        if 0 in self.ranks:
            result = self.requests[self.ranks.index(0)].metadata["execute_result"]
            if result:
                return RankValue(result["data"], result.get("metadata", {}))
        return None

    def pump(self, final: bool = False) -> None:
        """Forward new output, progress and rich displays; ``final`` also forwards unfinished lines. (The
        lines first: what was printed before the dashboard or the output tabs appear stays above them.)"""
        for req, stream in (*self.streams, *self.copies):
            stream.update(req.metadata[stream.name] or "", final)
        self._tell_events()
        if self._stalled_at is not None and _progress_count(self.requests) > self._stalled_at:  # the stall is over
            self._stalled_at = None
            self.said(ActivityState.RUNNING, "")
        if self.dashboard is not None:
            self.dashboard.poll({req.rank: req.metadata["data"] for req in self.requests}, force=final)
        for req in self.requests:
            if req.rank in self.show:
                outputs = req.metadata["outputs"]
                for out in outputs[req.displayed:]:
                    _publish(out)
                req.displayed = len(outputs)

    def _tell_events(self) -> None:
        """The events of every rank (``runtime/core/events.py``) not taken yet: a stall or a warning as a
        warning line of its rank (after a stall, where each rank it names as missing is), an ``hvd.elastic``
        commit into ``commits``, a stop at a breakpoint as pdb on that rank (``_debug``)."""
        board = self.dashboard if self.copies else None
        for req in self.requests:
            data = dict(req.metadata.get("data") or {})
            events = sorted((RankEvent.from_dict(value) for key, value in data.items() if RankEvent.is_key(key)),
                            key=lambda e: e.seq)
            for event in events:
                if event.seq <= self._told.get(req.rank, -1):
                    continue
                self._told[req.rank] = event.seq
                if event.kind == EventKind.COMMIT:
                    self.commits.append(event.text)
                    continue
                if event.kind == EventKind.BREAKPOINT:
                    self.said(ActivityState.BREAKPOINT, event.text)
                    self._debug(req.rank, event)
                    self.said(ActivityState.RUNNING, "")
                    continue
                line = f"{WARNING_PREFIX}: {event.text}\n"
                sys.stderr.write(f"[{req.rank}] {line}")
                if board is not None:
                    board.output(req.rank, "stderr", line)
                if event.kind == EventKind.STALL:
                    self._stalled_at = _progress_count(self.requests)
                    self.said(ActivityState.STALLED, event.text.removeprefix("stall: ").split(". ")[0])
                    self._locate(event.fields.get("missing") or [])
        sys.stderr.flush()

    def _debug(self, rank: int, event: RankEvent) -> None:
        """pdb on ``rank``, stopped at a breakpoint, until it goes on (one rank at a time: a rank stopped
        meanwhile is taken after). The time spent there does not count towards ``--timeout``."""
        stop = int(event.fields.get("stop", 0))
        if stop <= self._stops.get(rank, 0) or self.ending:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        started = time.monotonic()
        self._stops[rank] = stop
        try:
            with _interrupts_raise():  # (the stop button ends the session, as q does)
                quit, self._stops[rank] = debugging.at_breakpoint(self.cluster, rank, stop,
                                                                  str(event.fields.get("where", "?")))
            if quit:
                self.quit.append(rank)
        finally:
            if self.deadline is not None:
                self.deadline += time.monotonic() - started

    def _locate(self, missing: list[int]) -> None:
        """Where each rank a stall names as missing is (once per rank and cell): its Python stack's summary,
        so that the user sees what it does instead."""
        for rank in missing:
            if rank in self._located:
                continue
            self._located.add(int(rank))
            where = self.stopper.whereabouts([int(rank)])
            if where:
                print(f"{WARNING_PREFIX}: stall: {failures.whereabouts(where, verb='is')} "
                      "(all of its stack: %hvd stacks, or hvd-notebook stacks while the cell runs)",
                      file=sys.stderr, flush=True)

    def _watch(self, interrupted: threading.Event) -> list[RankRequest]:
        """Forward output until every rank is done (returns []) or some failed
        (returns them, first failure first); raises when ranks die or time runs out,
        and KeyboardInterrupt once ``interrupted`` is set."""
        next_liveness_check = time.monotonic() + LIVENESS_S
        while True:
            if interrupted.is_set():
                raise KeyboardInterrupt
            pending = [req.result for req in self.requests if not req.done]
            if pending:  # wakes as soon as a rank finishes, else after POLL_S to stream output
                futures_wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
            now = time.monotonic()
            for req in self.requests:
                if req.finished_at is None and req.done:
                    req.finished_at = now
            # one look at which ranks finished: a rank that fails after it (while the output is forwarded) is
            # seen on the next round, never counted as finished without its error
            finished = [req for req in self.requests if req.finished_at is not None]
            failed = sorted((req for req in finished if req.error is not None), key=lambda r: r.finished_at)
            self.pump()
            if failed or len(finished) == len(self.requests):
                return failed
            if time.monotonic() > next_liveness_check:
                next_liveness_check = time.monotonic() + LIVENESS_S
                dead = [r for r, ok in self.cluster.alive().items() if not ok and r in self.ranks]
                if dead:
                    raise self._ranks_died(dead)
                if not self.cluster.channel.routes():
                    raise self._controller_gone()
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise failures.cell_timeout(self.timeout or 0.0, *self._stop_running())

    def _fail(self, failed: list[RankRequest]) -> None:
        """Raise the error of a cell that failed on the ranks ``failed``."""
        if self.dashboard is not None:
            for req in failed:
                self.dashboard.fail(req.rank, failures.describe(req.error), _traceback_text(req.error))
        died = [req for req in failed if failures.is_engine_death(req.error)]
        if died:
            # MPI ends the other ranks when one dies: name the one(s) that died first
            raise self._ranks_died([req.rank for req in died if req.finished_at == died[0].finished_at])
        if self.quit and any(getattr(req.error, "ename", "") == "BdbQuit" for req in failed):
            running, where, note = self._stop_running(wait_for_output_s=1.0)
            raise failures.debugger_quit(self.quit[0], running, where, note or self.stopper.renew(self.ranks))
        time.sleep(SIMULTANEOUS_FAILURE_S)
        raise failures.rank_error({req.rank: req.error for req in self.requests}, failed[0].rank,
                                  *self._stop_running(wait_for_output_s=1.0))

    @property
    def cluster_lost(self) -> bool:
        """The MPI world could not be restarted after an interrupt: the cluster is gone."""
        return self.stopper.cluster_lost

    def _stop_running(self, wait_for_output_s: float = 0.0) -> tuple[list[int], dict[int, str], str]:
        """Stop the ranks still running, then forward the last of the output. Returns those ranks, where
        each was (taken before the interrupt, which moves them) and a note for the user (empty when they
        stopped)."""
        self.ending = True
        running = [req.rank for req in self.requests if not req.done]
        where = self.stopper.whereabouts(running)
        note = self.stopper.interrupt(running)
        if wait_for_output_s:
            self.async_result.wait_for_output(wait_for_output_s)
        self.pump(final=True)
        return running, where, note

    def _controller_gone(self) -> failures.RankDied:
        """The controller's schedulers are gone: no cell or result passes any more, and the engines would shut
        down only once they had missed its heartbeats for half a minute. End the world now and say why."""
        self.ending = True
        ranks = [req.rank for req in self.requests]
        if self.dashboard is not None:
            for rank in ranks:
                self.dashboard.fail(rank, failures.CONTROLLER_GONE)
        self.cluster.end_world()
        self.pump(final=True)
        return failures.controller_gone(ranks)

    def _ranks_died(self, dead: list[int]) -> failures.RankDied:
        """A rank's process is gone (os._exit, a signal, out of memory): end the
        others too, so that none stays blocked in a collective, and let mpiexec
        report how each one ended."""
        self.ending = True
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
        for req in self.requests:
            if req.rank in dead:
                printed = req.printed().strip().splitlines()[-5:]
                last_lines += [f"  [{req.rank}] {line}" for line in printed] or [f"  [{req.rank}] (nothing)"]
        return failures.ranks_died(
            {r: ended.get(r, "") for r in dead}, others=[req.rank for req in self.requests if req.rank not in dead],
            last_lines=last_lines, mpiexec_tail=self.cluster.mpiexec_output_tail())


@contextlib.contextmanager
def _sigint(handler: Any) -> Iterator[None]:
    """SIGINT goes to ``handler`` within; only in the main thread, which signal handlers belong to (a cell run
    elsewhere cannot be interrupted)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def _interrupts_raise() -> contextlib.AbstractContextManager[None]:
    """Within ``_interrupts_as_a_flag``: SIGINT raises KeyboardInterrupt again (where the kernel waits for the
    user's input, which only an exception ends)."""
    return _sigint(signal.default_int_handler)


@contextlib.contextmanager
def _interrupts_as_a_flag() -> Iterator[threading.Event]:
    """While a cell runs, SIGINT (the notebook's stop button) sets an event instead of raising
    KeyboardInterrupt wherever the kernel happens to be: raised inside a finalizer (``__del__`` of a
    zmq or ipyparallel object) it would be printed as "ignored" and lost, and the cell would wait on
    for its blocked ranks. Further interrupts while the ranks are being stopped change nothing."""
    interrupted = threading.Event()
    with _sigint(lambda signum, frame: interrupted.set()):
        yield interrupted


def _traceback_text(error: Any) -> str:
    """A rank's error's traceback as one text, for its output tab."""
    tb = getattr(error, "traceback", None) or ""
    return tb if isinstance(tb, str) else "\n".join(tb)


def _progress_count(requests: list[RankRequest]) -> int:
    """How many progress updates the ranks of ``requests`` have published in their cell."""
    return sum(1 for req in requests for key in (req.metadata.get("data") or {}) if ProgressUpdate.is_key(key))


def _publish(output: dict) -> None:
    from IPython.display import publish_display_data

    publish_display_data(output.get("data", {}), output.get("metadata", {}))
