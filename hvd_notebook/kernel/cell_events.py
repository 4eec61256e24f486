"""The events a running cell's ranks publish (``runtime/core/events.py``), taken once each: a stall or a warning
as a warning line of its rank, an ``hvd.elastic`` commit noted, a stop at a breakpoint as pdb on that rank."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

from ..cluster.launching.cluster import MPICluster
from ..cluster.launching.replies import RankReply
from ..cluster.processes.workdir import ActivityState
from ..config import WARNING_PREFIX
from ..dashboard import Dashboard
from ..messages import EventKind, RankEvent
from . import debugging, failures
from .forwarding import progress_count
from .signals import interrupts_raise


class CellEvents:
    """Takes the events of a running cell's ranks, each once.

    Args:
        cluster: the cluster the cell runs on (its ranks' debuggers).
        said: what the cell does now, for JupyterLab's panel (``panel.PanelLink.now``).
        whereabouts: where each of some ranks is now (``cell.RankStopper.whereabouts``).
    """

    def __init__(self, cluster: MPICluster, said: Callable[[ActivityState, str], None],
                 whereabouts: Callable[[list[int]], dict[int, str]]) -> None:
        self.cluster, self.said, self.whereabouts = cluster, said, whereabouts
        self.commits: list[str] = []  # rank 0's hvd.elastic commit events, in order ("": the commit was removed)
        self.quit: list[int] = []  # the ranks whose debugger was quit (q): the cell ends on every rank
        self.ending = False  # the cell is being ended: a rank's breakpoint is not opened any more
        self.debugged_s = 0.0  # the time spent in the ranks' debuggers (it does not count towards --timeout)
        self._told: dict[int, int] = {}  # per rank: the seq of the last of its events taken
        self._located: set[int] = set()  # ranks whose whereabouts a stall warning made us show
        self._stops: dict[int, int] = {}  # per rank: the number of its last breakpoint stop taken
        self._stalled_at: int | None = None  # the ranks' progress count when a stall was told (none since: None)

    def take(self, replies: list[RankReply], tabs: Dashboard | None) -> None:
        """The events of ``replies`` not taken yet (warnings also into ``tabs``, the rank's output tab, where
        given); where a stall was told and progress came since, the cell runs again.

        Args:
            replies: each rank's reply so far.
            tabs: the dashboard whose rank tabs get the warnings, or None.
        """
        for reply in replies:
            for event in self._new(reply):
                self._told[reply.rank] = event.seq
                if event.kind == EventKind.COMMIT:
                    self.commits.append(event.text)
                elif event.kind == EventKind.BREAKPOINT:
                    self.said(ActivityState.BREAKPOINT, event.text)
                    self._debug(reply.rank, event)
                    self.said(ActivityState.RUNNING, "")
                else:
                    self._warn(reply.rank, event, replies, tabs)
        sys.stderr.flush()
        if self._stalled_at is not None and progress_count(replies) > self._stalled_at:  # the stall is over
            self._stalled_at = None
            self.said(ActivityState.RUNNING, "")

    def _new(self, reply: RankReply) -> list[RankEvent]:
        """The events of one rank not taken yet, in order."""
        events = sorted((RankEvent.from_dict(value) for key, value in reply.data.items() if RankEvent.is_key(key)),
                        key=lambda e: e.seq)
        return [event for event in events if event.seq > self._told.get(reply.rank, -1)]

    def _warn(self, rank: int, event: RankEvent, replies: list[RankReply], tabs: Dashboard | None) -> None:
        """A warning line of ``rank``; after a stall, where each rank it names as missing is."""
        line = f"{WARNING_PREFIX}: {event.text}\n"
        sys.stderr.write(f"[{rank}] {line}")
        if tabs is not None:
            tabs.output(rank, "stderr", line)
        if event.kind == EventKind.STALL:
            self._stalled_at = progress_count(replies)
            self.said(ActivityState.STALLED, event.text.removeprefix("stall: ").split(". ")[0])
            self._locate(event.fields.get("missing") or [])

    def _debug(self, rank: int, event: RankEvent) -> None:
        """pdb on ``rank``, stopped at a breakpoint, until it goes on (one rank at a time: a rank stopped
        meanwhile is taken after). The time spent there is added to ``debugged_s``."""
        stop = int(event.fields.get("stop", 0))
        if stop <= self._stops.get(rank, 0) or self.ending:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        started = time.monotonic()
        self._stops[rank] = stop
        try:
            with interrupts_raise():  # (the stop button ends the session, as q does)
                quit, self._stops[rank] = debugging.at_breakpoint(self.cluster, rank, stop,
                                                                  str(event.fields.get("where", "?")))
            if quit:
                self.quit.append(rank)
        finally:
            self.debugged_s += time.monotonic() - started

    def _locate(self, missing: list[int]) -> None:
        """Where each rank a stall names as missing is (once per rank and cell): its Python stack's summary,
        so that the user sees what it does instead."""
        for rank in missing:
            if rank in self._located:
                continue
            self._located.add(int(rank))
            where = self.whereabouts([int(rank)])
            if where:
                print(f"{WARNING_PREFIX}: stall: {failures.whereabouts(where, verb='is')} "
                      "(all of its stack: %hvd stacks, or hvd-notebook stacks while the cell runs)",
                      file=sys.stderr, flush=True)
