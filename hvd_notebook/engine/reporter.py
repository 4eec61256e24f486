"""Engine side of the live dashboard: the reporter every progress adapter publishes through.

While a ``%%hvd`` cell runs, each rank publishes small progress updates (``messages.ProgressUpdate``)
on its engine's IOPub channel (ipyparallel's data publication, ``publish_data``); the notebook kernel reads
them from the cell's results as they arrive and draws the dashboard (``hvd_notebook.dashboard``). Nothing
is written to files. This module holds what every adapter shares: the engine's settings (rank, on or off for
``%%hvd --no-progress``), the publication, the throttle (at most ``MAX_UPDATES_PER_S`` updates a second per
rank, plus one at the end of every epoch and of every run) and ``RunReport``, one run's state. The adapters
feed it: ``keras_progress`` (``fit``/``evaluate``/``predict``), ``custom_loops`` (``report``) and
``tqdm_bars``. Training runs also time each step: its wall seconds and the seconds in collectives within it
(the runtime's ``collective_time``, read through ``collective_seconds`` so that the kernel side never
imports the runtime), sent as the steps since the last update. Outside an ipyparallel engine (a plain
``mpiexec -n 4 python train.py``) nothing is published, so the same code runs as a batch job.
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..messages import NOISE_SCALE, ProgressUpdate, RankEvent, RankState, RunKind

MAX_UPDATES_PER_S = 10
KEPT_EPOCHS = 8  # each update repeats the last few epochs' end-of-epoch logs, so none is lost
KEPT_STEP_TIMES = 256  # the most recent steps' times an update carries (those since the last update)


class Throttle:
    """Lets an event through at most ``MAX_UPDATES_PER_S`` times a second; ``force`` always passes.

    Args:
        clock: the clock it reads (``time.monotonic`` by default; a test's own).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.last: float | None = None

    def ready(self, force: bool = False) -> bool:
        """Whether this event goes through now (and, if so, the time of the last one is now).

        Args:
            force: let it through whatever the rate.
        """
        now = self.clock()
        if force or self.last is None or now - self.last >= 1.0 / MAX_UPDATES_PER_S:
            self.last = now
            return True
        return False


class _State:
    """This engine's settings: set by ``install`` (engine bootstrap) and the session."""

    rank: int = 0
    enabled: bool = True  # %%hvd --no-progress turns it off for a cell
    seq = itertools.count()
    events = itertools.count()
    runs = itertools.count()
    publish: Callable[[dict[str, Any]], None] | None = None
    noise_scale: Callable[[int | None], float | None] = staticmethod(lambda batch_size: None)
    tell_batch: Callable[[int], None] = staticmethod(lambda batch_size: None)
    collective_seconds: Callable[[], float | None] = staticmethod(lambda: None)


def _engine_publisher() -> Callable[[dict[str, Any]], None] | None:
    """ipyparallel's ``publish_data`` where this process is an engine's kernel, else None."""
    try:
        from ipykernel.zmqshell import ZMQInteractiveShell

        if not ZMQInteractiveShell.initialized():
            return None
        shell = ZMQInteractiveShell.instance()
        if getattr(shell, "data_pub", None) is None:
            return None
        return shell.data_pub.publish_data
    except Exception:
        return None


def install(rank: int) -> None:
    """Called once per engine by ``engine.bootstrap``: remember the rank, find the engine's publication, and
    send the runtime's events (stalls, warnings) to the kernel with it instead of printing them.

    Args:
        rank: this engine's rank, sent with every update.
    """
    from ..runtime.core import collective_time, events, noise_scale

    _State.rank = rank
    _State.noise_scale = staticmethod(noise_scale.noise_scale)
    _State.tell_batch = staticmethod(noise_scale.tell_batch)
    _State.collective_seconds = staticmethod(collective_time.seconds)
    _State.publish = _engine_publisher()
    if _State.publish is not None:
        events.listen(publish_event)


def publish_event(kind: str, text: str, fields: dict[str, Any]) -> None:
    """Send one of the runtime's events to the kernel (whether or not progress is on: it is no progress).
    Raises where it cannot, so that the runtime prints the event instead.

    Args:
        kind: the event's kind (``stall``, ``warning``, ...).
        text: what the dashboard shows.
        fields: the event's data, as the runtime gives it.
    """
    seq = next(_State.events)
    _State.publish({RankEvent.key(seq): RankEvent(kind, text, fields, _State.rank, seq).to_dict()})


def measured_noise_scale(batch_size: int | None) -> float | None:
    """The gradient noise scale this rank's distributed optimizer measured last (``hvd.noise_scale``).

    Args:
        batch_size: this rank's batch per step; None: no noise scale.
    """
    return _State.noise_scale(batch_size)


def tell_batch(batch_size: int) -> None:
    """The loop's batch per rank, as it told the dashboard: ``hvd.noise_scale()`` takes it from now on.

    Args:
        batch_size: this rank's samples per step.
    """
    _State.tell_batch(batch_size)


def collective_seconds() -> float | None:
    """The seconds this rank has spent in the runtime's collectives so far (``runtime.core.collective_time``);
    None outside an engine whose runtime counts them."""
    return _State.collective_seconds()


def set_enabled(enabled: bool) -> None:
    """The session turns progress off for ``%%hvd --no-progress`` cells (and back on).

    Args:
        enabled: whether this cell reports progress.
    """
    _State.enabled = bool(enabled)


def reporting() -> bool:
    """Does progress reach a dashboard now (inside an engine, in a cell without ``--no-progress``)?"""
    return _State.publish is not None and _State.enabled


def publish(update: ProgressUpdate) -> None:
    """Send one update to the notebook kernel (nothing outside an engine).

    Args:
        update: the progress of this rank (one typed message, ``messages.ProgressUpdate``).
    """
    if not reporting():
        return
    update.seq = next(_State.seq)
    update.rank = _State.rank
    try:
        _State.publish({ProgressUpdate.key(update.seq): update.to_dict()})
    except Exception:  # progress must never break training
        pass


def float_logs(logs: dict[str, Any] | None) -> dict[str, float]:
    """The entries of Keras logs (or report's metrics) that are numbers, as floats; a noise scale not measured
    yet (NaN) is left out.

    Args:
        logs: Keras's logs, or ``report``'s metrics.
    """
    out = {}
    for key, value in (logs or {}).items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError):
            continue
        if key == NOISE_SCALE and not math.isfinite(out[key]):
            del out[key]
    return out


