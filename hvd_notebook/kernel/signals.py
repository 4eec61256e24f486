"""SIGINT (the notebook's stop button) while a cell runs: a flag the cell's loop reads, or, where the kernel
waits for the user's input, KeyboardInterrupt again."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def _sigint(handler: Any) -> Iterator[None]:
    """SIGINT goes to ``handler`` within; only in the main thread, which signal handlers belong to (a cell run
    elsewhere cannot be interrupted)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous if previous is not None else signal.default_int_handler)


def interrupts_raise() -> contextlib.AbstractContextManager[None]:
    """Within ``interrupts_as_a_flag``: SIGINT raises KeyboardInterrupt again (where the kernel waits for the
    user's input, which only an exception ends)."""
    return _sigint(signal.default_int_handler)


@contextlib.contextmanager
def interrupts_as_a_flag() -> Iterator[threading.Event]:
    """While a cell runs, SIGINT (the notebook's stop button) sets an event instead of raising
    KeyboardInterrupt wherever the kernel happens to be: raised inside a finalizer (``__del__`` of a
    zmq object) it would be printed as "ignored" and lost, and the cell would wait on
    for its blocked ranks. Further interrupts while the ranks are being stopped change nothing."""
    interrupted = threading.Event()
    with _sigint(lambda signum, frame: interrupted.set()):
        yield interrupted
