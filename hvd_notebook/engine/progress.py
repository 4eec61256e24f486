"""Engine side of the live dashboard: every rank reports its training progress.

While a ``%%hvd`` cell runs, each rank publishes small progress updates
(``dashboard.message.ProgressUpdate``) on its engine's IOPub channel
(ipyparallel's data publication, ``publish_data``); the
notebook kernel reads them from the cell's results as they arrive and draws the
dashboard (``hvd_notebook.dashboard``). Nothing is written to files.

- ``keras.Model.fit``, ``evaluate`` and ``predict`` get a ``ProgressCallback``
  added on every engine (``install``, through ``keras_patches``), unless the call already has one or the
  cell runs with ``%%hvd --no-progress``; the user's own callbacks are left as
  they are.
- Custom training loops report with ``report(step=..., total=..., **metrics)``.
- Each rank sends at most ``MAX_UPDATES_PER_S`` updates a second (``Throttle``),
  plus one at the end of every epoch and of every run.

Outside an ipyparallel engine (a plain ``mpiexec -n 4 python train.py``) the
callback and ``report`` do nothing, so the same code runs as a batch job.
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from typing import Any

from .. import keras_patches
from ..dashboard.message import ProgressUpdate, RankState, RunKind

MAX_UPDATES_PER_S = 10
KEPT_EPOCHS = 8  # each update repeats the last few epochs' end-of-epoch logs, so none is lost


class Throttle:
    """Lets an event through at most once per ``interval`` seconds; ``force`` always passes."""

    def __init__(self, interval: float = 1.0 / MAX_UPDATES_PER_S, clock: Callable[[], float] = time.monotonic):
        self.interval = interval
        self.clock = clock
        self.last: float | None = None

    def ready(self, force: bool = False) -> bool:
        now = self.clock()
        if force or self.last is None or now - self.last >= self.interval:
            self.last = now
            return True
        return False


class _State:
    """This engine's settings: set by ``install`` (engine bootstrap) and the session."""

    rank: int = 0
    installed: bool = False
    enabled: bool = True  # %%hvd --no-progress turns it off for a cell
    seq = itertools.count()
    runs = itertools.count()
    publish: Callable[[dict[str, Any]], None] | None = None


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


def install(rank: int, keras: bool = True) -> None:
    """Called once per engine by ``engine.bootstrap``: hook Keras (on TensorFlow ranks), remember the rank."""
    _State.rank = rank
    _State.publish = _engine_publisher()
    if keras and not _State.installed:
        install_keras_hooks()
        _State.installed = True


def set_enabled(enabled: bool) -> None:
    """The session turns progress off for ``%%hvd --no-progress`` cells (and back on)."""
    _State.enabled = bool(enabled)


def reporting() -> bool:
    """Does progress reach a dashboard now (inside an engine, in a cell without ``--no-progress``)?"""
    return _State.publish is not None and _State.enabled


def publish(update: ProgressUpdate) -> None:
    """Send one update to the notebook kernel (nothing outside an engine)."""
    if _State.publish is None or not _State.enabled:
        return
    update.seq = next(_State.seq)
    update.rank = _State.rank
    try:
        _State.publish({ProgressUpdate.key(update.seq): update.to_dict()})
    except Exception:  # progress must never break training
        pass


def float_logs(logs: dict[str, Any] | None) -> dict[str, float]:
    """The entries of Keras logs (or report's metrics) that are numbers, as floats."""
    out = {}
    for key, value in (logs or {}).items():
        try:
            out[str(key)] = float(value)
        except (TypeError, ValueError):
            continue
    return out


class RunReport:
    """The progress of one ``fit``/``evaluate``/``predict`` call or custom loop on this rank."""

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
        """Publish this run's state, throttled unless forced or the state is not RUNNING."""
        if not self.throttle.ready(force or state != RankState.RUNNING):
            return
        kept = sorted(self.epoch_logs)[-KEPT_EPOCHS:]
        publish(ProgressUpdate(
            run=self.id, kind=self.kind, state=state, epoch=self.epoch - self.first_epoch, epochs=self.epochs,
            step=self.step, steps=self.steps, samples=self.samples(), elapsed=time.monotonic() - self.start,
            logs=dict(self.logs), epoch_logs={e - self.first_epoch: self.epoch_logs[e] for e in kept},
            first_epoch=self.first_epoch,
        ))

    def end_epoch(self, logs: dict[str, Any] | None) -> None:
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


def callback_class() -> type:
    """``ProgressCallback``, imported on first use: it imports Keras."""
    from .callback import ProgressCallback

    return ProgressCallback


def __getattr__(name: str) -> Any:
    if name == "ProgressCallback":
        return callback_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------ custom loops
class _Custom:
    run: RunReport | None = None
    cell: Any = None