class RunReport:
    """The progress of one ``fit``/``evaluate``/``predict`` call or custom loop on this rank.

    Args:
        kind: ``fit``, ``evaluate``, ``predict`` or ``custom`` (a loop that calls ``progress.report``).
        batch_size: this rank's samples per step, where known.
        num_samples: this rank's samples per epoch, where known.
    """

    def __init__(self, kind: RunKind, batch_size: int | None = None, num_samples: int | None = None) -> None:
        self.id = f"{os.getpid()}.{next(_State.runs)}"
        self.kind = kind
        self.batch_size = batch_size
        self.num_samples = num_samples  # per epoch, where known
        self.start = time.monotonic()
        self.epoch = 0
        self.first_epoch = 0
        self.epochs: int | None = 1
        self.step = 0
        self.steps: int | None = None
        self.samples_before = 0  # samples of the completed epochs
        self.epoch_closed = False  # the current epoch's samples are in samples_before already
        self.told_samples: int | None = None  # custom loops: the samples report() was given
        self.epoch_first_sample = 0  # custom loops: told_samples when the epoch began
        self.logs: dict[str, float] = {}
        self.epoch_logs: dict[int, dict[str, float]] = {}
        self.epoch_start = self.start
        self.throttle = Throttle()
        self.steps_timed = 0  # training steps whose times were recorded or skipped (the next one's index)
        self.step_times: deque[list[float]] = deque(maxlen=KEPT_STEP_TIMES)  # not published yet
        self._step_mark: tuple[float, float] | None = None  # (clock, collective seconds) where the next began

    def start_steps(self) -> None:
        """The next training step starts now (a run's or an epoch's beginning: what came before it, such as
        validation, is no step)."""
        collective = collective_seconds()
        self._step_mark = None if collective is None else (time.perf_counter(), collective)

    def end_steps(self, count: int = 1) -> None:
        """``count`` training steps ended now: record their wall and collective seconds (per step) since the
        last mark, under the index of the last one, and mark the next's start. Nothing before a mark.

        Args:
            count: how many steps ended since the last mark.
        """
        if count < 1:
            return
        mark = self._step_mark
        self.start_steps()
        self.steps_timed += count
        if mark is None or self._step_mark is None:
            return
        (t0, c0), (t1, c1) = mark, self._step_mark
        self.step_times.append([self.steps_timed - 1, round((t1 - t0) / count, 6), round((c1 - c0) / count, 6)])

    def epoch_samples(self) -> int | None:
        if self.batch_size is None:
            return None
        done = self.step * self.batch_size
        return min(done, self.num_samples) if self.num_samples else done

    def samples(self) -> int | None:
        if self.told_samples is not None:
            return self.told_samples
        current = self.epoch_samples()
        if current is None:
            return None
        return self.samples_before + (0 if self.epoch_closed else current)

    def update(self, state: RankState = RankState.RUNNING, force: bool = False) -> None:
        """Publish this run's state, throttled unless forced or the state is not RUNNING.

        Args:
            state: the run's state (running, done, failed).
            force: publish now, whatever the throttle says.
        """
        if not self.throttle.ready(force or state != RankState.RUNNING):
            return
        kept = sorted(self.epoch_logs)[-KEPT_EPOCHS:]
        publish(ProgressUpdate(
            run=self.id, kind=self.kind, state=state, epoch=self.epoch - self.first_epoch, epochs=self.epochs,
            step=self.step, steps=self.steps, samples=self.samples(), elapsed=time.monotonic() - self.start,
            logs=dict(self.logs), epoch_logs={e - self.first_epoch: self.epoch_logs[e] for e in kept},
            first_epoch=self.first_epoch, batch_size=self.batch_size, step_times=list(self.step_times),
        ))
        self.step_times.clear()

    def end_epoch(self, logs: dict[str, Any] | None) -> None:
        """An epoch ended: its metrics and time recorded for the dashboard's table.

        Args:
            logs: Keras's logs at the epoch's end (its metrics).
        """
        self.logs.update(float_logs(logs))
        record = dict(self.logs)
        record["time"] = time.monotonic() - self.epoch_start
        self.step = self.steps or self.step
        samples = self.epoch_samples()
        if samples is not None:
            record["samples"] = samples
        self.epoch_logs[self.epoch] = record
        self.update(RankState.EPOCH_END)
        self.samples_before += samples or 0
        self.epoch_closed = True
