"""The seconds this process has spent in collectives: where a step's time goes.

Every collective of every backend takes its turn through ``negotiation.Negotiator``, which calls ``enter()``
when a call starts (before agreeing with the other ranks) and ``leave()`` once its data has moved (or it
failed). The clock counts the seconds during which at least one call is under way, the union of their
intervals, so calls that overlap in several threads (Keras's step, asynchronous handles) count once. It
holds the wait for the other ranks (the agreement) and the host's side of the data movement; a GPU stream's
own time (NCCL) runs after the call returns and is not in it. A world of one rank has no collectives.

The progress reporter reads ``seconds()`` at each training step's end (``engine/reporter.py``).
"""

from __future__ import annotations

import threading
import time


class CollectiveClock:
    """Seconds during which at least one collective was under way (the union of the calls' intervals).

    >>> clock = CollectiveClock()
    >>> clock.enter(); clock.enter(); clock.leave(); clock.leave()  # two overlapping calls
    >>> clock.active, clock.seconds() >= 0
    (0, True)
    """

    __slots__ = ("_lock", "active", "_since", "_total")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.active = 0  # calls under way now
        self._since = 0.0  # when the current union interval began (while active)
        self._total = 0.0  # the seconds of the union intervals that ended

    def enter(self) -> None:
        """A collective call starts."""
        lock = self._lock
        lock.acquire()
        if not self.active:
            self._since = time.perf_counter()
        self.active += 1
        lock.release()

    def leave(self) -> None:
        """A collective call ended (returned or raised): pairs one ``enter``."""
        lock = self._lock
        lock.acquire()
        self.active -= 1
        if not self.active:
            self._total += time.perf_counter() - self._since
        lock.release()

    def seconds(self) -> float:
        """The seconds counted so far, a call under way now included."""
        with self._lock:
            return self._total + (time.perf_counter() - self._since if self.active else 0.0)


CLOCK = CollectiveClock()  # this process's: every negotiator enters and leaves it
enter, leave = CLOCK.enter, CLOCK.leave


def seconds() -> float:
    """The seconds this process has spent in collectives so far (waiting for the other ranks and moving data
    on the host), overlapping calls counted once; the step's share is the difference of two readings.

    >>> before = seconds(); hvd.allreduce(grads); in_it = seconds() - before
    """
    return CLOCK.seconds()
