"""``%%hvd sweep``: one cell's training code run over a grid of ranks × per-rank batch × learning-rate rule ×
warm-up epochs, each point on a fresh world of its ranks with the set-up cells replayed, measured from the
ranks' own progress (the dashboard's model): samples/s, scaling efficiency against the 1-rank point of the
same per-rank batch, time and steps to a target metric, final metrics, the gradient noise scale, and the share
of each step spent in collectives.

Each point's results are appended to a JSON-lines file as it ends, so a sweep interrupted (or crashed) and
run again starts at the first unfinished point; a point that fails is recorded with its error and the sweep
goes on. The table and the plots (``dashboard/sweep.py``) update while it runs and stay in the notebook.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import operator
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import private
from ..config import PREFIX, DashboardMode
from ..dashboard import Dashboard
from ..dashboard.formatting import headline
from ..dashboard.model import ProgressModel
from ..dashboard.sweep import SweepDisplay
from ..engine.sweep_point import LR_RULES, SweepPoint
from ..messages import NOISE_SCALE
from . import failures
from .failures import HvdError

OK, FAILED = "ok", "failed"
MAX_RESULTS_BYTES = 64 << 20
_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
_TARGET = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(>=|<=|>|<)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")
_NOT_METRICS = ("epoch", "time", "samples/s", NOISE_SCALE)


@dataclass(frozen=True)
class Target:
    """A metric's threshold, ``val_accuracy>=0.95``: the first epoch whose mean over the ranks meets it."""

    metric: str
    op: str
    value: float

    @classmethod
    def parse(cls, text: str) -> Target:
        """A target from ``--target``, such as ``val_accuracy>=0.9``.

        Args:
            text: the option's value.
        """
        match = _TARGET.match(text)
        if not match:
            raise ValueError(f"--target {text!r}: write METRIC>=VALUE, e.g. val_accuracy>=0.95 (or <=, >, <, "
                             "e.g. val_loss<=0.1), with a metric the training logs.")
        return cls(match[1], match[2], float(match[3]))

    def met(self, row: dict[str, float]) -> bool:
        """Whether ``row``'s figures reach the target.

        Args:
            row: a point's figures.
        """
        return self.metric in row and _OPS[self.op](row[self.metric], self.value)

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.value:g}"


@dataclass(frozen=True)
class Grid:
    """The points of a sweep: every combination, ranks outermost (ascending, so that the 1-rank points
    efficiency is measured against come first)."""

    ranks: tuple[int, ...]
    batches: tuple[int, ...]
    lr_rules: tuple[str, ...] = ("none",)
    warmups: tuple[int, ...] = (0,)
    base_batch: int | None = None  # the global batch the base rate is for (default: the smallest of the grid)

    def points(self) -> list[SweepPoint]:
        unknown = [rule for rule in self.lr_rules if rule not in LR_RULES]
        if unknown:
            raise ValueError(f"--lr {','.join(unknown)}: the rules are {', '.join(LR_RULES)}.")
        base = self.base_batch or min(r * b for r in self.ranks for b in self.batches)
        combos = [(r, b, lr, w) for r in sorted(dict.fromkeys(self.ranks)) for b in dict.fromkeys(self.batches)
                  for lr in dict.fromkeys(self.lr_rules) for w in dict.fromkeys(self.warmups)]
        return [SweepPoint(r, b, lr, w, base, i, len(combos)) for i, (r, b, lr, w) in enumerate(combos)]


class ResultsFile:
    """The sweep's JSON-lines file: a line per finished point, appended as it ends. Each line names the
    digest of the cell's code and target, so that a file of another sweep is not taken for this one's.

    Args:
        path: the file.
        digest: ``digest`` of the cell's code and target.
    """

    def __init__(self, path: Path, digest: str) -> None:
        self.path, self.digest = path, digest

    def finished(self) -> dict[str, dict[str, Any]]:
        """The recorded points of this sweep by key (the last line of a point wins); a line cut short by a
        crash is skipped."""
        try:
            text = private.read_text(self.path, max_bytes=MAX_RESULTS_BYTES)
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise HvdError(f"The sweep's results file cannot be read: {exc}. Name another with --results.") from None
        rows: dict[str, dict[str, Any]] = {}
        for line in text.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if not isinstance(row, dict) or "point" not in row:
                continue
            if row.get("code") != self.digest:
                raise HvdError(
                    f"{self.path} holds the results of another sweep (other code or --target): to go on with "
                    "it, run its cell as it was; to start this one, name another file with --results or "
                    "delete this one.")
            rows[row["point"]] = row
        return rows

    def append(self, row: dict[str, Any]) -> None:
        """Add a finished point's line (an ``HvdError`` where the file cannot be written).

        Args:
            row: the point's figures.
        """
        try:
            private.append_text(self.path, (json.dumps(row) + "\n") if row else "")
        except OSError as exc:
            raise HvdError(f"The sweep's results file cannot be written: {exc}. Name another with --results.") from None


