"""Running cells on the session's world: a ``%%hvd`` cell with its ``hvd.elastic`` resets, the replay of the
recorded cells on a new world, and a measured run of a sweep's point. Each run is a ``cell.RunningCell``;
the session holds the lock and the cluster's lifecycle, this class what happens between a cell's start and
its end."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..cluster.launching.cluster import MPICluster
from ..cluster.launching.resets import ResetsUsedUp, run_with_resets
from ..config import PREFIX, ClusterOptions, DashboardMode
from ..dashboard import Dashboard, resolve_mode
from . import failures
from .cell import RankValue, RunningCell
from .failures import HvdError, RankDied
from .panel import ActivityState, PanelLink
from .recovery import ElasticCommits, RecordedCell, replay
from .suspending import keep_record


class Host(Protocol):
    """What the runner needs of the session that holds it (``session.Session``)."""

    history: list[RecordedCell]  # the cells a replay runs
    options: ClusterOptions | None  # of the last start (its ``max_resets``)
    commits: ElasticCommits  # rank 0's last hvd.elastic commit
    panel: PanelLink  # what JupyterLab's panel sees

    def require(self) -> MPICluster: ...

    def restart_held(self) -> Any: ...

    def lose_cluster(self) -> None: ...


@dataclass
class _Runs:
    """What the runs of one cell share: the dashboard (a cell resumed after dead ranks goes on with it), and
    rank 0's last ``hvd.elastic`` commit in any of them (its summary; None: none, or its run returned)."""

    dashboard: Dashboard | None = None
    commit: str | None = None


