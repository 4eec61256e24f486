"""The live widget view (ipywidgets 8 and bqplot): a bar per rank, the headline,
metric curves and the epoch table, and a tab per rank with its output
(``OutputTabs``), updated while the cell runs; when the cell ends it is
replaced by the static summary, which stays in the saved notebook.

It is the text view with other drawing: only ``show``, ``render`` and
``finish`` differ. The widget libraries are imported when a view is made.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from typing import Any

from ..messages import NOISE_SCALE, RankState
from .curves import smooth
from .formatting import event_lines, headline, noise_reading, rank_line, step_time_reading
from .model import ProgressModel, RankProgress
from .outputs import RankOutputs, output_html
from .summary import epoch_table_html, outputs_bundle, static_bundle
from .text import TextView


class OutputTabs:
    """A tab per rank with its output in the cell (``RankOutputs``), titled with its badge (``rank 1 ⚠``,
    ``rank 1 ✗``), the first shown rank's open. Raises ImportError where ipywidgets is missing.

    Args:
        outputs: every rank's output in the cell.
        display: IPython's ``display`` (a test's own where given).
    """

    def __init__(self, outputs: RankOutputs, display: Callable[..., Any] | None = None) -> None:
        import ipywidgets
        from IPython.display import display as ipython_display

        self._widgets = ipywidgets
        self._display = display or ipython_display
        self.outputs = outputs
        self.handle: Any = None  # where the tabs are shown on their own (a cell without a dashboard)
        self.pages: dict[int, Any] = {}  # rank -> its page (HTML)
        self.drawn: dict[int, int] = {}  # rank -> the version of its output on its page
        self.widget = ipywidgets.Tab(layout=ipywidgets.Layout(margin="6px 0 0 0"))
        self.widget.add_class("hvd-output-tabs")
        self.render()

    def render(self) -> None:
        """Draw the outputs that changed since the last call."""
        outputs = self.outputs
        if list(self.pages) != outputs.ranks:
            first = not self.pages
            for rank in outputs.ranks:
                if rank not in self.pages:
                    self.pages[rank] = self._widgets.HTML(value="")
                    self.pages[rank].add_class(f"hvd-rank-page-{rank}")
            self.pages = {rank: self.pages[rank] for rank in outputs.ranks}
            self.widget.children = list(self.pages.values())
            if first:
                self.widget.selected_index = outputs.ranks.index(outputs.selected)
        changed = [rank for rank in self.pages if self.drawn.get(rank) != outputs[rank].version]
        for rank in changed:
            self.pages[rank].value = output_html(outputs[rank])
            self.drawn[rank] = outputs[rank].version
        titles = tuple(outputs[rank].title for rank in self.pages)
        if tuple(self.widget.titles) != titles:
            self.widget.titles = titles

    def show(self) -> None:
        """Put the tabs under the cell on their own."""
        self.handle = self._display(self.widget, display_id=True)

    def finish(self) -> None:
        """Freeze the tabs shown on their own into their static copy (each rank's text in a ``<details>``)."""
        self.render()
        if self.handle is not None:
            self.handle.update(outputs_bundle(self.outputs), raw=True)


class WidgetView(TextView):
    """The live dashboard: bars per rank, headline, curves (bqplot), epoch table, and the ranks' output
    tabs where ``tabs`` are given (where they are shown on their own already, the dashboard takes their
    place). Raises ImportError where ipywidgets or bqplot are missing.

    Args:
        model: as for ``TextView``.
        display: IPython's ``display`` (a test's own where given).
        tabs: the ranks' output tabs, where the cell has them.
    """

    def __init__(self, model: ProgressModel, display: Callable[..., Any] | None = None,
                 tabs: OutputTabs | None = None) -> None:
        import bqplot
        import ipywidgets
        from IPython.display import display as ipython_display

        super().__init__(model)
        self._widgets, self._bqplot = ipywidgets, bqplot
        self._display = display or ipython_display
        self.handle: Any = tabs.handle if tabs is not None else None
        self.tabs = tabs
        self.headline = ipywidgets.HTML(value=self._headline_html())
        self.bars: dict[int, tuple[Any, Any]] = {}  # rank -> (progress bar, its text)
        self.rows = ipywidgets.VBox()
        self.each_rank = ipywidgets.Checkbox(value=False, description="each rank's curve", indent=False)
        self.each_rank.observe(lambda change: self._show_ranks(change["new"]), names="value")
        # metric -> (figure, its marks: (the mean unsmoothed, smoothed, resets, epochs, the global batch), each
        # rank's line)
        self.figures: dict[str, tuple[Any, tuple[Any, Any, Any, Any, Any], dict[int, Any]]] = {}
        self.plots = ipywidgets.HBox(layout=ipywidgets.Layout(flex_flow="row wrap"))
        self.reading = ipywidgets.HTML()  # the noise scale against the global batch, in a sentence
        self.step_time = ipywidgets.HTML()  # where the steps' time goes, in a sentence
        self.table = ipywidgets.HTML()
        self.events = ipywidgets.HTML()  # the world's resets during the cell
        self.widget = ipywidgets.VBox([self.headline, self.events, self.rows, self.plots, self.reading,
                                       self.step_time, self.each_rank, self.table]
                                      + ([tabs.widget] if tabs is not None else []),
                                      layout=ipywidgets.Layout(border="1px solid #ddd", padding="6px"))
        self.widget.add_class("hvd-dashboard")

    def show(self) -> None:
        if self.handle is not None:  # the tabs were shown on their own: the dashboard takes their place
            self.handle.update(self.widget)
        else:
            self.handle = self._display(self.widget, display_id=True)

    def render(self) -> None:
        run = self.model.current
        if run is None:
            return
        self.headline.value = self._headline_html()
        self.events.value = "<br>".join(f"<span style='color:#d9534f'>{html.escape(line)}</span>"
                                        for line in event_lines(self.model))
        stragglers = set(self.model.stragglers())
        for rank in self.model.rank_ids:
            rank_progress = run.ranks.get(rank)
            bar, text = self._bar(rank)
            if rank_progress is not None:
                self._draw_bar(bar, text, rank_progress, rank in stragglers)
        for metric in self.model.metrics():
            self._draw_curve(metric)
        for widget, reading in ((self.reading, noise_reading(self.model)),
                                (self.step_time, step_time_reading(self.model))):
            widget.value = html.escape(reading) if reading else ""
        self.table.value = epoch_table_html(self.model)
        if self.tabs is not None:
            self.tabs.render()

    def finish(self) -> None:
        """Freeze: replace the live widgets with a static summary (HTML + PNG, the ranks' output)."""
        self.render()
        if self.handle is not None:
            self.handle.update(static_bundle(self.model, self.tabs.outputs if self.tabs else None), raw=True)

    # -- pieces
    def _headline_html(self) -> str:
        return f"<b>hvd</b> {html.escape(headline(self.model))}"

    def _bar(self, rank: int) -> tuple[Any, Any]:
        if rank not in self.bars:
            widgets = self._widgets
            bar = widgets.IntProgress(value=0, min=0, max=1, description=f"rank {rank}",
                                      layout=widgets.Layout(width="340px"))
            bar.add_class("hvd-rank-bar")
            self.bars[rank] = (bar, widgets.HTML(value=""))
            self.rows.children = [widgets.HBox([b, t]) for b, t in (self.bars[r] for r in sorted(self.bars))]
        return self.bars[rank]

    def _draw_bar(self, bar: Any, text: Any, rank_progress: RankProgress, straggler: bool) -> None:
        total = rank_progress.total_steps or max(rank_progress.done_steps, 1)
        bar.max = max(total, 1)
        done = rank_progress.state == RankState.DONE
        bar.value = min(total if done else rank_progress.done_steps, bar.max)
        line = html.escape(rank_line(rank_progress))
        if rank_progress.state == RankState.FAILED:
            bar.bar_style = "danger"
        elif done:
            bar.bar_style = "success"
        elif straggler:
            bar.bar_style, line = "warning", "<b>straggler</b> " + line
        else:
            bar.bar_style = ""
        text.value = f"<span style='font-family:monospace'>{line}</span>"

    def _figure(self, metric: str) -> tuple[Any, tuple[Any, Any, Any, Any, Any], dict[int, Any]]:
        if metric not in self.figures:
            bq = self._bqplot
            x, y = bq.LinearScale(), bq.LinearScale()

            def lines(**style: Any) -> Any:
                return bq.Lines(x=[], y=[], scales={"x": x, "y": y}, **style)

            mean = lines(stroke_width=2.5, colors=["#1f77b4"], labels=["mean"])
            marks = (lines(stroke_width=1, colors=["#1f77b4"], opacities=[0.3], labels=["mean, unsmoothed"]), mean,
                     lines(colors=["#d9534f"], line_style="dashed", labels=["reset"]),
                     lines(colors=["#999999"], line_style="dash_dotted", stroke_width=1, labels=["epoch"]),
                     lines(colors=["#5cb85c"], stroke_width=1.5, labels=["global batch"]))
            fig = bq.Figure(marks=[mean], axes=[bq.Axis(scale=x, label="step", side="bottom"),
                                                bq.Axis(scale=y, side="left", tick_format=".3g")],
                            title=metric, fig_margin={"top": 40, "bottom": 40, "left": 55, "right": 15},
                            layout=self._widgets.Layout(width="360px", height="240px"))
            fig.add_class("hvd-curve")
            self.figures[metric] = (fig, marks, {})
            self.plots.children = [f for f, _, _ in self.figures.values()]
        return self.figures[metric]

    def _draw_curve(self, metric: str) -> None:
        """The mean over ranks smoothed, unsmoothed (faint) behind it; each rank's smoothed line (behind the
        checkbox); a grey dash-dotted line where each epoch begins and a dashed red one at each reset; on the
        noise scale's curve, a green line at the global batch."""
        per_rank, (mean_x, mean_y) = self.model.curve(metric)
        fig, (raw, mean, resets, epochs, level), lines = self._figure(metric)
        batch = self.model.global_batch() if metric == NOISE_SCALE and mean_x else None
        steps = [e.step for e in self.model.events if e.step is not None]
        starts = self.model.epoch_starts() if mean_y else []
        with fig.hold_sync():
            raw.x, raw.y = mean_x, mean_y
            mean.x, mean.y = mean_x, smooth(mean_y)
            for rank, (xs, ys) in per_rank.items():
                if rank not in lines:
                    lines[rank] = self._bqplot.Lines(x=[], y=[], scales=mean.scales, stroke_width=1,
                                                     opacities=[0.5], visible=self.each_rank.value,
                                                     labels=[f"rank {rank}"])
                lines[rank].x, lines[rank].y = xs, smooth(ys)
            if mean_y:  # vertical lines across the curve's range
                low, high = min(mean_y), max(mean_y)
                if steps:
                    resets.x, resets.y = [[s, s] for s in steps], [[low, high] for _ in steps]
                if starts:
                    epochs.x, epochs.y = [[s, s] for s in starts], [[low, high] for _ in starts]
            if batch is not None:
                level.x, level.y = [mean_x[0], mean_x[-1]], [batch, batch]
            marks = (([epochs] if starts else []) + [raw, mean] + [lines[r] for r in sorted(lines)]
                     + ([resets] if steps and mean_y else []) + ([level] if batch is not None else []))
            if list(fig.marks) != marks:
                fig.marks = marks

    def _show_ranks(self, visible: bool) -> None:
        for _, _, lines in self.figures.values():
            for line in lines.values():
                line.visible = visible