def digest(code: str, target: Target | None) -> str:
    """A short hash of the cell's code and target, naming the sweep in its results file.

    Args:
        code: the cell's code.
        target: the sweep's target, or None.
    """
    return hashlib.sha256(f"{code.strip()}\n{target or ''}".encode()).hexdigest()[:16]


def measure(point: SweepPoint, model: ProgressModel, target: Target | None) -> dict[str, Any]:
    """A finished point's figures, from its dashboard's model: samples/s of its training steps, seconds and
    steps to ``target``, the last epoch's metrics, the noise scale, the share of a step in collectives and
    the rank the others waited for.

    Args:
        point: the grid's point.
        model: its dashboard's model.
        target: the sweep's target, or None.
    """
    run = model.curve_run
    if run is None:
        raise HvdError("the cell's code trained nothing the sweep could measure: call fit, or report a custom "
                       "loop's steps with hvd.progress.report")
    rows = model.epoch_rows(run)
    steps = max((p.steps or 0 for p in run.ranks.values()), default=0) or None
    samples_per_s = model.step_rate()
    if samples_per_s is None:  # (steps not timed: the epochs after the first, which traces the step)
        rated = [r for r in rows if "samples/s" in r and r["time"] > 0]
        steady = rated[1:] or rated
        samples_per_s = (sum(r["samples/s"] * r["time"] for r in steady) / sum(r["time"] for r in steady)
                         if steady else model.rate(run))
    breakdown = model.step_breakdown()
    figures: dict[str, Any] = {
        "epochs": len(rows), "steps_per_epoch": steps, "seconds": sum(r["time"] for r in rows) or model.elapsed(),
        "samples_per_s": samples_per_s, "noise_scale": model.noise_scale(),
        "communication": breakdown.fraction if breakdown else None,
        "waited_for": breakdown.waited_for if breakdown else None,
        "metrics": {k: v for k, v in (rows[-1] if rows else run.mean_logs()).items() if k not in _NOT_METRICS},
    }
    if target is not None:
        reached = next((i for i, row in enumerate(rows) if target.met(row)), None)
        figures["seconds_to_target"] = None if reached is None else sum(r["time"] for r in rows[:reached + 1])
        figures["steps_to_target"] = None if reached is None or steps is None else (reached + 1) * steps
    return figures


def efficiency(row: dict[str, Any], rows: list[dict[str, Any]]) -> float | None:
    """``row``'s samples/s over its ranks times the samples/s of the 1-rank point of the same per-rank batch
    (of the same rule and warm-up where there is one).

    Args:
        row: a point's figures.
        rows: every point's figures.
    """
    if row.get("status") != OK or not row.get("samples_per_s"):
        return None
    singles = [r for r in rows if r.get("status") == OK and r["ranks"] == 1 and r["batch"] == row["batch"]
               and r.get("samples_per_s")]
    same = [r for r in singles if (r["lr_rule"], r["warmup"]) == (row["lr_rule"], row["warmup"])]
    base = (same or singles or [None])[0]
    return None if base is None else row["samples_per_s"] / (row["ranks"] * base["samples_per_s"])


class _PointDashboard(Dashboard):
    """The dashboard of one point: its model, drawn as the running row of the sweep's table."""

    def __init__(self, ranks: list[int], show: Callable[[str], None]) -> None:
        super().__init__(DashboardMode.TEXT, ranks)
        self._show = show

    def _make_view(self) -> Any:
        return _RowView(self.model, self._show)


class _RowView:
    """The running point's headline (epoch, samples/s, ETA) in its row of the table."""

    def __init__(self, model: ProgressModel, show: Callable[[str], None]) -> None:
        self.model, self._show = model, show

    def show(self) -> None:
        pass

    def render(self) -> None:
        self._show(headline(self.model))

    def finish(self) -> None:
        pass


