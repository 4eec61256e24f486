"""The dashboard of one running ``%%hvd`` cell: reads the ranks' published
updates, keeps the model, and draws it with the view its mode asks for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..config import DashboardMode
from .message import ProgressUpdate
from .model import ProgressModel
from .text import TextView

RENDER_INTERVAL_S = 0.25


class Dashboard:
    """The dashboard of one running ``%%hvd`` cell; the session feeds it each
    rank's published data as it polls for output.

    >>> board = Dashboard(DashboardMode.TEXT, ranks=[0, 1])
    >>> board.poll({0: published_data_of_rank_0, 1: ...}); board.finish()
    """

    def __init__(self, mode: DashboardMode, ranks: list[int], display: Callable[..., Any] | None = None,
                 write: Callable[[str], Any] | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.mode = DashboardMode(mode)
        self.model = ProgressModel(ranks, clock)
        self.clock = clock
        self.seen: dict[int, int] = {}  # rank -> the last seq read
        self._display, self._write = display, write
        self.view: TextView | None = None  # made when the first update arrives
        self.frozen = False
        self.last_render = 0.0

    def poll(self, data_by_rank: dict[int, dict[str, Any]], force: bool = False) -> bool:
        """Feed the updates not seen yet (from each rank's published data); redraw
        at most every RENDER_INTERVAL_S. True when something new arrived."""
        if self.frozen:
            return False
        new = [update for rank, data in data_by_rank.items() for update in self._unseen(rank, data)]
        for update in sorted(new, key=lambda u: (u.rank, u.seq)):
            self.seen[update.rank] = max(self.seen.get(update.rank, -1), update.seq)
            self.model.feed(update)
        if new and self.view is None:
            self.view = self._make_view()
            self.view.show()
        now = self.clock()
        if self.view is not None and (force or now - self.last_render >= RENDER_INTERVAL_S):
            self.last_render = now
            self.view.render()
        return bool(new)

    def _unseen(self, rank: int, data: dict[str, Any]) -> list[ProgressUpdate]:
        last = self.seen.get(rank, -1)
        return [ProgressUpdate.from_dict(value) for key, value in list(data.items())
                if ProgressUpdate.is_key(key) and isinstance(value, dict) and value.get("seq", -1) > last]

    def _make_view(self) -> TextView:
        """The widget view in widgets mode where the widget libraries import, else text."""
        if self.mode == DashboardMode.WIDGETS:
            from .widget import WidgetView

            try:
                return WidgetView(self.model, self._display)
            except ImportError:
                pass
        return TextView(self.model, self._write)

    def fail(self, rank: int, message: str) -> None:
        """A rank's cell failed: the first line of ``message`` goes on its bar."""
        self.model.fail(rank, message.strip().splitlines()[0] if message.strip() else "failed")

    def reset(self, died: dict[int, str], commit: str, ranks: list[int]) -> None:
        """Ranks ``died`` (rank -> how) and a new world of ``ranks`` runs the cell again from ``commit``
        (an ``hvd.elastic`` resume): mark the event on the timeline, and read the new ranks' updates as
        the continuation of the old ones'."""
        if self.frozen:
            return
        self.model.reset(died, commit, ranks)
        self.seen.clear()  # the new ranks count their updates from 0 again
        if self.view is not None:
            self.view.render()

    def finish(self) -> None:
        """The cell ended: a last redraw, then the static summary; no more updates."""
        if self.frozen:
            return
        self.model.finish()
        if self.view is not None:
            self.view.finish()
        self.frozen = True
