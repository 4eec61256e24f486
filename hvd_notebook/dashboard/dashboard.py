"""Notebook side of the live dashboard: what the ranks report, drawn under the cell.

``Board`` aggregates the ranks' updates (``hvd_notebook.progress`` publishes
them) into what the views show: each rank's progress, global samples/s,
elapsed time and ETA, stragglers, curves of every metric over steps, and one
summary row per epoch. It is plain Python, tested on its own.

Views:
- ``WidgetView``: ipywidgets 8 and bqplot, updated while the cell runs; when the
  cell ends it is replaced by a static summary (HTML with a PNG of the curves)
  that stays in the saved notebook and in nbconvert output.
- ``TextView``: one compact line per epoch (and per evaluate/predict), where no
  widget front end exists (nbclient/nbconvert runs, IPython in a terminal).

``Progress`` ties a view to a running ``%%hvd`` cell; ``Session.run_cell``
feeds it the cell's published data as it polls for output.
"""

from __future__ import annotations

import base64
import html
import io
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..engine.progress import KEY_PREFIX

MODES = ("auto", "widgets", "text", "none")
STRAGGLER_BEHIND = 0.10  # a rank this far behind the median's steps is a straggler
STRAGGLER_MIN_STEPS = 10  # ... once the median has done this many
RATE_WINDOW_S = 2.0  # samples/s over about the last two seconds
MAX_POINTS = 2000  # per curve; older points are thinned beyond this
RENDER_INTERVAL_S = 0.25


def resolve_mode(mode: str | None = None) -> str:
    """``widgets`` where a Jupyter front end can show them, else ``text``; the
    environment variable ``HVD_NOTEBOOK_PROGRESS`` overrides ``auto``."""
    mode = (mode or "auto").lower()
    if mode == "auto":
        mode = os.environ.get("HVD_NOTEBOOK_PROGRESS", "auto").lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"progress mode {mode!r}: use one of {', '.join(MODES)}.")
    if mode != "auto":
        return mode
    return "widgets" if _widget_frontend() else "text"


def _widget_frontend() -> bool:
    """True in a kernel started by a Jupyter server (JupyterLab, Notebook, Hub),
    which sets JPY_SESSION_NAME; nbclient/nbconvert and terminals do not."""
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is None or getattr(shell, "kernel", None) is None:
            return False
        import bqplot  # noqa: F401
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return bool(os.environ.get("JPY_SESSION_NAME"))


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def fmt_rate(rate: float | None) -> str:
    if rate is None:
        return "-"
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"


def fmt_logs(logs: dict[str, float], skip: tuple[str, ...] = ("time", "samples")) -> str:
    """``loss 0.41 accuracy 0.88``: loss first, then the other metrics, validation last."""
    names = sorted((k for k in logs if k not in skip), key=lambda k: (k.startswith("val_"), "loss" not in k))
    return " ".join(f"{k} {logs[k]:.4g}" for k in names)


# ------------------------------------------------------------------ aggregation
@dataclass
class RankProgress:
    """One rank's latest state in one run."""

    rank: int
    state: str = "running"
    epoch: int = 0
    epochs: int | None = 1
    step: int = 0
    steps: int | None = None
    samples: int | None = None
    elapsed: float = 0.0
    logs: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    history: list[tuple[float, float]] = field(default_factory=list)  # (elapsed, samples or steps)
    points: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # metric -> (step, value)

    @property
    def done_steps(self) -> int:
        return self.epoch * (self.steps or 0) + self.step

    @property
    def total_steps(self) -> int | None:
        return self.epochs * self.steps if self.epochs and self.steps else None

    @property
    def fraction(self) -> float | None:
        total = self.total_steps
        if self.state == "done":
            return 1.0
        return min(1.0, self.done_steps / total) if total else None

    def rate(self) -> float | None:
        """Samples (or steps, where samples are unknown) per second, recently."""
        if not self.history or self.elapsed <= 0:
            return None
        t1, v1 = self.history[-1]
        if self.state == "running":
            for t0, v0 in reversed(self.history):
                if t1 - t0 >= RATE_WINDOW_S:
                    return (v1 - v0) / (t1 - t0)
        return v1 / t1 if t1 > 0 else None


