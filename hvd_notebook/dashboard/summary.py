"""The frozen dashboard that stays in the saved notebook once a cell ends:
bars, the epoch table (HTML) and the curves (a PNG), with a text version."""

from __future__ import annotations

import base64
import html
import io
from typing import Any

from ..messages import NOISE_SCALE, RankState
from .curves import smooth
from .formatting import event_lines, headline, noise_reading, rank_line, step_time_reading
from .model import ProgressModel
from .outputs import RankOutputs, output_html, outputs_text

_COLOURS = {RankState.FAILED: "#d9534f", RankState.DONE: "#5cb85c"}
_RUNNING_COLOUR = "#f0ad4e"


def epoch_table_html(model: ProgressModel) -> str:
    """A table per run: a row per epoch of fit, one row for evaluate/predict.

    Args:
        model: the cell's progress (every rank's runs).
    """
    parts = []
    for run in model.runs:
        rows = model.epoch_rows(run)
        if not run.kind.has_curves and model.run_done(run):
            rows = [dict(run.mean_logs(), **{run.unit: model.rate(run) or 0.0})]
        if not rows:
            continue
        cols = list(dict.fromkeys(k for row in rows for k in row))
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join(
            "<tr>" + "".join(f"<td>{_table_cell(row.get(c))}</td>" for c in cols) + "</tr>" for row in rows
        )
        parts.append(f"<div><b>{html.escape(run.kind)}</b> (mean over ranks)"
                     f"<table class='hvd-epochs'><tr>{head}</tr>{body}</table></div>")
    return "".join(parts)


def _reading_html(reading: str | None, kind: str) -> str:
    return f"<p class='{kind}'>{html.escape(reading)}</p>" if reading else ""


def _table_cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return html.escape(str(value))


def curves_png(model: ProgressModel) -> str | None:
    """The curves of every metric as a PNG (base64 text): the mean over ranks smoothed, unsmoothed behind it,
    each rank faint; grey dash-dotted lines where epochs begin, dashed red ones at resets. None without curves
    or without matplotlib.

    Args:
        model: the cell's progress (every rank's runs).
    """
    metrics = model.metrics()
    if not metrics:
        return None
    fig = new_figure(3.6 * len(metrics), 2.6)
    if fig is None:
        return None
    for i, metric in enumerate(metrics):
        ax = fig.add_subplot(1, len(metrics), i + 1)
        per_rank, (mean_x, mean_y) = model.curve(metric)
        for start in model.epoch_starts():
            ax.axvline(start, color="#888888", linestyle="-.", linewidth=1)
        for rank, (xs, ys) in per_rank.items():
            ax.plot(xs, smooth(ys), linewidth=0.8, alpha=0.4, label=f"rank {rank}")
        ax.plot(mean_x, mean_y, linewidth=0.8, alpha=0.3, color="#1f77b4")
        ax.plot(mean_x, smooth(mean_y), linewidth=2, color="#1f77b4", label="mean")
        for event in model.events:
            if event.step is not None:
                ax.axvline(event.step, color="#d9534f", linestyle="--", linewidth=1)
        batch = model.global_batch() if metric == NOISE_SCALE else None
        if batch is not None:
            ax.axhline(batch, color="#5cb85c", linewidth=1.5, label="global batch")
        ax.set_title(metric)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return png_text(fig)


def new_figure(width: float, height: float) -> Any:
    """A matplotlib figure drawn off screen (Agg), ``width`` by ``height`` inches; None without matplotlib.

    Args:
        width: in inches.
        height: in inches.
    """
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure(figsize=(width, height), dpi=100)


def png_text(fig: Any) -> str:
    """``fig``, laid out tight, as a PNG's base64 text (what an inline ``<img>`` and a display bundle take).

    Args:
        fig: a matplotlib figure.
    """
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png")
    return base64.b64encode(out.getvalue()).decode()


def png_img(png: str | None, alt: str) -> str:
    """An ``<img>`` showing ``png`` (base64 text) inline; nothing without one.

    Args:
        png: the image as base64 text, or None.
        alt: the image's text for those who cannot see it.
    """
    return f"<img alt='{alt}' src='data:image/png;base64,{png}'/>" if png else ""


def outputs_html(outputs: RankOutputs) -> str:
    """Each rank's output as a ``<details>`` (the first shown rank's open) titled like its tab, badge
    included; empty where no rank wrote anything.

    Args:
        outputs: every rank's output in the cell.
    """
    if not any(output.wrote for output in outputs.by_rank.values()):
        return ""
    parts = []
    for rank in outputs.ranks:
        output = outputs[rank]
        is_open = " open" if rank == outputs.selected else ""
        parts.append(f"<details class='hvd-rank-details' data-rank='{rank}'{is_open}>"
                     f"<summary style='cursor:pointer'>{html.escape(output.title)}</summary>"
                     f"{output_html(output)}</details>")
    return f"<div class='hvd-outputs'><p style='margin:6px 0 2px'><b>output per rank</b></p>{''.join(parts)}</div>"


def outputs_bundle(outputs: RankOutputs) -> dict[str, str]:
    """The frozen output tabs of a cell without a dashboard, as a display bundle.

    Args:
        outputs: every rank's output in the cell.
    """
    return {"text/html": outputs_html(outputs), "text/plain": outputs_text(outputs)}


def static_bundle(model: ProgressModel, outputs: RankOutputs | None = None) -> dict[str, str]:
    """The frozen dashboard as a display bundle: HTML (with the PNG inline) and text; ``outputs``: the
    ranks' output under it.

    Args:
        model: the cell's progress (every rank's runs).
        outputs: every rank's output in the cell, or None.
    """
    run = model.current
    ranks = sorted(run.ranks.items()) if run else []
    rows = []
    for rank, rank_progress in ranks:
        colour = _COLOURS.get(rank_progress.state, _RUNNING_COLOUR)
        percent = round(100 * (rank_progress.fraction or 0.0))
        bar = (f"<div class='hvd-static-bar' data-percent='{percent}' style='width:160px;height:10px;"
               f"background:#eee;display:inline-block'><div style='width:{percent}%;height:10px;"
               f"background:{colour}'></div></div> {percent}%")
        rows.append(f"<tr><td>rank {rank}</td><td>{bar}</td><td style='color:{colour}'>"
                    f"{html.escape(rank_progress.state)}</td><td style='font-family:monospace'>"
                    f"{html.escape(rank_line(rank_progress))}</td></tr>")
    png = curves_png(model)
    img = png_img(png, "hvd curves")
    events = event_lines(model)
    reading, step_time = noise_reading(model), step_time_reading(model)
    text = "\n".join([headline(model), *events] + [f"rank {r}: {rank_line(p)}" for r, p in ranks]
                     + [line for line in (reading, step_time) if line])
    if outputs is not None and outputs_text(outputs):
        text += "\n" + outputs_text(outputs)
    events_html = "".join(f"<p class='hvd-reset' style='color:#d9534f'>{html.escape(line)}</p>" for line in events)
    body = (f"<div class='hvd-summary'><p><b>hvd</b> {html.escape(headline(model))}</p>{events_html}"
            f"<table>{''.join(rows)}</table>{img}{_reading_html(reading, 'hvd-noise-scale')}"
            f"{_reading_html(step_time, 'hvd-step-time')}{epoch_table_html(model)}"
            f"{outputs_html(outputs) if outputs is not None else ''}</div>")
    bundle = {"text/html": body, "text/plain": text}
    if png:
        bundle["image/png"] = png
    return bundle
