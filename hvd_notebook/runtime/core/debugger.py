"""``hvd.breakpoint(rank=R)``: stop one rank (or every rank) in the debugger; and ``renew``, which gives the
ranks fresh collectives after a debugged rank quit while the others waited for it in a collective.

>>> hvd.breakpoint(rank=1)   # rank 1 stops here (in a notebook: pdb driven from it); the others go on
"""

from __future__ import annotations

import os
import sys

from . import world as _world


def breakpoint(rank: int | None = None) -> None:  # (named as the builtin, as torch.distributed.breakpoint)
    """Stop this rank at the caller's line in the debugger, as the builtin ``breakpoint()`` does.

    With ``rank``, only that rank stops. The other ranks go on, and wait for it in their next collective. In a
    notebook, the stopped rank's debugger is driven from the notebook.

    >>> hvd.breakpoint(rank=1)   # rank 1 stops here; the others go on

    Args:
        rank: the global rank that stops. The default, None, stops every rank that calls it.

    Raises:
        ValueError: ``rank`` is given and the runtime is not initialised.
    """
    if rank is not None and int(rank) != _world.current().rank:
        return
    frame, hook = sys._getframe(1), sys.breakpointhook
    if getattr(hook, "takes_frame", False):
        hook(frame=frame)  # an engine's (engine/breakpoints.py)
    elif hook is sys.__breakpointhook__ and os.environ.get("PYTHONBREAKPOINT", "") == "":
        import pdb

        pdb.Pdb().set_trace(frame)
    else:
        hook()


def broken() -> bool:
    """Whether this rank's collectives were abandoned half-way (a rank interrupted while it waited for one that
    never came): every later collective would be refused."""
    if not _world.is_initialized():
        return False
    world = _world.current()
    sets = world.process_sets.backends.values() if world.process_sets is not None else ()
    return any(backends.negotiator.broken for backends in [world, *sets])


def renew() -> None:
    """A new world on the communicator of this one, its variables kept (collective: every rank calls it, none
    in a collective): what a cell that ended while a rank waited in a collective leaves behind is dropped.
    Process sets added since ``init`` are dropped too."""
    if _world.is_initialized():
        from . import basics

        basics.init(comm=_world.shutdown(resetting=True))
