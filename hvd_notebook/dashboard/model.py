"""What the dashboard shows, computed from the ranks' updates: each rank's
progress, global samples/s, elapsed time and ETA, stragglers, curves of every
metric over steps, one summary row per epoch, and where the recent steps' time
went (``step_breakdown``). Plain Python, no display."""

from __future__ import annotations

import bisect
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..messages import NOISE_SCALE, ProgressUpdate, RankState, RunKind
from .curves import StepValues
from .steps import STEP_WINDOW, StepBreakdown, StepTiming

STRAGGLER_BEHIND = 0.10  # a rank this far behind the median's steps is a straggler
STRAGGLER_MIN_STEPS = 10  # ... once the median has done this many
RATE_WINDOW_S = 2.0  # samples/s over about the last two seconds
MAX_POINTS = 2000  # per curve; older points are thinned beyond this
TIMING = ("time", "samples")  # epoch-log entries that are not metrics
KEPT_STEPS = 4 * STEP_WINDOW  # step times kept per rank


@dataclass
class RankProgress:
    """One rank's latest state in one run."""

    rank: int
    state: RankState = RankState.RUNNING
    epoch: int = 0
    epochs: int | None = 1
    step: int = 0
    steps: int | None = None
    samples: int | None = None
    batch_size: int | None = None  # samples per step, where known
    elapsed: float = 0.0
    logs: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    history: list[tuple[float, float]] = field(default_factory=list)  # (elapsed, samples or steps)
    points: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric -> (step, value)
    recovered: dict[str, StepValues] = field(default_factory=dict)  # metric -> its per-step values (Keras fit)
    first_epoch: int | None = None  # fit's initial_epoch in the run's first update
    step_times: dict[int, tuple[float, float]] = field(default_factory=dict)  # step -> (seconds, in collectives)

    @property
    def done_steps(self) -> int:
        return self.epoch * (self.steps or 0) + self.step

    @property
    def total_steps(self) -> int | None:
        return self.epochs * self.steps if self.epochs and self.steps else None

    @property
    def fraction(self) -> float | None:
        total = self.total_steps
        if self.state == RankState.DONE:
            return 1.0
        return min(1.0, self.done_steps / total) if total else None

    def rate(self) -> float | None:
        """Samples (or steps, where samples are unknown) per second, recently."""
        if not self.history or self.elapsed <= 0:
            return None
        t1, v1 = self.history[-1]
        if self.state == RankState.RUNNING:
            for t0, v0 in reversed(self.history):
                if t1 - t0 >= RATE_WINDOW_S:
                    return (v1 - v0) / (t1 - t0)
        return v1 / t1 if t1 > 0 else None

    def apply(self, update: ProgressUpdate) -> int:
        """Take an update's figures and extend the rate history and the curves; the epochs added to the
        update's: a run resumed after a reset (``fit(initial_epoch=k)`` on a new world) continues the epochs
        of the run it resumes, not from 0.

        Args:
            update: the rank's latest ``ProgressUpdate`` in this run.
        """
        if self.first_epoch is None:
            self.first_epoch = update.first_epoch
        offset = update.first_epoch - self.first_epoch
        for name in ("state", "epoch", "epochs", "step", "steps", "samples", "batch_size", "elapsed"):
            setattr(self, name, getattr(update, name))
        self.epoch += offset
        self.epochs = self.epochs + offset if self.epochs is not None else None
        self.logs = dict(update.logs)
        for index, wall, collective in update.step_times:
            self.step_times[index] = (wall, collective)
        while len(self.step_times) > KEPT_STEPS:
            del self.step_times[next(iter(self.step_times))]
        self.history.append((self.elapsed, float(self.samples if self.samples is not None else self.done_steps)))
        if len(self.history) > 4 * MAX_POINTS:
            del self.history[: len(self.history) // 2]
        if update.kind.has_curves:
            for name, value in self.logs.items():
                if name.startswith("val_"):  # validation metrics exist per epoch only: in the epoch rows
                    continue
                point: float | None = value
                if update.kind.running_means and name != NOISE_SCALE:  # Keras' running means: the steps' own values
                    point = self.recovered.setdefault(name, StepValues()).add(self.epoch, self.step, value)
                if point is not None:
                    self._add_point(name, point)
        return offset

    def restart(self) -> None:
        """The rank's process was replaced: its clock, running means and step numbers start again."""
        self.history.clear()
        self.recovered.clear()
        self.step_times.clear()
        self.state, self.error = RankState.RUNNING, None

    def _add_point(self, metric: str, value: float) -> None:
        points = self.points.setdefault(metric, [])
        x = self.done_steps
        while points and points[-1][0] > x:  # resumed from an earlier commit: the redone steps replace them
            points.pop()
        if points and points[-1][0] == x:
            points[-1] = (x, value)
        else:
            points.append((x, value))
        if len(points) > MAX_POINTS:
            del points[1::2]


@dataclass
class ResetEvent:
    """The world was rebuilt during the cell (an ``hvd.elastic`` resume): when, why, where the training
    stood, and what it resumed from."""

    elapsed: float  # seconds since the cell started
    step: int | None  # the curves' step where the training stood when the rank died
    died: dict[int, str]  # rank -> how it ended ("signal Kill"; "" where unknown)
    stood: dict[int, tuple[int, int | None, int]]  # each dead rank's (epoch, epochs, step) in the current run
    commit: str  # the commit resumed from, in a few words


@dataclass
class Run:
    """One fit/evaluate/predict call (or custom loop) on every rank."""

    kind: RunKind
    ranks: dict[int, RankProgress] = field(default_factory=dict)
    epoch_logs: dict[int, dict[int, dict[str, float]]] = field(default_factory=dict)  # epoch -> rank -> logs

    @property
    def unit(self) -> str:
        return "samples/s" if any(p.samples is not None for p in self.ranks.values()) else "steps/s"

    def mean_logs(self) -> dict[str, float]:
        """Each metric's latest value, averaged over the ranks that have it."""
        names = list(dict.fromkeys(name for p in self.ranks.values() for name in p.logs))
        return {name: statistics.fmean(p.logs[name] for p in self.ranks.values() if name in p.logs)
                for name in names}

    def step_timing(self) -> StepTiming:
        """Its ranks' timed steps and batches (at least one rank)."""
        ranks = self.ranks.items()
        return StepTiming({r: p.step_times for r, p in ranks}, {r: p.batch_size for r, p in ranks})


class ProgressModel:
    """Every rank's progress in a cell, from the updates the ranks publish.

    Args:
        ranks: the ranks that run the cell.
        clock: the clock for rates and times (``time.monotonic``; a test's own).

    Its methods' ``update`` is one rank's ``ProgressUpdate``; ``run`` one of ``runs`` (the latest where None);
    ``metric`` a metric's name; ``rank``, ``message``, ``died``, ``commit`` and ``ranks`` as for ``Dashboard``'s.
    """

    def __init__(self, ranks: list[int], clock: Callable[[], float] = time.monotonic) -> None:
        self.rank_ids = list(ranks)
        self.clock = clock
        self.start = clock()
        self.runs: list[Run] = []
        self._run_of: dict[tuple[int, str], int] = {}  # (rank, run id) -> index in runs
        self.failed: dict[int, str] = {}
        self.finished_at: float | None = None
        self.events: list[ResetEvent] = []

    # -- input
    def feed(self, update: ProgressUpdate) -> None:
        """Take one rank's update; the k-th run of each rank is the same fit/evaluate/predict call."""
        rank = update.rank
        index = self._run_of.get((rank, update.run))
        if index is None:  # this rank's next run
            index = self._run_of[(rank, update.run)] = sum(r == rank for r, _ in self._run_of)
            while len(self.runs) <= index:
                self.runs.append(Run(kind=update.kind))
        run = self.runs[index]
        rank_progress = run.ranks.setdefault(rank, RankProgress(rank))
        offset = rank_progress.apply(update)
        for epoch, logs in update.epoch_logs.items():
            run.epoch_logs.setdefault(epoch + offset, {})[rank] = dict(logs)
        if rank in self.failed:
            rank_progress.state, rank_progress.error = RankState.FAILED, self.failed[rank]

    def fail(self, rank: int, message: str) -> None:
        """A rank's cell failed: its bars turn red and show the error's first line."""
        self.failed[rank] = message
        for run in self.runs[-1:]:
            rank_progress = run.ranks.setdefault(rank, RankProgress(rank))
            rank_progress.state, rank_progress.error = RankState.FAILED, message

    def reset(self, died: dict[int, str], commit: str, ranks: list[int] | None = None) -> ResetEvent:
        """Ranks ``died`` (rank -> how) and a new world (of ``ranks``, where it has fewer) runs the cell
        again from ``commit``: its k-th run continues the k-th run so far (its curves go on from the step
        it resumes at); the event is kept."""
        curve_run, current = self.curve_run, self.current
        steps = [p.done_steps for p in curve_run.ranks.values()] if curve_run else []
        stood = {r: (p.epoch, p.epochs, p.step) for r, p in (current.ranks.items() if current else ()) if r in died}
        event = ResetEvent(self.elapsed(), max(steps) if steps else None, dict(died), stood, commit)
        self.events.append(event)
        self._run_of.clear()
        self.failed.clear()
        if ranks is not None:
            self.rank_ids = list(ranks)
        for run in self.runs:
            run.ranks = {r: p for r, p in run.ranks.items() if r in self.rank_ids}
            for rank_progress in run.ranks.values():
                rank_progress.restart()
        return event

    def finish(self) -> None:
        self.finished_at = self.clock()

    # -- what the views show
    @property
    def current(self) -> Run | None:
        return self.runs[-1] if self.runs else None

    @property
    def curve_run(self) -> Run | None:
        """The latest run with curves (a fit or a custom loop; evaluate/predict have none)."""
        return next((run for run in reversed(self.runs) if run.kind.has_curves), None)

    def run_done(self, run: Run) -> bool:
        """Every rank of the cell has finished this run."""
        return len(run.ranks) >= len(self.rank_ids) and all(p.state == RankState.DONE for p in run.ranks.values())

    def elapsed(self) -> float:
        return (self.finished_at or self.clock()) - self.start

    def rate(self, run: Run | None = None) -> float | None:
        """Samples/s (or steps/s) summed over the ranks."""
        run = run or self.current
        rates = [r for r in (p.rate() for p in run.ranks.values()) if r is not None] if run else []
        return sum(rates) if rates else None

    def eta(self) -> float | None:
        """Seconds until the slowest rank finishes the current run, from its own pace."""
        run = self.current
        if run is None:
            return None
        etas = []
        for rank_progress in run.ranks.values():
            if rank_progress.state.finished:
                continue
            fraction = rank_progress.fraction
            if not fraction:
                return None
            etas.append(rank_progress.elapsed * (1 - fraction) / fraction)
        return max(etas) if etas else 0.0

    def stragglers(self) -> list[int]:
        """Ranks more than 10 % behind the median rank's steps in the current run."""
        run = self.current
        if run is None or len(run.ranks) < 2:
            return []
        done = {r: p.done_steps for r, p in run.ranks.items() if p.state != RankState.FAILED}
        if not done:
            return []
        median = statistics.median(done.values())
        if median < STRAGGLER_MIN_STEPS:
            return []
        return sorted(r for r, d in done.items() if median - d > STRAGGLER_BEHIND * median)

    def epoch_rows(self, run: Run | None = None) -> list[dict[str, float]]:
        """One row per epoch that every rank of the run has finished: the mean
        of each metric over ranks, the slowest rank's time and the summed rate."""
        run = run or self.current
        rows = []
        for epoch in sorted(run.epoch_logs if run else ()):
            per_rank = run.epoch_logs[epoch]
            if not per_rank or len(per_rank) < max(len(run.ranks), len(self.rank_ids)):
                continue
            row: dict[str, float] = {"epoch": epoch + 1}
            row["time"] = max(logs.get("time", 0.0) for logs in per_rank.values())
            samples = [logs.get("samples") for logs in per_rank.values()]
            if all(s is not None for s in samples) and row["time"] > 0:
                row["samples/s"] = sum(samples) / row["time"]  # type: ignore[arg-type]
            for name in (k for k in next(iter(per_rank.values())) if k not in TIMING):
                row[name] = statistics.fmean(logs[name] for logs in per_rank.values() if name in logs)
            rows.append(row)
        return rows

    def metrics(self) -> list[str]:
        """The metrics with curves (of the latest curve run), loss first."""
        run = self.curve_run
        names = dict.fromkeys(name for p in (run.ranks.values() if run else ()) for name in p.points)
        return sorted(names, key=lambda n: (n != "loss", n))

    def epoch_starts(self) -> list[int]:
        """The curves' steps where an epoch after the first began (of the latest curve run), for the
        epochs some rank has reached; none where the steps per epoch are unknown."""
        run = self.curve_run
        starts = {epoch * p.steps for p in (run.ranks.values() if run else ()) if p.steps
                  for epoch in range(1, p.epoch + 1)}
        return sorted(starts)

    def global_batch(self) -> int | None:
        """Samples per step over all ranks of the latest curve run, where every rank tells its batch."""
        run = self.curve_run
        sizes = [p.batch_size for p in (run.ranks.values() if run else ())]
        return sum(sizes) if sizes and None not in sizes else None  # type: ignore[arg-type]

    def noise_scale(self) -> float | None:
        """The latest gradient noise scale of the latest curve run (every rank measures the same)."""
        run = self.curve_run
        values = [p.logs[NOISE_SCALE] for p in (run.ranks.values() if run else ()) if NOISE_SCALE in p.logs]
        return statistics.fmean(values) if values else None

    def step_rate(self) -> float | None:
        """Samples a second of the latest curve run's recent training steps, summed over its ranks, from the
        steps' own times (no validation, no epoch's end, not the first step, which traces): the throughput
        that scaling efficiency compares. None where a rank's steps were not timed or its batch is unknown."""
        run = self.curve_run
        return run.step_timing().rate() if run and run.ranks else None

    def step_breakdown(self) -> StepBreakdown | None:
        """Where the time of the latest curve run's recent steps (the last ``STEP_WINDOW`` that every rank
        timed) went: the share in collectives and the rank the others wait for. None before every rank has
        timed a step, or where no collective time was counted (one rank; a runtime other than hvd's)."""
        run = self.curve_run
        if run is None or not run.ranks or len(run.ranks) < len(self.rank_ids):
            return None
        return run.step_timing().breakdown()

    def curve(self, metric: str) -> tuple[dict[int, tuple[list[int], list[float]]], tuple[list[int], list[float]]]:
        """Each rank's (steps, values) of ``metric`` in the latest curve run, and their mean over ranks at
        every step where each rank has a value at or before it."""
        run = self.curve_run
        per_rank: dict[int, tuple[list[int], list[float]]] = {}
        for r, rank_progress in sorted((run.ranks if run else {}).items()):
            points = rank_progress.points.get(metric, [])
            if points:
                per_rank[r] = ([p[0] for p in points], [p[1] for p in points])
        if not per_rank:
            return {}, ([], [])
        start = max(xs[0] for xs, _ in per_rank.values())
        grid = sorted({x for xs, _ in per_rank.values() for x in xs if x >= start})
        mean_y = [statistics.fmean(ys[max(0, bisect.bisect_right(xs, x) - 1)] for xs, ys in per_rank.values())
                  for x in grid]
        return per_rank, (grid, mean_y)