class CellRunner:
    """Runs cells on the world of ``session`` (whose lock its callers hold).

    Args:
        session: the session whose world runs the cells.
    """

    def __init__(self, session: Host) -> None:
        self.session = session
        self._engine_progress: tuple[int, bool] | None = None  # (id of the world's channel, progress on)

    def run(self, code: str, ranks: list[int] | None, output_ranks: list[int] | None, timeout: float | None,
            progress: str | None, record: bool) -> RankValue | None:
        """A ``%%hvd`` cell (``Session.run_cell`` says what the arguments mean); where its ranks die in an
        ``hvd.elastic.run`` that committed since the cell began, the cell again on a new world (``_reset``),
        which resumes from the commit, up to ``--max-resets`` times (``resets.run_with_resets``, the loop
        ``hvd-notebook run`` runs too). Every run of the cell draws on one dashboard.

        Raises:
            HvdError: ``progress`` names no dashboard mode; the cell failed (``RankError``, ``CellTimeout``), or
                its ranks died (``RankDied``, with the resets made where they were used up).
        """
        try:
            mode = resolve_mode(progress)
        except ValueError as exc:
            raise HvdError(str(exc)) from None
        runs = _Runs()
        try:
            return run_with_resets(
                lambda: self._once(code, ranks, output_ranks, timeout, mode, runs, record),
                lambda failure: isinstance(failure, RankDied) and runs.commit is not None,
                lambda died, number: self._reset(died, number, runs), self._max_resets())
        except ResetsUsedUp as used_up:
            self._cell_ended(runs)
            died = used_up.failure
            raise RankDied(f"{died}\nThe cell was resumed {len(used_up.lines)} time(s) already, as many as "
                           f"--max-resets {self._max_resets()} allows:\n" + "\n".join(used_up.lines),
                           getattr(died, "died", {})) from None
        except BaseException:  # (a failed reset too)
            self._cell_ended(runs)
            raise

    def replay(self, say: Callable[[str], None], cells: list[RecordedCell] | None = None) -> int:
        """The recorded cells again (or ``cells``, those of them a resume replays), each once, as it was recorded,
        quietly (no resets, no change to the node's card); the number replayed. A cell that fails stops it with an
        error naming the cell.

        Args:
            say: shows a line per cell.
            cells: the cells to replay; None: every recorded cell.
        """
        def run(recorded: RecordedCell) -> None:
            self._once(recorded.code, recorded.ranks, [], recorded.timeout, DashboardMode.NONE)

        return replay(list(self.session.history if cells is None else cells), run, say)

    def replay_all(self, say: Callable[[str], None]) -> int:
        """``replay`` for ``%hvd restart --replay``; where it fails, no later cell resumes from the last commit.

        Args:
            say: shows a line per cell.
        """
        try:
            return self.replay(say)
        except BaseException:
            self.session.commits.forget()
            raise

    def measured(self, code: str, dashboard: Dashboard, timeout: float | None) -> None:
        """``code`` once on every rank with its progress into ``dashboard`` (a sweep's point): no rank's output
        shown, not recorded, not resumed; its failure raised.

        Args:
            code: the point's code.
            dashboard: the point's dashboard.
            timeout: seconds before the point fails, or None.
        """
        self._once(code, None, [], timeout, dashboard.mode, _Runs(dashboard))

    def _cell_ended(self, runs: _Runs) -> None:
        """A cell failed: its dashboard's summary, and no later cell may resume from its commit."""
        if runs.dashboard is not None:
            runs.dashboard.finish()  # (a run's own failures finish it already; ranks that died do not)
        self.session.commits.forget()

    def _once(self, code: str, ranks: list[int] | None, output_ranks: list[int] | None, timeout: float | None,
              mode: DashboardMode, runs: _Runs | None = None, record: bool = False) -> RankValue | None:
        """One run of a cell on the world of now: rank 0's value; ``RankDied`` where ranks died. ``runs``: the
        dashboard earlier runs of the same cell drew on; ``record``: a run that completes is recorded for
        ``replay``."""
        session = self.session
        cluster = session.require()
        all_ranks = [r.rank for r in cluster.ranks]
        ranks = all_ranks if ranks is None else ranks  # (a resumed cell may have fewer ranks: None is all)
        unknown = sorted(set(ranks) - set(all_ranks)) + sorted(set(output_ranks or []) - set(all_ranks))
        if unknown:
            raise failures.unknown_ranks(unknown, len(all_ranks))
        dead = [r for r, ok in cluster.alive().items() if not ok]
        if dead:
            raise failures.dead_before_cell(dead)
        show = set(ranks[:1] if 0 not in ranks else [0]) if output_ranks is None else set(output_ranks)
        self._set_engine_progress(mode != DashboardMode.NONE)
        running = RunningCell(cluster, code, ranks, show, timeout, mode, runs.dashboard if runs else None,
                              said=self.session.panel.now)
        if runs is not None:
            runs.dashboard = running.dashboard
        try:
            value = running.wait()
        finally:
            if runs is not None and running.commits:  # a commit in this cell; the events can be a step behind
                # the one on disk (rank 0 ended before its last event left), which is what a new world resumes from
                runs.commit = running.commits[-1] and (session.commits.summary() or running.commits[-1]) or None
            if running.cluster_lost:
                session.lose_cluster()
        if record:
            session.history.append(RecordedCell(code, None if ranks == all_ranks else list(ranks), timeout))
            keep_record(cluster, session.options, session.history)  # (a --keep cluster: the reaper's record)
        return value

    def _max_resets(self) -> int:
        """How often one cell under ``hvd.elastic.run`` is resumed after dead ranks (``--max-resets``)."""
        return self.session.options.max_resets if self.session.options is not None else 0

    def _reset(self, died: BaseException, reset: int, runs: _Runs) -> str:
        """After a dead rank, in a cell under ``hvd.elastic.run`` that committed: a new world, the set-up cells
        replayed, the event on the cell's dashboard; the loop then runs the cell again, whose
        ``hvd.elastic.run`` resumes from the commit. A line on this reset, for the history."""
        assert isinstance(died, RankDied)  # (the only failure the loop resets after)
        commit, dashboard = runs.commit, runs.dashboard
        first = str(died).splitlines()[0]
        print(f"{PREFIX} {first}\n{PREFIX} hvd.elastic: restarting the world, replaying the set-up "
              f"cells and resuming from the last commit ({commit}): reset {reset} of {self._max_resets()}.",
              file=sys.stderr, flush=True)
        try:
            self.session.panel.now(ActivityState.RESETTING, f"{first}; reset {reset} of {self._max_resets()}")
            self.session.restart_held()
            self.session.panel.now(ActivityState.RESETTING, f"{first}; reset {reset} of {self._max_resets()}")
            self.replay(say=lambda line: print(f"{PREFIX} {line}", file=sys.stderr, flush=True))
        except HvdError as exc:
            raise RankDied(f"{died}\nThe hvd.elastic resume failed: {exc}", died.died) from None
        self.session.panel.now(ActivityState.RUNNING)
        if dashboard is not None:
            dashboard.reset(died.died, commit, [r.rank for r in self.session.require().ranks])
        how = "; ".join(f"rank {r}: {how or 'ended'}" for r, how in sorted(died.died.items()))
        return f"  reset {reset}: {how}; resumed from the last commit ({commit})"

    def _set_engine_progress(self, enabled: bool) -> None:
        """Turn the ranks' progress callback on or off (``%%hvd --no-progress``) when it changes; queued ahead
        of the cell on each engine, so no round trip."""
        channel = self.session.require().channel
        known = self._engine_progress
        current = known[1] if known and known[0] == id(channel) else True  # fresh engines start with it on
        if enabled != current:
            from ..engine import reporter

            channel.apply(reporter.set_enabled, enabled)
        self._engine_progress = (id(channel), enabled)
