"""The rank's side of ``%hvd debug``: pdb (IPython's, as ``%debug`` uses) on the traceback of this rank's
last failed cell, driven one command at a time by the notebook's kernel, which reads each command from the
notebook's input box. The debugger keeps its place between commands and hands back what it printed; between
commands the rank is idle and its other work (and the other ranks) are untouched.

>>> begin()                  # where the cell failed, as pdb shows it
>>> step("p secret")         # ("42\\n", False)
>>> step("q")                # ("", True): the session is over
"""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Any

# commands that would read this rank's own stdin (nobody types there) or start a program: refused
REFUSED = ("interact", "debug", "run", "restart")


def refusal(line: str, where: str) -> str | None:
    """pdb's message refusing ``line`` where its command is one of ``REFUSED`` (``where``: "%hvd debug", "a
    rank's debugger"); None where it may run.

    Args:
        line: the pdb command asked for.
        where: who asks, for the message ("%hvd debug", "a rank's debugger").
    """
    command = line.strip().split(" ", 1)[0]
    return f"*** {command} is not available in {where}" if command in REFUSED else None


class _Session:
    debugger: Any = None
    out: io.StringIO | None = None


def begin() -> str | None:
    """Open pdb on this rank's last failed cell: where it failed, as text; None where no cell failed here."""
    tb = getattr(sys, "last_traceback", None)
    if tb is None:
        return None
    from IPython.core.debugger import Pdb

    out = io.StringIO()
    debugger = Pdb(stdout=out)
    debugger.reset()
    with contextlib.redirect_stdout(out):
        debugger.setup(None, tb)
        debugger.print_stack_entry(debugger.stack[debugger.curindex])
    _Session.debugger, _Session.out = debugger, out
    return out.getvalue()


def step(line: str) -> tuple[str, bool]:
    """Run one pdb command: what it printed, and whether the session is over (``q``, ``c``, or a command
    that would run the program on).

    Args:
        line: the pdb command to run.
    """
    debugger, out = _Session.debugger, _Session.out
    if debugger is None or out is None:
        return "*** no debugging session on this rank: run %hvd debug\n", True
    out.seek(0)
    out.truncate()
    refused = refusal(line, "%hvd debug")
    if refused:
        return refused + "\n", False
    with contextlib.redirect_stdout(out):
        line = debugger.precmd(line)
        stop = debugger.postcmd(debugger.onecmd(line), line)
    if stop:
        end()
    return out.getvalue(), bool(stop)


def end() -> None:
    """Forget the session (and the frames it held)."""
    if _Session.debugger is not None:
        _Session.debugger.forget()
    _Session.debugger = _Session.out = None
