"""What a ``%%hvd sweep`` shows while it runs and leaves in the notebook: a table with a row per point
(finished, running with its live headline, or still to come) and two plots: scaling efficiency against
ranks, and time to the target against the global batch with the measured noise scale marked. One display,
updated in place (``display_id``), so the last state is what the saved notebook keeps."""

from __future__ import annotations

import html
import statistics
from collections.abc import Callable
from typing import Any, Protocol

from .formatting import fmt_duration, fmt_rate, text_table
from .summary import new_figure, png_img, png_text

COLUMNS = ("point", "global batch", "samples/s", "efficiency", "to target", "communication", "noise scale",
           "metrics", "status")


class SweepPoint(Protocol):
    """What the table needs of a point (``engine.sweep_point.SweepPoint``, which the dashboard does not import)."""

    key: str
    global_batch: int

    def describe(self) -> str: ...


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def row_cells(point: SweepPoint, row: dict[str, Any] | None, running: str | None = None) -> list[str]:
    """The table's cells for one point: its figures once finished, else what it is doing.

    Args:
        point: the sweep's point.
        row: its figures once finished (None before).
        running: what it is doing while it runs.
    """
    cells = [point.describe(), f"{point.global_batch:,}"]
    if row is None:
        return cells + ["-"] * (len(COLUMNS) - 3) + [running or "to come"]
    if row.get("status") != "ok":
        return cells + ["-"] * (len(COLUMNS) - 3) + [f"failed: {row.get('error') or '?'}"]
    if "seconds_to_target" not in row:
        to_target = "-"
    elif row["seconds_to_target"] is None:
        to_target = "not reached"
    else:
        steps = f", {row['steps_to_target']:,} steps" if row.get("steps_to_target") else ""
        to_target = f"{fmt_duration(row['seconds_to_target'])}{steps}"
    metrics = " ".join(f"{k} {v:.4g}" for k, v in sorted(row.get("metrics", {}).items(),
                                                          key=lambda kv: (kv[0].startswith("val_"), kv[0])))
    noise = row.get("noise_scale")
    return cells + [fmt_rate(row.get("samples_per_s")), _percent(row.get("efficiency")), to_target,
                    _communication(row), "-" if noise is None else fmt_rate(noise), metrics, "done"]


def _communication(row: dict[str, Any]) -> str:
    """``37%``, or ``37%, waits for rank 1`` where the others waited for one rank."""
    waited_for = row.get("waited_for")
    return _percent(row.get("communication")) + (f", waits for rank {waited_for}" if waited_for is not None else "")


def measured_noise_scale(rows: list[dict[str, Any]]) -> float | None:
    """The median of the points' measured noise scales (B_simple), where any was measured.

    Args:
        rows: the finished points' figures.
    """
    values = [r["noise_scale"] for r in rows if r.get("status") == "ok" and r.get("noise_scale")]
    return statistics.median(values) if values else None


def figure_png(rows: list[dict[str, Any]], target: Any = None) -> str | None:
    """The two plots as a PNG (base64 text); None before any point finished, or without matplotlib.

    Args:
        rows: the finished points' figures.
        target: the sweep's target (what the time to target is measured to), or None: the training time is plotted.
    """
    done = [r for r in rows if r.get("status") == "ok"]
    if not done:
        return None
    fig = new_figure(9, 3.2)
    if fig is None:
        return None
    eff_ax, time_ax = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for batch in sorted({r["batch"] for r in done}):
        by_ranks: dict[int, list[float]] = {}
        for r in done:
            if r["batch"] == batch and r.get("efficiency") is not None:
                by_ranks.setdefault(r["ranks"], []).append(r["efficiency"])
        if by_ranks:
            xs = sorted(by_ranks)
            eff_ax.plot(xs, [statistics.fmean(by_ranks[x]) for x in xs], "o-", label=f"{batch} per rank")
    eff_ax.axhline(1.0, color="#888888", linestyle="--", linewidth=1)
    eff_ax.set(title="scaling efficiency", xlabel="ranks", ylim=(0, 1.15), xticks=sorted({r["ranks"] for r in done}))
    key = "seconds_to_target" if target is not None else "seconds"
    for ranks, rule, warmup in sorted(dict.fromkeys((r["ranks"], r["lr_rule"], r["warmup"]) for r in done)):
        points = sorted((r["global_batch"], r[key]) for r in done
                        if (r["ranks"], r["lr_rule"], r["warmup"]) == (ranks, rule, warmup) and r.get(key) is not None)
        if points:
            label = f"{ranks} rank{'s' if ranks > 1 else ''}, lr {rule}" + (f", warm-up {warmup}" if warmup else "")
            time_ax.plot([p[0] for p in points], [p[1] for p in points], "s-", label=label)
    noise = measured_noise_scale(done)
    if noise is not None:
        time_ax.axvline(noise, color="#5cb85c", linewidth=1.5, label=f"noise scale {fmt_rate(noise)}")
    time_ax.set(title=f"time to {target}" if target is not None else "training time",
                xlabel="global batch", ylabel="s")
    time_ax.set_xscale("log", base=2)
    for ax in (eff_ax, time_ax):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    return png_text(fig)


