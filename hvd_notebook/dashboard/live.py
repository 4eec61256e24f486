"""The dashboard of one running ``%%hvd`` cell: reads the ranks' published
updates, keeps the model, and draws it with the view its mode asks for; in
widgets mode it also keeps each rank's output for the tabs under it."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ..config import PREFIX, DashboardMode
from ..messages import ProgressUpdate
from .formatting import reset_text
from .model import ProgressModel
from .outputs import RankOutputs
from .summary import outputs_bundle
from .text import TextView

if TYPE_CHECKING:
    from .widget import OutputTabs

RENDER_INTERVAL_S = 0.25


class Dashboard:
    """The dashboard of one running ``%%hvd`` cell; the session feeds it each
    rank's published data as it polls for output.

    In widgets mode it also takes each rank's output (``output``): a tab per rank under the dashboard,
    or on its own in a cell without one where a rank not in ``shown`` (the ranks whose output the cell
    prints) wrote something or failed.

    >>> board = Dashboard(DashboardMode.TEXT, ranks=[0, 1])
    >>> board.poll({0: published_data_of_rank_0, 1: ...}); board.finish()

    Args:
        mode: ``text`` or ``widgets`` (``resolve_mode`` settles ``auto``).
        ranks: the ranks that run the cell.
        display: IPython's ``display`` (a test's own where given).
        write: where text mode writes its lines (``sys.stdout`` by default).
        clock: the clock for rates and redraws (``time.monotonic``; a test's own).
        shown: the ranks whose output the cell prints (rank 0 where None).
    """

    def __init__(self, mode: DashboardMode, ranks: list[int], display: Callable[..., Any] | None = None,
                 write: Callable[[str], Any] | None = None, clock: Callable[[], float] = time.monotonic,
                 shown: Iterable[int] | None = None) -> None:
        self.mode = DashboardMode(mode)
        self.model = ProgressModel(ranks, clock)
        self.seen: dict[int, int] = {}  # rank -> the last seq read
        self._display, self._write = display, write
        self.view: TextView | None = None  # made when the first update arrives
        # each rank's output, for the tabs (widgets mode only)
        self.outputs = (RankOutputs(ranks, ranks[:1] if shown is None else shown)
                        if self.mode == DashboardMode.WIDGETS else None)
        self.tabs: OutputTabs | None = None  # the tabs shown on their own, before any progress arrived
        self.frozen = False
        self.last_render = 0.0

    @property
    def records_output(self) -> bool:
        """Whether ``output`` keeps the ranks' output (for the tabs of widgets mode)."""
        return self.outputs is not None and not self.frozen

    def output(self, rank: int, name: str, text: str) -> None:
        """A rank wrote ``text`` to its stream ``name`` (stdout or stderr); shown at the next ``poll``.

        Args:
            rank: the rank that wrote.
            name: its stream, ``stdout`` or ``stderr``.
            text: what it wrote.
        """
        if self.records_output:
            self.outputs.write(rank, name, text)

    def poll(self, data_by_rank: dict[int, dict[str, Any]], force: bool = False) -> bool:
        """Feed the updates not seen yet (from each rank's published data); redraw
        at most every RENDER_INTERVAL_S. True when something new arrived.

        Args:
            data_by_rank: rank -> the data it published (its updates by sequence number).
            force: redraw now, whatever the interval.
        """
        if self.frozen:
            return False
        new = [update for rank, data in data_by_rank.items() for update in self._unseen(rank, data)]
        for update in sorted(new, key=lambda u: (u.rank, u.seq)):
            self.seen[update.rank] = max(self.seen.get(update.rank, -1), update.seq)
            self.model.feed(update)
        if new and self.view is None:
            self.view = self._make_view()
            self.view.show()
        elif self.view is None and self.tabs is None and self.outputs is not None and self.outputs.hidden_news:
            self.tabs = self._make_tabs()
            if self.tabs is not None:
                self.tabs.show()
        now = self.model.clock()
        if force or now - self.last_render >= RENDER_INTERVAL_S:
            self.last_render = now
            self._render()
        return bool(new)

    def _unseen(self, rank: int, data: dict[str, Any]) -> list[ProgressUpdate]:
        last = self.seen.get(rank, -1)
        return [ProgressUpdate.from_dict(value) for key, value in list(data.items())
                if ProgressUpdate.is_key(key) and isinstance(value, dict) and value.get("seq", -1) > last]

    def _render(self) -> None:
        """Redraw the dashboard, or the tabs shown on their own, where either is shown."""
        shown = self.view or self.tabs
        if shown is not None:
            shown.render()

    def _make_view(self) -> TextView:
        """The widget view in widgets mode where the widget libraries import, else text."""
        if self.mode == DashboardMode.WIDGETS:
            from .widget import WidgetView

            try:
                return WidgetView(self.model, self._display, self.tabs or self._make_tabs())
            except ImportError:
                pass
        return TextView(self.model, self._write)

    def _make_tabs(self) -> OutputTabs | None:
        """The ranks' output tabs (``OutputTabs``, widgets mode); None without ipywidgets."""
        try:
            from .widget import OutputTabs

            return OutputTabs(self.outputs, self._display)
        except ImportError:
            return None

    def fail(self, rank: int, message: str, details: str = "") -> None:
        """A rank's cell failed: the first line of ``message`` goes on its bar, and the badge ``✗`` on its
        tab, with ``details`` (the traceback) below its output.

        Args:
            rank: the rank whose cell failed.
            message: the error, first line first.
            details: the traceback.
        """
        first = message.strip().splitlines()[0] if message.strip() else "failed"
        self.model.fail(rank, first)
        if self.records_output:
            self.outputs.fail(rank, first, details)

    def reset(self, died: dict[int, str], commit: str, ranks: list[int]) -> None:
        """Ranks ``died`` (rank -> how) and a new world of ``ranks`` runs the cell again from ``commit``
        (an ``hvd.elastic`` resume): mark the event on the timeline, and read the new ranks' updates as
        the continuation of the old ones'.

        Args:
            died: rank -> how it ended.
            commit: the commit resumed from, as ``hvd.elastic`` summarised it.
            ranks: the new world's ranks.
        """
        if self.frozen:
            return
        event = self.model.reset(died, commit, ranks)
        self.seen.clear()  # the new ranks count their updates from 0 again
        if self.outputs is not None:
            self.outputs.note(f"{PREFIX} reset {len(self.model.events)}: {reset_text(event)}")
        self._render()

    def finish(self) -> None:
        """The cell ended: a last redraw, then the static summary; no more updates."""
        if self.frozen:
            return
        self.model.finish()
        shown = self.view or self.tabs
        if shown is not None:
            shown.finish()
        elif self.outputs is not None and self.outputs.hidden_news:
            from IPython.display import display  # (the cell ended before the tabs were drawn)

            (self._display or display)(outputs_bundle(self.outputs), raw=True)
        self.frozen = True