def _current_cell() -> Any:
    """The id of the request this engine is executing (a new cell starts a new run)."""
    try:
        from ipykernel.kernelbase import Kernel

        if Kernel.initialized():
            return Kernel.instance().get_parent().get("header", {}).get("msg_id")
    except Exception:
        pass
    return None


def report(step: int, total: int | None = None, epoch: int | None = None, epochs: int | None = None,
           samples: int | None = None, **metrics: float) -> None:
    """Report a custom training loop's progress to the dashboard (throttled).

    ``step`` counts the completed steps of the current epoch (1 after the first),
    ``total`` is the steps per epoch; ``epoch`` (0-based) and ``epochs`` are for
    loops over several epochs; ``samples`` is this rank's samples so far; every
    other keyword is a metric to plot (``loss=..., accuracy=...``).

    >>> for step in range(1, 101):
    ...     loss = train_step()
    ...     hvd_notebook.progress.report(step=step, total=100, loss=float(loss))
    """
    if _State.publish is None or not _State.enabled:
        return
    cell = _current_cell()
    run = _Custom.run
    if run is None or _Custom.cell != cell or (epoch or 0) < run.epoch:
        run = _Custom.run = RunReport(RunKind.CUSTOM)
        _Custom.cell = cell
        run.epochs = epochs or 1
    elif epochs:
        run.epochs = epochs
    last_epoch = (epoch or 0) + 1 >= (epochs or 1)
    if epoch is not None and epoch != run.epoch:
        if run.epoch not in run.epoch_logs:  # the loop moved on without reporting the last step
            run.epoch_logs[run.epoch] = _custom_epoch_record(run)
        run.epoch, run.epoch_start = epoch, time.monotonic()
        run.epoch_first_sample = run.told_samples or 0
    run.step, run.steps = int(step), total
    run.logs.update(float_logs(metrics))
    if samples is not None:
        run.told_samples = int(samples)
    finished = total is not None and step >= total
    if finished:
        run.epoch_logs[run.epoch] = _custom_epoch_record(run, samples is not None)
    run.update(RankState.DONE if finished and last_epoch else RankState.EPOCH_END if finished else RankState.RUNNING)
    if finished and last_epoch:
        _Custom.run = None


def _custom_epoch_record(run: RunReport, with_samples: bool = True) -> dict[str, float]:
    record = dict(run.logs, time=time.monotonic() - run.epoch_start)
    if with_samples and run.told_samples is not None:
        record["samples"] = run.told_samples - run.epoch_first_sample
    return record


# ------------------------------------------------------------------ Keras hook
def _batch_hint(x: Any, batch_size: int | None) -> tuple[int | None, int | None]:
    """(batch size, samples per epoch) of what ``fit``/``evaluate``/``predict`` was given, where it can tell."""
    try:
        import tensorflow as tf

        if isinstance(x, tf.data.Dataset):
            leaf = tf.nest.flatten(x.element_spec)[0]
            first = leaf.shape[0] if leaf.shape.rank else None
            return (int(first) if first is not None else None), None
    except Exception:
        pass
    if x is None:
        return None, None
    leaves = list(x.values()) if isinstance(x, dict) else list(x) if isinstance(x, (list, tuple)) else [x]
    if leaves and all(hasattr(leaf, "shape") and len(getattr(leaf, "shape", ())) > 0 for leaf in leaves):
        try:
            return batch_size or 32, int(leaves[0].shape[0])
        except (TypeError, ValueError):
            return batch_size or 32, None
    return None, None


def _with_progress(method: Callable[..., Any]) -> Callable[..., Any]:
    import functools
    import inspect

    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _State.publish is None or not _State.enabled:
            return method(self, *args, **kwargs)
        try:
            bound = signature.bind(self, *args, **kwargs)
        except TypeError:
            return method(self, *args, **kwargs)  # let Keras report the bad arguments
        callbacks = bound.arguments.get("callbacks")
        batch_size, num_samples = _batch_hint(bound.arguments.get("x"), bound.arguments.get("batch_size"))
        split = bound.arguments.get("validation_split") or 0.0
        if num_samples and 0 < split < 1:
            num_samples -= int(num_samples * split)  # Keras holds out the last fraction for validation
        cls = callback_class()
        if callbacks is None or isinstance(callbacks, (list, tuple)):
            listed = list(callbacks or [])
            mine = [cb for cb in listed if isinstance(cb, cls)]
            if mine:  # the user placed one: tell it what we know
                for cb in mine:
                    cb.batch_size = cb.batch_size or batch_size
                    cb.num_samples = cb.num_samples or num_samples
            else:
                bound.arguments["callbacks"] = listed + [cls(batch_size, num_samples)]
        return method(*bound.args, **bound.kwargs)

    return wrapper


def install_keras_hooks() -> None:
    """``fit``/``evaluate``/``predict`` add a ``ProgressCallback`` (once per process; see keras_patches)."""
    keras_patches.patch_progress(_with_progress)