@dataclass
class Run:
    """One fit/evaluate/predict call (or custom loop) on every rank."""

    kind: str
    ranks: dict[int, RankProgress] = field(default_factory=dict)
    epoch_logs: dict[int, dict[int, dict[str, float]]] = field(default_factory=dict)  # epoch -> rank -> logs

    @property
    def unit(self) -> str:
        return "samples/s" if any(rp.samples is not None for rp in self.ranks.values()) else "steps/s"


class Board:
    """Every rank's progress in a cell, from the updates the ranks publish."""

    def __init__(self, ranks: list[int], clock: Callable[[], float] = time.monotonic) -> None:
        self.rank_ids = list(ranks)
        self.clock = clock
        self.start = clock()
        self.runs: list[Run] = []
        self._run_of: dict[tuple[int, str], int] = {}  # (rank, run id) -> index in runs
        self._runs_per_rank: dict[int, int] = {}
        self.failed: dict[int, str] = {}
        self.finished_at: float | None = None

    # -- input
    def feed(self, update: dict[str, Any]) -> None:
        rank = int(update["rank"])
        key = (rank, str(update["run"]))
        index = self._run_of.get(key)
        if index is None:  # the k-th run of each rank is the same fit/evaluate/predict call
            index = self._run_of[key] = self._runs_per_rank.get(rank, 0)
            self._runs_per_rank[rank] = index + 1
            while len(self.runs) <= index:
                self.runs.append(Run(kind=str(update.get("kind", "fit"))))
        run = self.runs[index]
        rp = run.ranks.setdefault(rank, RankProgress(rank))
        for name in ("state", "epoch", "epochs", "step", "steps", "samples", "elapsed"):
            if name in update:
                setattr(rp, name, update[name])
        logs = {k: float(v) for k, v in (update.get("logs") or {}).items()}
        rp.logs = logs
        rp.history.append((rp.elapsed, float(rp.samples if rp.samples is not None else rp.done_steps)))
        if len(rp.history) > 4 * MAX_POINTS:
            del rp.history[: len(rp.history) // 2]
        if run.kind in ("fit", "custom"):
            x = rp.done_steps
            for name, value in logs.items():
                if name.startswith("val_"):
                    continue  # validation metrics exist per epoch only: they are in the epoch rows
                points = rp.points.setdefault(name, [])
                if points and points[-1][0] == x:
                    points[-1] = (x, value)
                else:
                    points.append((x, value))
                if len(points) > MAX_POINTS:
                    del points[1::2]
        for epoch, elogs in (update.get("epoch_logs") or {}).items():
            run.epoch_logs.setdefault(int(epoch), {})[rank] = dict(elogs)
        if self.failed.get(rank) and rp.state != "failed":
            rp.state, rp.error = "failed", self.failed[rank]

    def fail(self, rank: int, message: str) -> None:
        """A rank's cell failed: its bars turn red and show the error's first line."""
        self.failed[rank] = message
        for run in self.runs[-1:]:
            rp = run.ranks.setdefault(rank, RankProgress(rank))
            rp.state, rp.error = "failed", message

    def finish(self) -> None:
        self.finished_at = self.clock()

    # -- what the views show
    @property
    def current(self) -> Run | None:
        return self.runs[-1] if self.runs else None

    def run_done(self, run: Run) -> bool:
        """Every rank of the cell has finished this run."""
        return len(run.ranks) >= len(self.rank_ids) and all(rp.state == "done" for rp in run.ranks.values())

    def elapsed(self) -> float:
        return (self.finished_at or self.clock()) - self.start

    def rate(self, run: Run | None = None) -> float | None:
        """Samples/s (or steps/s) summed over the ranks."""
        run = run or self.current
        if run is None:
            return None
        rates = [r for r in (rp.rate() for rp in run.ranks.values()) if r is not None]
        return sum(rates) if rates else None

    def eta(self, run: Run | None = None) -> float | None:
        """Seconds until the slowest rank finishes this run, from its own pace."""
        run = run or self.current
        if run is None:
            return None
        etas = []
        for rp in run.ranks.values():
            if rp.state in ("done", "failed"):
                continue
            fraction = rp.fraction
            if not fraction:
                return None
            etas.append(rp.elapsed * (1 - fraction) / fraction)
        return max(etas) if etas else 0.0

    def stragglers(self, run: Run | None = None) -> list[int]:
        """Ranks more than 10 % behind the median rank's steps."""
        run = run or self.current
        if run is None or len(run.ranks) < 2:
            return []
        done = {r: rp.done_steps for r, rp in run.ranks.items() if rp.state != "failed"}
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
        if run is None:
            return []
        rows = []
        for epoch in sorted(run.epoch_logs):
            per_rank = run.epoch_logs[epoch]
            if len(per_rank) < max(len(run.ranks), len(self.rank_ids)) or not per_rank:
                continue
            names = [k for k in next(iter(per_rank.values())) if k not in ("time", "samples")]
            row: dict[str, float] = {"epoch": epoch + 1}
            row["time"] = max(logs.get("time", 0.0) for logs in per_rank.values())
            samples = [logs.get("samples") for logs in per_rank.values()]
            if all(s is not None for s in samples) and row["time"] > 0:
                row["samples/s"] = sum(samples) / row["time"]  # type: ignore[arg-type]
            for name in names:
                values = [logs[name] for logs in per_rank.values() if name in logs]
                row[name] = sum(values) / len(values)
            rows.append(row)
        return rows

    @property
    def curve_run(self) -> Run | None:
        """The latest run with curves (a fit or a custom loop; evaluate/predict have none)."""
        return next((run for run in reversed(self.runs) if run.kind in ("fit", "custom")), None)

    def metrics(self, run: Run | None = None) -> list[str]:
        """The metrics with curves, loss first (of the latest curve run by default)."""
        run = run or self.curve_run
        names: list[str] = []
        for rp in (run.ranks.values() if run else ()):
            names += [n for n in rp.points if n not in names]
        return sorted(names, key=lambda n: (n != "loss", n))

    def curve(self, metric: str, run: Run | None = None) -> tuple[dict[int, tuple[list[int], list[float]]],
                                                                 tuple[list[int], list[float]]]:
        """Each rank's (steps, values) of ``metric``, and their mean over ranks at
        every step where each rank has a value at or before it."""
        run = run or self.curve_run
        per_rank: dict[int, tuple[list[int], list[float]]] = {}
        for r, rp in sorted((run.ranks if run else {}).items()):
            points = rp.points.get(metric, [])
            if points:
                per_rank[r] = ([p[0] for p in points], [p[1] for p in points])
        if not per_rank:
            return {}, ([], [])
        start = max(xs[0] for xs, _ in per_rank.values())
        grid = sorted({x for xs, _ in per_rank.values() for x in xs if x >= start})
        mean_y = []
        for x in grid:
            values = []
            for xs, ys in per_rank.values():
                i = _last_at_or_before(xs, x)
                values.append(ys[i])
            mean_y.append(sum(values) / len(values))
        return per_rank, (grid, mean_y)

    def headline(self, run: Run | None = None) -> str:
        """One line: the run, its epoch, the global rate, elapsed and ETA."""
        run = run or self.current
        if run is None:
            return "waiting for the ranks' progress"
        any_rank = next(iter(run.ranks.values()))
        parts = [run.kind]
        if run.kind in ("fit", "custom") and (any_rank.epochs or 1) > 1:
            parts.append(f"epoch {min(any_rank.epoch + 1, any_rank.epochs or 1)}/{any_rank.epochs}")
        parts.append(f"{fmt_rate(self.rate(run))} {run.unit} over {len(run.ranks)} rank(s)")
        parts.append(f"elapsed {fmt_duration(self.elapsed())}")
        if self.run_done(run):
            parts.append("done")
        elif self.failed:
            parts.append(f"failed on rank(s) {sorted(self.failed)}")
        else:
            parts.append(f"ETA {fmt_duration(self.eta(run))}")
        return " | ".join(parts)

    def rank_line(self, rp: RankProgress) -> str:
        parts = []
        if (rp.epochs or 1) > 1:
            parts.append(f"epoch {min(rp.epoch + 1, rp.epochs or 1)}/{rp.epochs}")
        parts.append(f"step {rp.step}/{rp.steps if rp.steps is not None else '?'}")
        if rp.state == "failed":
            parts.append(f"FAILED: {rp.error}")
        else:
            parts.append(fmt_logs(rp.logs))
        return "  ".join(p for p in parts if p)


def _last_at_or_before(xs: list[int], x: int) -> int:
    lo, hi = 0, len(xs)
    while lo < hi:
        mid = (lo + hi) // 2
        if xs[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return max(0, lo - 1)


# ------------------------------------------------------------------ views
class TextView:
    """A compact line per finished epoch and per finished evaluate/predict."""

    def __init__(self, board: Board, write: Callable[[str], Any] | None = None) -> None:
        self.board = board
        self.write = write or (lambda text: sys.stdout.write(text))
        self.printed: set[tuple[int, int]] = set()  # (run index, epoch)
        self.ended: set[int] = set()  # runs of evaluate/predict printed
        self.failures: set[int] = set()

    def lines(self) -> list[str]:
        """The lines not printed yet."""
        out = []
        board = self.board
        for index, run in enumerate(board.runs):
            n = len(run.ranks)
            for row in board.epoch_rows(run):
                epoch = int(row["epoch"])
                if (index, epoch) in self.printed:
                    continue
                self.printed.add((index, epoch))
                epochs = next(iter(run.ranks.values())).epochs or 1
                parts = [f"[hvd] {run.kind} epoch {epoch}/{epochs}", f"{n} ranks"]
                if "samples/s" in row:
                    parts.append(f"{fmt_rate(row['samples/s'])} samples/s")
                parts += [fmt_logs({k: v for k, v in row.items() if k not in ("epoch", "samples/s")}),
                          f"{row['time']:.1f} s"]
                out.append(" | ".join(p for p in parts if p))
            if run.kind in ("evaluate", "predict") and index not in self.ended and board.run_done(run):
                self.ended.add(index)
                parts = [f"[hvd] {run.kind}", f"{n} ranks", f"{fmt_rate(board.rate(run))} {run.unit}",
                         fmt_logs(_mean_logs(run))]
                out.append(" | ".join(p for p in parts if p))
        for rank, message in sorted(board.failed.items()):
            if rank not in self.failures:
                self.failures.add(rank)
                out.append(f"[hvd] rank {rank} failed: {message}")
        return out

    def render(self) -> None:
        for line in self.lines():
            self.write(line + "\n")

    def finish(self) -> None:
        self.render()


def _mean_logs(run: Run) -> dict[str, float]:
    names: list[str] = []
    for rp in run.ranks.values():
        names += [n for n in rp.logs if n not in names]
    means = {}
    for name in names:
        values = [rp.logs[name] for rp in run.ranks.values() if name in rp.logs]
        means[name] = sum(values) / len(values)
    return means


class WidgetView:
    """The live dashboard: bars per rank, headline, curves (bqplot), epoch table."""

    def __init__(self, board: Board, display: Callable[..., Any] | None = None) -> None:
        import bqplot
        import ipywidgets as W

        self.board = board
        self.W, self.bq = W, bqplot
        self._display = display
        self.handle: Any = None
        self.headline = W.HTML(value=f"<b>hvd</b> {html.escape(board.headline())}")
        self.bars: dict[int, tuple[Any, Any]] = {}
        self.rows = W.VBox()
        self.each_rank = W.Checkbox(value=False, description="each rank's curve", indent=False)
        self.each_rank.observe(lambda change: self._show_ranks(change["new"]), names="value")
        self.figures: dict[str, tuple[Any, Any, dict[int, Any]]] = {}
        self.plots = W.HBox(layout=W.Layout(flex_flow="row wrap"))
        self.table = W.HTML()
        self.widget = W.VBox([self.headline, self.rows, self.plots, self.each_rank, self.table],
                             layout=W.Layout(border="1px solid #ddd", padding="6px"))
        self.widget.add_class("hvd-dashboard")
        self.run_index = -1

    def show(self) -> None:
        from IPython.display import display

        self.handle = (self._display or display)(self.widget, display_id=True)

    # -- pieces
    def _bar(self, rank: int) -> tuple[Any, Any]:
        if rank not in self.bars:
            W = self.W
            bar = W.IntProgress(value=0, min=0, max=1, description=f"rank {rank}",
                                layout=W.Layout(width="340px"))
            bar.add_class("hvd-rank-bar")
            text = W.HTML(value="")
            self.bars[rank] = (bar, text)
            self.rows.children = [W.HBox([b, t]) for b, t in (self.bars[r] for r in sorted(self.bars))]
        return self.bars[rank]

    def _figure(self, metric: str) -> tuple[Any, Any, dict[int, Any]]:
        if metric not in self.figures:
            bq = self.bq
            x, y = bq.LinearScale(), bq.LinearScale()
            mean = bq.Lines(x=[], y=[], scales={"x": x, "y": y}, stroke_width=2.5, colors=["#1f77b4"],
                            labels=["mean"])
            fig = bq.Figure(marks=[mean], axes=[bq.Axis(scale=x, label="step", side="bottom"),
                                                bq.Axis(scale=y, side="left", tick_format=".3g")],
                            title=metric, fig_margin={"top": 40, "bottom": 40, "left": 55, "right": 15},
                            layout=self.W.Layout(width="360px", height="240px"))
            fig.add_class("hvd-curve")
            self.figures[metric] = (fig, mean, {})
            self.plots.children = [f for f, _, _ in self.figures.values()]
        return self.figures[metric]

    def _show_ranks(self, visible: bool) -> None:
        for _, _, lines in self.figures.values():
            for line in lines.values():
                line.visible = visible

    # -- update
    def render(self) -> None:
        board = self.board
        run = board.current
        if run is None:
            return
        self.headline.value = f"<b>hvd</b> {html.escape(board.headline())}"
        stragglers = set(board.stragglers())
        for rank in board.rank_ids:
            rp = run.ranks.get(rank)
            bar, text = self._bar(rank)
            if rp is None:
                continue
            total = rp.total_steps or max(rp.done_steps, 1)
            bar.max = max(total, 1)
            bar.value = min(rp.done_steps if rp.state != "done" else total, bar.max)
            if rp.state == "failed":
                bar.bar_style, label = "danger", rp.error or "failed"
            elif rp.state == "done":
                bar.bar_style, label = "success", ""
            elif rank in stragglers:
                bar.bar_style, label = "warning", "straggler"
            else:
                bar.bar_style, label = "", ""
            line = html.escape(board.rank_line(rp))
            if label and rp.state != "failed":
                line = f"<b>{html.escape(label)}</b> " + line
            text.value = f"<span style='font-family:monospace'>{line}</span>"
        for metric in board.metrics():
            per_rank, (mx, my) = board.curve(metric)
            fig, mean, lines = self._figure(metric)
            with fig.hold_sync():
                mean.x, mean.y = mx, my
                for rank, (xs, ys) in per_rank.items():
                    if rank not in lines:
                        lines[rank] = self.bq.Lines(x=[], y=[], scales=mean.scales, stroke_width=1,
                                                    opacities=[0.5], visible=self.each_rank.value,
                                                    labels=[f"rank {rank}"])
                        fig.marks = [mean] + [lines[r] for r in sorted(lines)]
                    lines[rank].x, lines[rank].y = xs, ys
        self.table.value = epoch_table_html(board)

    def finish(self) -> None:
        """Freeze: replace the live widgets with a static summary (HTML + PNG)."""
        self.render()
        bundle = static_bundle(self.board)
        if self.handle is not None:
            self.handle.update(bundle, raw=True)


# ------------------------------------------------------------------ static summary
def epoch_table_html(board: Board) -> str:
    parts = []
    for run in board.runs:
        rows = board.epoch_rows(run)
        if run.kind in ("evaluate", "predict") and board.run_done(run):
            rows = [dict(_mean_logs(run), **{run.unit: board.rate(run) or 0.0})]
        if not rows:
            continue
        cols = list(dict.fromkeys(k for row in rows for k in row))
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join(
            "<tr>" + "".join(f"<td>{_cell(row.get(c))}</td>" for c in cols) + "</tr>" for row in rows
        )
        parts.append(f"<div><b>{html.escape(run.kind)}</b> (mean over ranks)"
                     f"<table class='hvd-epochs'><tr>{head}</tr>{body}</table></div>")
    return "".join(parts)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return html.escape(str(value))


def curves_png(board: Board) -> bytes | None:
    """The curves of every metric (mean over ranks, each rank faint) as a PNG."""
    metrics = board.metrics()
    if not metrics:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(3.6 * len(metrics), 2.6), dpi=100)
    for i, metric in enumerate(metrics):
        ax = fig.add_subplot(1, len(metrics), i + 1)
        per_rank, (mx, my) = board.curve(metric)
        for rank, (xs, ys) in per_rank.items():
            ax.plot(xs, ys, linewidth=0.8, alpha=0.4, label=f"rank {rank}")
        ax.plot(mx, my, linewidth=2, color="#1f77b4", label="mean")
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return out.getvalue()


def static_bundle(board: Board) -> dict[str, str]:
    """The frozen dashboard as a display bundle: HTML (with the PNG inline) and text."""
    rows = []
    run = board.current
    for rank in board.rank_ids:
        rp = run.ranks.get(rank) if run else None
        if rp is None:
            continue
        colour = {"failed": "#d9534f", "done": "#5cb85c"}.get(rp.state, "#f0ad4e")
        percent = round(100 * (rp.fraction or 0.0))
        bar = (f"<div class='hvd-static-bar' data-percent='{percent}' style='width:160px;height:10px;"
               f"background:#eee;display:inline-block'><div style='width:{percent}%;height:10px;"
               f"background:{colour}'></div></div> {percent}%")
        rows.append(f"<tr><td>rank {rank}</td><td>{bar}</td><td style='color:{colour}'>{html.escape(rp.state)}"
                    f"</td><td style='font-family:monospace'>{html.escape(board.rank_line(rp))}</td></tr>")
    png = curves_png(board)
    img = (f"<img alt='hvd curves' src='data:image/png;base64,{base64.b64encode(png).decode()}'/>"
           if png else "")
    text = "\n".join([board.headline()] + [f"rank {r}: {board.rank_line(rp)}" for r, rp in
                                           sorted((run.ranks if run else {}).items())])
    body = (f"<div class='hvd-summary'><p><b>hvd</b> {html.escape(board.headline())}</p>"
            f"<table>{''.join(rows)}</table>{img}{epoch_table_html(board)}</div>")
    bundle = {"text/html": body, "text/plain": text}
    if png:
        bundle["image/png"] = base64.b64encode(png).decode()
    return bundle


# ------------------------------------------------------------------ a cell's progress
class Progress:
    """The dashboard of one running ``%%hvd`` cell."""

    def __init__(self, mode: str, ranks: list[int], display: Callable[..., Any] | None = None,
                 write: Callable[[str], Any] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.mode = mode
        self.board = Board(ranks, clock)
        self.clock = clock
        self.seen: dict[int, int] = {}
        self._display, self._write = display, write
        self.view: WidgetView | TextView | None = None  # made when the first update arrives
        self.frozen = False
        self.last_render = 0.0

    def poll(self, data_by_rank: dict[int, dict[str, Any]], force: bool = False) -> bool:
        """Feed the updates not seen yet (from each rank's published data); redraw
        at most every RENDER_INTERVAL_S. True when something new arrived."""
        if self.frozen:
            return False
        new = []
        for rank, data in data_by_rank.items():
            last = self.seen.get(rank, -1)
            for key, update in list(data.items()):
                if key.startswith(KEY_PREFIX) and isinstance(update, dict) and update.get("seq", -1) > last:
                    new.append(update)
        for update in sorted(new, key=lambda u: (u["rank"], u["seq"])):
            self.seen[update["rank"]] = max(self.seen.get(update["rank"], -1), update["seq"])
            self.board.feed(update)
        if new and self.view is None:
            if self.mode == "widgets":
                self.view = WidgetView(self.board, self._display)
                self.view.show()
            else:
                self.view = TextView(self.board, self._write)
        now = self.clock()
        if self.view is not None and (force or now - self.last_render >= RENDER_INTERVAL_S):
            self.last_render = now
            self.view.render()
        return bool(new)

    def fail(self, rank: int, message: str) -> None:
        self.board.fail(rank, message.strip().splitlines()[0] if message.strip() else "failed")

    def finish(self) -> None:
        """The cell ended: a last redraw, then the static summary; no more updates."""
        if self.frozen:
            return
        self.board.finish()
        if self.view is not None:
            self.view.finish()
        self.frozen = True