class SweepDisplay:
    """The sweep's table and plots, one display updated in place.

    >>> view = SweepDisplay(points, target)
    >>> view.update(rows); view.update(rows, running_point, "fit | epoch 2/5 | ..."); view.update(rows)

    Args:
        points: the sweep's points, in order.
        target: the sweep's target, or None (as for ``figure_png``).
        display: IPython's ``display`` (a test's own where given).
    """

    def __init__(self, points: list[SweepPoint], target: Any = None,
                 display: Callable[..., Any] | None = None) -> None:
        self.points, self.target = points, target
        self._display = display
        self._in_place = True  # (a display given: it redraws in place; IPython's own: where a kernel runs)
        self._handle: Any = None
        self._shown = -1  # finished points last shown
        self._png: tuple[int, str | None] = (-1, None)  # (finished points it shows, the PNG)

    def bundle(self, rows: dict[str, dict[str, Any]], running: SweepPoint | None = None,
               status: str = "") -> dict[str, str]:
        """The display bundle: HTML (the table, then the plots' PNG inline) and text (the table).

        Args:
            rows: point key -> its figures, for the finished points.
            running: the point running now, if any.
            status: what it is doing (its progress line).
        """
        table = [row_cells(p, rows.get(p.key), status if p == running else None) for p in self.points]
        if self._png[0] != len(rows):
            self._png = (len(rows), figure_png([rows[p.key] for p in self.points if p.key in rows], self.target))
        png = self._png[1]
        head = "".join(f"<th>{html.escape(c)}</th>" for c in COLUMNS)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>" for cells in table)
        img = png_img(png, "hvd sweep plots")
        title = f"sweep: {sum(p.key in rows for p in self.points)} of {len(self.points)} point(s) done" + (
            f", target {self.target}" if self.target is not None else "")
        return {"text/html": f"<div class='hvd-sweep'><p><b>hvd</b> {html.escape(title)}</p>"
                               f"<table class='hvd-sweep-table'><tr>{head}</tr>{body}</table>{img}</div>",
                "text/plain": f"{title}\n{text_table([COLUMNS, *table])}"}

    def update(self, rows: dict[str, dict[str, Any]], running: SweepPoint | None = None, status: str = "") -> None:
        """Redraw with ``rows`` finished and ``running`` doing ``status``. Where no front end redraws a
        display in place (IPython in a terminal, which would print each update anew), only a change of the
        finished points is shown.

        Args:
            rows: point key -> its figures, for the finished points.
            running: the point running now, if any.
            status: what it is doing (its progress line).
        """
        if self._display is None:
            from IPython import get_ipython
            from IPython.display import display

            self._display, self._in_place = display, getattr(get_ipython(), "kernel", None) is not None
        if not self._in_place and self._handle is not None and self._shown == len(rows):
            return
        self._shown = len(rows)
        bundle = self.bundle(rows, running, status)
        if self._handle is None or not self._in_place:
            self._handle = self._display(bundle, raw=True, display_id=True)
        else:
            self._handle.update(bundle, raw=True)
