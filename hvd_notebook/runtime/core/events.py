"""What a rank tells whoever watches it, as typed events: a stall (with the ranks that have not arrived),
another warning of the runtime. ``emit`` hands each to the listener that an engine installs
(``engine/reporter.py`` publishes it to the notebook's kernel beside the progress updates, as a
``dashboard.message.RankEvent``); without one (a plain ``mpiexec`` run, ``hvd-notebook run``) it is printed
to stderr with the prefix of the runtime's warnings."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ... import config

STALL, WARNING = "stall", "warning"

Listener = Callable[[str, str, dict[str, Any]], None]
_listener: Listener | None = None


def listen(listener: Listener | None) -> None:
    """Send every event to ``listener(kind, text, fields)`` from now on (None: print them again)."""
    global _listener
    _listener = listener


def emit(kind: str, text: str, **fields: Any) -> None:
    """Tell the listener, or print ``text`` as a warning where there is none (or it fails: a warning is never
    lost, and never breaks the collective that tells it)."""
    listener = _listener
    if listener is not None:
        try:
            listener(kind, text, fields)
            return
        except Exception:
            pass
    print(f"{config.WARNING_PREFIX}: {text}", file=sys.stderr, flush=True)