def run_sweep(session: Any, code: str, grid: Grid, target: Target | None, path: Path,
              timeout: float | None = None, retry_failed: bool = False,
              display: Callable[..., Any] | None = None) -> list[dict[str, Any]]:
    """Run the points of ``grid`` not yet in ``path`` (and, with ``retry_failed``, those that failed), each on
    a fresh world of its ranks; the sweep's rows, in the grid's order. The world of the sweep's start (as many
    ranks, the set-up cells replayed) is back at the end.

    Args:
        session: the kernel's session.
        code: the cell's code.
        grid: the points to run.
        target: the figure that ends a point, or None.
        path: the results file.
        timeout: seconds per point, or None.
        retry_failed: run again the points that failed.
        display: shows the sweep's table, or None.
    """
    points = grid.points()
    results = ResultsFile(path, digest(code, target))
    keys = {p.key for p in points}
    rows = {key: row for key, row in results.finished().items() if key in keys}
    results.append({})  # (made, or refused, before any point runs)
    view = SweepDisplay(points, target, display)
    view.update(rows)
    todo = [p for p in points if p.key not in rows or (retry_failed and rows[p.key].get("status") != OK)]
    if len(todo) < len(points):
        print(f"{PREFIX} sweep: {len(points) - len(todo)} of {len(points)} point(s) are in {path} already; "
              f"running the other {len(todo)}.", flush=True)
    original = session.require().n
    try:
        for point in todo:
            row = _run_point(session, code, point, target, timeout, lambda p, status: view.update(rows, p, status))
            row["efficiency"] = efficiency(row, list(rows.values()) + [row])
            row["code"], row["finished"] = results.digest, datetime.datetime.now().isoformat(timespec="seconds")
            results.append(row)
            rows[point.key] = row
            view.update(rows)
    except KeyboardInterrupt:
        with contextlib.suppress(HvdError):  # (an interrupt in a point's append can come after its line is in)
            rows.update((key, row) for key, row in results.finished().items() if key in keys)
        print(f"{PREFIX} sweep interrupted; {len(rows)} of {len(points)} point(s) are in {path}: run the cell "
              "again to go on from the first unfinished one.", file=sys.stderr, flush=True)
        raise
    finally:
        view.update(rows)
        _back_to(session, original)
    failed = [r for r in rows.values() if r.get("status") != OK]
    print(f"{PREFIX} sweep: {len(rows) - len(failed)} point(s) measured, {len(failed)} failed; results in "
          f"{path}.", flush=True)
    return [rows[p.key] for p in points if p.key in rows]


def _run_point(session: Any, code: str, point: SweepPoint, target: Target | None, timeout: float | None,
               show: Callable[[SweepPoint, str], None]) -> dict[str, Any]:
    """One point on a fresh world: its row, ``status`` ok with its figures or failed with its error."""
    row: dict[str, Any] = {"point": point.key, "ranks": point.ranks, "batch": point.batch,
                           "global_batch": point.global_batch, "lr_rule": point.lr_rule, "warmup": point.warmup,
                           "target": str(target) if target else None}
    show(point, f"starting a world of {point.ranks} rank(s)")
    try:
        ranks = session.fresh_world(point.ranks)
        session.push("point", point)
        board = _PointDashboard([r.rank for r in ranks], lambda status: show(point, status))
        session.run_measured(code, board, timeout)
        row.update(status=OK, error=None, **measure(point, board.model, target))
    except HvdError as exc:
        row.update(status=FAILED, error=str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    return row


def fresh_world(session: Any, n: int, keep: bool = False) -> list[Any]:
    """A fresh world of ``n`` ranks with the recorded set-up cells replayed on it, quietly (a point of a
    ``%%hvd sweep``): the running cluster restarted (its warm standby promoted) where it has ``n``
    ranks (``keep``: kept as it is, the set-up cells replayed on it: the end of a sweep), else a cluster
    of ``n`` started in its place; returns once its new standby, if any, has started. What the last
    ``%hvd start`` asked for and the recorded cells stay as they were.

    Args:
        session: the kernel's ``Session``.
        n: the number of ranks.
        keep: keep the running cluster where it has ``n`` ranks (no restart).
    """
    with session.in_use():
        options, history = session.options, session.history
        if options is None:
            raise failures.no_cluster()
        if session.cluster is not None and session.cluster.n == n:
            ranks = session.cluster.ranks if keep else session.restart_held()
        else:
            session.stop()
            try:
                ranks = session.start(replace(options, n=n))
            finally:
                session.options, session.history = options, history
        session.runner.replay(say=lambda line: None)
        session.require().settle(options.start_timeout)  # (a standby starting beside the point would slow its ranks)
        return ranks


def _back_to(session: Any, n: int) -> None:
    """The world of the sweep's start again: ``n`` ranks with the set-up cells replayed (on the last point's
    world where it has as many)."""
    try:
        session.fresh_world(n, keep=True)
    except HvdError as exc:
        print(f"{PREFIX} sweep: the {n}-rank world of before the sweep did not start again: {exc}",
              file=sys.stderr)
        return
    print(f"{PREFIX} sweep: back on a world of {n} rank(s), the set-up cells replayed.", flush=True)
