"""A running cell's output, forwarded: each rank's lines to the notebook (the ranks it shows) and to its tab
under the dashboard (widgets mode), its progress to the dashboard, its rich displays to the notebook."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from ..cluster.launching.replies import RankReply
from ..dashboard import Dashboard
from ..messages import ProgressUpdate

STREAMS = ("stdout", "stderr")


class OutputStream:
    """Forwards one rank's accumulated stdout or stderr, a complete line at a time, each line prefixed with the
    rank (unless not ``prefixed``).

    Args:
        rank: the rank whose stream it is.
        name: ``stdout`` or ``stderr``.
        write: where its lines go.
        prefixed: start each line with ``[rank] ``.
    """

    def __init__(self, rank: int, name: str, write: Callable[[str], Any], prefixed: bool = True) -> None:
        self.prefix = f"[{rank}] " if prefixed else ""
        self.rank = rank
        self.name = name
        self.write = write
        self.sent = 0

    def update(self, text: str, final: bool = False) -> None:
        """Forward what ``text`` (all of it so far) has beyond what was sent; the
        last, unfinished line only when ``final``.

        Args:
            text: all the stream's text so far.
            final: also send the unfinished last line.
        """
        if len(text) < self.sent:  # a '\r' line was collapsed on its way here: resend from its start
            self.sent = text.rfind("\n", 0, len(text)) + 1
        end = len(text) if final else text.rfind("\n") + 1
        if end <= self.sent:
            return
        chunk = text[self.sent:end]
        self.sent = end
        lines = chunk.splitlines(keepends=True)
        text = "".join(self.prefix + line for line in lines)
        self.write(text if text.endswith("\n") else text + "\n")


class CellOutput:
    """Where a running cell's output goes, and how much of it went.

    Args:
        ranks: the cell's ranks.
        show: the ranks whose lines and rich displays the notebook shows.
        dashboard: the cell's dashboard (None: none), which gets the progress and, where it records output,
            every rank's lines.
    """

    def __init__(self, ranks: list[int], show: set[int], dashboard: Dashboard | None) -> None:
        self.show, self.dashboard = show, dashboard
        self.streams = [OutputStream(rank, name, getattr(sys, name).write)
                        for rank in ranks if rank in show for name in STREAMS]
        board = dashboard if dashboard is not None and dashboard.records_output else None
        self.copies = [  # every rank's whole output, for its tab under the dashboard (widgets mode)
            OutputStream(rank, name, functools.partial(board.output, rank, name), prefixed=False)
            for rank in ranks for name in STREAMS
        ] if board is not None else []
        self._displayed: dict[int, int] = {}  # per rank: how many of its rich outputs were shown

    @property
    def tabs(self) -> Dashboard | None:
        """The dashboard where it keeps every rank's output in a tab (widgets mode), else None."""
        return self.dashboard if self.copies else None

    def lines(self, replies: list[RankReply], final: bool = False) -> None:
        """Forward the new complete lines of each rank; ``final``: its unfinished last line too.

        Args:
            replies: each rank's reply so far.
            final: also send each unfinished last line.
        """
        by_rank = {reply.rank: reply for reply in replies}
        for stream in (*self.streams, *self.copies):
            stream.update(getattr(by_rank[stream.rank], stream.name), final)

    def progress(self, replies: list[RankReply], final: bool = False) -> None:
        """The ranks' progress to the dashboard (``final``: drawn whatever its refresh rate).

        Args:
            replies: each rank's reply so far.
            final: draw whatever the refresh rate.
        """
        if self.dashboard is not None:
            self.dashboard.poll({reply.rank: reply.data for reply in replies}, force=final)

    def displays(self, replies: list[RankReply]) -> None:
        """The new rich displays of the ranks shown, published as the notebook's own.

        Args:
            replies: each rank's reply so far.
        """
        for reply in replies:
            if reply.rank in self.show:
                for out in reply.outputs[self._displayed.get(reply.rank, 0):]:
                    _publish(out)
                self._displayed[reply.rank] = len(reply.outputs)


def progress_count(replies: list[RankReply]) -> int:
    """How many progress updates ``replies`` hold, all ranks together.

    Args:
        replies: each rank's reply so far.
    """
    return sum(1 for reply in replies for key in reply.data if ProgressUpdate.is_key(key))


def _publish(output: dict[str, Any]) -> None:
    from IPython.display import publish_display_data

    publish_display_data(output.get("data", {}), output.get("metadata", {}))
