"""A start that waits in the node's queue for GPUs (``cluster/node/queue.py``), shown in its cell: one line
that updates in place (a display output that the front end replaces by its id) with the place, who holds the
GPUs and since when; where no front end shows outputs (IPython in a terminal), the queue's own text lines."""

from __future__ import annotations

from typing import Any

from IPython.display import display

from ..cluster.node import queue


class CellLine(queue.Shown):
    """The wait's line in the running cell, replaced as the place changes, and by the outcome at the end."""

    def __init__(self) -> None:
        self._handle: Any = None
        self._last: str | None = None

    def update(self, text: str) -> None:
        """Show ``text`` in the cell's line (a new line the first time).

        Args:
            text: the place, who holds the GPUs and since when.
        """
        if text == self._last:
            return
        self._last = text
        if self._handle is None:
            self._handle = display({"text/plain": text}, raw=True, display_id=True)
        else:
            self._handle.update({"text/plain": text}, raw=True)

    def close(self, text: str) -> None:
        """The wait ended: its line says how (served, or left the queue).

        Args:
            text: what happened.
        """
        if self._handle is not None:
            self.update(text)


def install(shell: Any) -> None:
    """Waits show as a line in the cell where ``shell`` is a kernel's (a front end shows and updates outputs).

    Args:
        shell: the IPython shell that loads the extension.
    """
    if getattr(shell, "kernel", None) is not None:
        queue.set_display(CellLine)
