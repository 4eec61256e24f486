"""What a rank tells whoever watches it, as typed events: a stall (with the ranks that have not arrived),
another warning of the runtime, an ``hvd.elastic`` commit (rank 0's, once it is on disk; its summary, or
"" when the run returned and its commit was removed: nothing to resume from). ``emit`` hands
each to the listener that an engine installs (``engine/reporter.py`` publishes it to the notebook's kernel
beside the progress updates, as a ``messages.RankEvent``); without one (a plain ``mpiexec`` run,
``hvd-notebook run``) a warning or stall is printed to stderr with the prefix of the runtime's warnings, and
a commit is not (``hvd-notebook run`` finds the commit itself, on disk, when it relaunches)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ... import config
from ...messages import EventKind

PRINTED = (EventKind.STALL, EventKind.WARNING)  # the kinds printed where nobody listens

Listener = Callable[[EventKind, str, dict[str, Any]], None]
_listener: Listener | None = None


def listen(listener: Listener | None) -> None:
    """Send every event to ``listener(kind, text, fields)`` from now on (None: print them again)."""
    global _listener
    _listener = listener


def emit(kind: EventKind, text: str, **fields: Any) -> None:
    """Tell the listener, or print ``text`` as a warning where there is none (or it fails: a warning is never
    lost, and never breaks the collective that tells it); an event of a kind not ``PRINTED`` is dropped then."""
    listener = _listener
    if listener is not None:
        try:
            listener(kind, text, fields)
            return
        except Exception:
            pass
    if kind in PRINTED:
        print(f"{config.WARNING_PREFIX}: {text}", file=sys.stderr, flush=True)
