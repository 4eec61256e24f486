"""What crosses between the ranks, the cluster and the kernel, defined once for every side: the progress update
and the rank event (the runtime's stall, warning and commit, ``runtime/core/events.py``) a rank publishes while
a cell runs; the report of a rank's bootstrap; and a row of ``%hvd status``.

Each rank publishes ``ProgressUpdate.to_dict()`` on its engine's IOPub channel
under one of ``RING`` rotating keys ``KEY_PREFIX + str(seq % RING)``; the kernel
reads the ones it has not seen (by ``seq``) with ``ProgressUpdate.from_dict``.
Plain dicts travel, so the kernel needs nothing of the engine to read them.

This module imports nothing of the package and no display library: the runtime, the engines, the cluster, the
kernel and the dashboard import it.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

NOISE_SCALE = "noise_scale"  # the log entry of the gradient noise scale (runtime/core/noise_scale.py)
KEY_PREFIX = "hvd_progress."
EVENT_PREFIX = "hvd_event."
RING = 64  # rotating keys per rank: the kernel polls often enough that none is overwritten unread


class RunKind(enum.StrEnum):
    """What a run is: a Keras call, or a custom loop that calls ``progress.report``."""

    FIT = "fit"
    EVALUATE = "evaluate"
    PREDICT = "predict"
    CUSTOM = "custom"

    @property
    def has_curves(self) -> bool:
        """Training runs draw metric curves over steps; evaluate/predict have one result."""
        return self in (RunKind.FIT, RunKind.CUSTOM)

    @property
    def running_means(self) -> bool:
        """Keras' logs of a batch are means over the epoch's batches so far (reset at each epoch); a custom
        loop's ``progress.report`` metrics and tqdm's ``set_postfix`` numbers are what the user gave."""
        return self in (RunKind.FIT, RunKind.EVALUATE)


class RankState(enum.StrEnum):
    """Where one rank is in a run."""

    RUNNING = "running"
    EPOCH_END = "epoch_end"
    DONE = "done"
    FAILED = "failed"

    @property
    def finished(self) -> bool:
        return self in (RankState.DONE, RankState.FAILED)


class _Published:
    """What both messages share: their plain-dict form, and the ring of keys under ``PREFIX`` they travel under."""

    PREFIX: ClassVar[str]

    def to_dict(self) -> dict[str, Any]:
        """Plain types only, as IOPub serializes them."""
        return {k: v.value if isinstance(v, enum.Enum) else v for k, v in asdict(self).items()}

    @classmethod
    def is_key(cls, key: str) -> bool:
        """Whether a published data key holds a message of this class."""
        return key.startswith(cls.PREFIX)

    @classmethod
    def key(cls, seq: int) -> str:
        return f"{cls.PREFIX}{seq % RING}"


@dataclass
class ProgressUpdate(_Published):
    """One rank's state in one run, as published.

    >>> ProgressUpdate.from_dict(ProgressUpdate("123.0", RunKind.FIT, step=5).to_dict()).step
    5
    """

    run: str  # unique per rank and run: "<pid>.<counter>"
    kind: RunKind
    state: RankState = RankState.RUNNING
    epoch: int = 0  # 0-based, counted from fit's initial_epoch
    epochs: int | None = 1
    step: int = 0  # completed steps of the current epoch
    steps: int | None = None  # steps per epoch, where known
    samples: int | None = None  # this rank's samples so far, where known
    elapsed: float = 0.0
    logs: dict[str, float] = field(default_factory=dict)
    epoch_logs: dict[int, dict[str, float]] = field(default_factory=dict)  # the last few epochs' end logs
    rank: int = 0
    seq: int = 0  # per rank, increasing
    first_epoch: int = 0  # fit's initial_epoch (a training resumed after a reset starts later)
    batch_size: int | None = None  # this rank's samples per step, where known
    # training steps since the last update: [index in the run, wall seconds, seconds in collectives] (a
    # step of several steps' report: their means)
    step_times: list[list[float]] = field(default_factory=list)
    PREFIX = KEY_PREFIX

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ProgressUpdate:
        """An update read back; missing fields take their defaults."""
        return cls(
            run=str(data["run"]), kind=RunKind(data.get("kind", RunKind.FIT)),
            state=RankState(data.get("state", RankState.RUNNING)),
            epoch=int(data.get("epoch", 0)), epochs=data.get("epochs", 1), step=int(data.get("step", 0)),
            steps=data.get("steps"), samples=data.get("samples"), elapsed=float(data.get("elapsed", 0.0)),
            logs={str(k): float(v) for k, v in (data.get("logs") or {}).items()},
            epoch_logs={int(e): dict(logs) for e, logs in (data.get("epoch_logs") or {}).items()},
            rank=int(data.get("rank", 0)), seq=int(data.get("seq", 0)), first_epoch=int(data.get("first_epoch", 0)),
            batch_size=data.get("batch_size"),
            step_times=[[int(i), float(wall), float(comm)] for i, wall, comm in data.get("step_times") or ()],
        )


class EventKind(enum.StrEnum):
    """What a ``RankEvent`` tells: a stall (its fields' ``missing``: the ranks that have not arrived;
    ``debugging``: those in a debugger), another warning of the runtime, an ``hvd.elastic`` commit (its summary;
    "" once there is none to resume from), or a stop at a breakpoint (its fields' ``stop``: the rank's stop
    number, ``where``: the line; ``engine/breakpoints.py``)."""

    STALL = "stall"
    WARNING = "warning"
    COMMIT = "commit"
    BREAKPOINT = "breakpoint"


@dataclass
class RankEvent(_Published):
    """Something a rank tells the kernel while a cell runs (``runtime/core/events.py``): its kind, the sentence
    to show (a commit's summary), and its fields.

    >>> RankEvent.from_dict(RankEvent(EventKind.STALL, "stall: ...", {"missing": [1]}).to_dict()).fields["missing"]
    [1]
    """

    kind: EventKind
    text: str
    fields: dict[str, Any] = field(default_factory=dict)
    rank: int = 0
    seq: int = 0  # per rank, increasing
    PREFIX = EVENT_PREFIX

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankEvent:
        return cls(kind=EventKind(data["kind"]), text=str(data.get("text", "")), fields=dict(data.get("fields") or {}),
                   rank=int(data.get("rank", 0)), seq=int(data.get("seq", 0)))


@dataclass(frozen=True)
class RankReport:
    """What a rank's bootstrap (``engine/bootstrap.py``) reports to the cluster once ``hvd.init()`` ran."""

    rank: int
    size: int
    local_rank: int
    local_size: int
    host: str
    ip: str  # the rank's address on its route to the controller ("" where it has none)
    pid: int
    device: str  # "CPU", "GPU 0", ...
    backend: str  # e.g. "builtin (mpi4py, Open MPI 4.1)"
    framework: str  # e.g. "torch 2.13.0+cpu, torch.distributed gloo"
    intra_op_threads: int
    inter_op_threads: int


class RankActivity(enum.StrEnum):
    """What a rank runs, as ``%hvd status`` says it."""

    IDLE = "idle"
    BUSY = "busy"
    DEAD = "dead"
    UNKNOWN = "unknown"  # the controller did not answer


@dataclass(frozen=True)
class RankStatus:
    """One row of ``%hvd status``: a rank's process, its memory and what it runs."""

    rank: int
    alive: bool
    host: str
    pid: int
    device: str
    rss: int | None  # bytes of host memory (None: on another host, or gone)
    gpu_memory: int | None  # bytes of GPU memory (None: no GPU, or not known here)
    running: RankActivity

    @property
    def state(self) -> str:
        return "alive" if self.alive else "dead"
