"""Chrome-trace timeline of the runtime's collectives, one track per rank.

Like Horovod's ``HOROVOD_TIMELINE``, each collective is recorded as its
phases (``NEGOTIATE_ALLREDUCE``, ``MEMCPY_IN_FUSION_BUFFER``,
``MPI_ALLREDUCE``, ...) with the tensor names and sizes. Unlike Horovod, every
rank records: ``stop_timeline()`` gathers all ranks' events to rank 0, which
writes one JSON file that Perfetto and chrome://tracing load, with a process
track per rank. With ``mark_cycles`` (``HOROVOD_TIMELINE_MARK_CYCLES``) each
agreement round is marked by an instant event, ``CYCLE_START``, as Horovod
marks its background thread's cycles.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any


class Timeline:
    """Records phases while active; cheap no-ops while not."""

    __slots__ = ("path", "events", "mark_cycles")

    def __init__(self) -> None:
        self.path: str | None = None
        self.events: list[dict[str, Any]] = []
        self.mark_cycles = False

    @property
    def active(self) -> bool:
        return self.path is not None

    def start(self, path: str, mark_cycles: bool = False) -> None:
        self.path = str(path)
        self.mark_cycles = mark_cycles
        self.events = []

    def phase(self, name: str, tensors: str, nbytes: int) -> _Phase | contextlib.nullcontext[None]:
        """Record one phase of a collective (a Chrome-trace complete event) as a ``with`` block."""
        if self.path is None:
            return _NO_PHASE
        return _Phase(self.events, name, tensors, nbytes)

    def mark_cycle(self, number: int) -> None:
        """Mark the start of agreement round ``number`` (where ``mark_cycles`` asks for it)."""
        if self.path is not None and self.mark_cycles:
            self.events.append({"name": "CYCLE_START", "ph": "i", "s": "p", "ts": time.time_ns() / 1000, "tid": 0,
                                "args": {"collective": number}})

    def take(self) -> tuple[str | None, list[dict[str, Any]]]:
        """Stop recording; return the path and this rank's events."""
        path, events = self.path, self.events
        self.path, self.events = None, []
        return path, events


_NO_PHASE = contextlib.nullcontext()  # what ``phase`` returns while the timeline is off: no object per call


class _Phase:
    def __init__(self, events: list[dict[str, Any]], name: str, tensors: str, nbytes: int) -> None:
        self.events, self.name, self.tensors, self.nbytes = events, name, tensors, nbytes

    def __enter__(self) -> None:
        self.start = time.time_ns()

    def __exit__(self, *exc: object) -> None:
        self.events.append({
            "name": self.name, "ph": "X", "ts": self.start / 1000, "dur": (time.time_ns() - self.start) / 1000,
            "tid": 0, "args": {"tensors": self.tensors, "bytes": self.nbytes},
        })


def write_trace(path: str, events_by_rank: list[list[dict[str, Any]]]) -> None:
    """Write all ranks' events as one Chrome-trace file, a process track per rank."""
    trace: list[dict[str, Any]] = []
    for rank, events in enumerate(events_by_rank):
        trace.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        trace.extend({**e, "pid": rank} for e in events)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps({"traceEvents": trace, "displayTimeUnit": "ms"}))
