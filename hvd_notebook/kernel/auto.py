"""``%hvd auto on``: every cell runs on the ranks, as a ``%%hvd`` cell without the magic line (what
ipyparallel's ``%autopx`` does for its engines). One of the IPython shell's input transformers, which see
each cell before it runs, puts the magic line in front of it; cells that start with ``%`` are left alone."""

from __future__ import annotations

from typing import Any

from ..config import PREFIX

AUTO_OPTION = "--auto"  # the (hidden) option of the %%hvd line put in front of each cell
_MAGIC_LINE = f"%%hvd {AUTO_OPTION}\n"


class AutoCells:
    """While ``on``, a cell whose first line does not start with ``%`` is run as ``%%hvd --auto`` and the cell;
    cells of line magics (``%hvd status``, ``%time ...``) and ``%%`` cells (``%%hvd``, ``%%bash``) run as
    they are, and so does what a magic transforms itself while a cell runs (``%time``'s statement).

    >>> auto = AutoCells(get_ipython()).install()
    >>> auto.on = True  # %hvd auto on: the next cell "print(hvd.rank())" prints on the ranks

    Args:
        shell: the IPython shell whose cells are rewritten.
    """

    has_side_effects = True  # (IPython: leave it out where it only checks whether an input is complete)

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.on = False
        self._executing = 0  # cells running now (pre_execute .. post_execute); a transform meanwhile is a magic's

    def __call__(self, lines: list[str]) -> list[str]:
        """The input transformer: the cell's lines (blank lines and indentation before them removed)."""
        if not self.on or self._executing or not "".join(lines).strip() or lines[0].startswith("%"):
            return lines
        return [_MAGIC_LINE, *lines]

    def install(self) -> AutoCells:
        """Put the transformer among the shell's (after IPython's own clean-up) and follow its cells."""
        self.shell.input_transformers_cleanup.append(self)
        self.shell.events.register("pre_execute", self._began)
        self.shell.events.register("post_execute", self._ended)
        return self

    def uninstall(self) -> None:
        """Take it out of the shell again (``%unload_ext hvd_notebook``)."""
        self.on = False
        transformers = self.shell.input_transformers_cleanup
        transformers[:] = [t for t in transformers if t is not self]
        for event, callback in (("pre_execute", self._began), ("post_execute", self._ended)):
            if callback in self.shell.events.callbacks[event]:
                self.shell.events.unregister(event, callback)

    def _began(self) -> None:
        self._executing += 1

    def _ended(self) -> None:
        # (a blank cell ends without having begun)
        self._executing = max(0, self._executing - 1)


def ran_on(n: int) -> str:
    """The line an auto cell's output starts with.

    Args:
        n: the number of ranks the cell ran on.
    """
    return f"{PREFIX} auto: runs on {n} ranks"


def state(on: bool) -> str:
    """What ``%hvd auto`` says it did, and ``%hvd status`` says while it is on.

    Args:
        on: whether auto cells are on.
    """
    if on:
        return ("auto: on: every cell runs on the ranks, except those that start with % (%hvd ..., %time ...); "
                "%hvd auto off ends it")
    return "auto: off: cells run in this kernel again (%%hvd cells on the ranks)"
