"""The Keras adapter of the progress reporter: ``ProgressCallback``, the callback that reports a rank's
``fit``, ``evaluate`` and ``predict`` progress to the notebook's dashboard, and the hook that adds one to
every such call (unless the call has one, or the cell runs with ``%%hvd --no-progress``; the user's own
callbacks are left as they are). This module imports Keras (the one ``keras_flavour`` names): only TensorFlow
ranks import it.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import Any

from .. import keras_flavour, keras_patches
from ..messages import RankState, RunKind
from .reporter import RunReport, float_logs, reporting

keras = keras_flavour.keras()  # (Keras 3, or Keras 2's tf_keras where TF_USE_LEGACY_KERAS asks for it)


class ProgressCallback(keras.callbacks.Callback):
    """Reports this rank's ``fit``/``evaluate``/``predict`` progress to the
    notebook's dashboard (added by itself in ``%%hvd`` cells; add it yourself
    to control where, e.g. in a model subclass's own ``fit``).

    ``batch_size`` and ``num_samples`` (per epoch) give samples/s where Keras
    does not tell them; without them the dashboard shows steps/s.

    >>> model.fit(dataset, epochs=3, callbacks=[hvd_notebook.ProgressCallback(batch_size=64)])

    Args:
        batch_size: this rank's samples per step, where Keras does not tell them.
        num_samples: this rank's samples per epoch.

    Its ``on_*`` methods are Keras's hooks: their ``epoch``, ``batch`` and ``logs`` are as
    ``keras.callbacks.Callback`` documents them.
    """

    def __init__(self, batch_size: int | None = None, num_samples: int | None = None) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_samples = num_samples
        self._run: RunReport | None = None

    # -- a run
    def _begin(self, kind: RunKind) -> None:
        if kind == RunKind.EVALUATE and self._run is not None and self._run.kind == RunKind.FIT:
            return  # validation inside fit: its val_ metrics arrive with the epoch's logs
        run = self._run = RunReport(kind, self.batch_size, self.num_samples)
        params = self.params or {}
        run.steps = params.get("steps")
        run.epochs = params.get("epochs", 1) if kind == RunKind.FIT else 1
        run.update(force=True)

    def _batch(self, kind: RunKind, batch: int, logs: dict[str, Any] | None) -> None:
        run = self._run
        if run is None or run.kind != kind:
            return
        run.step = batch + 1
        if logs:
            run.logs.update(float_logs(logs))
        run.update()

    def _end(self, kind: RunKind, logs: dict[str, Any] | None = None) -> None:
        run = self._run
        if run is None or run.kind != kind:
            return
        run.logs.update(float_logs(logs))
        if run.steps is None:
            run.steps = run.step
        if kind != RunKind.FIT:
            run.step = run.steps or run.step
        run.update(RankState.DONE)
        self._run = None

    # -- fit
    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._begin(RunKind.FIT)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        run = self._run
        if run is None:
            return
        if not run.epoch_logs and run.epoch == 0:
            run.first_epoch = epoch  # fit(initial_epoch=k)
            if run.epochs is not None:
                run.epochs -= epoch
        run.epoch, run.step, run.epoch_start, run.epoch_closed = epoch, 0, time.monotonic(), False
        if run.steps_timed:  # (the run's first step traces the step function: its end starts the timing)
            run.start_steps()
        run.update(force=True)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        run = self._run
        if run is not None and run.kind == RunKind.FIT:
            run.end_steps(max(batch + 1 - run.step, 1))  # (steps_per_execution > 1: several steps a batch)
        self._batch(RunKind.FIT, batch, logs)

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        run = self._run
        if run is None:
            return
        if run.steps is None:
            run.steps = run.step  # learnt from the first epoch
        run.end_epoch(logs)

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self._end(RunKind.FIT, logs)

    # -- evaluate and predict
    def on_test_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._begin(RunKind.EVALUATE)

    def on_test_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._batch(RunKind.EVALUATE, batch, logs)

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        self._end(RunKind.EVALUATE, logs)

    def on_predict_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._begin(RunKind.PREDICT)

    def on_predict_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._batch(RunKind.PREDICT, batch, None)

    def on_predict_end(self, logs: dict[str, Any] | None = None) -> None:
        self._end(RunKind.PREDICT)


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
    signature = inspect.signature(method)

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not reporting():
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
        if callbacks is None or isinstance(callbacks, (list, tuple)):
            listed = list(callbacks or [])
            mine = [cb for cb in listed if isinstance(cb, ProgressCallback)]
            if mine:  # the user placed one: tell it what we know
                for cb in mine:
                    cb.batch_size = cb.batch_size or batch_size
                    cb.num_samples = cb.num_samples or num_samples
            else:
                bound.arguments["callbacks"] = listed + [ProgressCallback(batch_size, num_samples)]
        return method(*bound.args, **bound.kwargs)

    return wrapper


def install() -> None:
    """``fit``/``evaluate``/``predict`` add a ``ProgressCallback`` (once per process; see keras_patches); called by
    ``engine.bootstrap`` on TensorFlow ranks."""
    keras_patches.patch_progress(_with_progress)
