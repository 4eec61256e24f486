"""``ProgressCallback``: the Keras callback that reports a rank's ``fit``,
``evaluate`` and ``predict`` progress to the notebook's dashboard. This module
imports Keras; ``engine.progress`` imports it when the callback is first needed.
"""

from __future__ import annotations

import time
from typing import Any

import keras

from ..dashboard.message import RankState, RunKind
from .progress import RunReport, float_logs


class ProgressCallback(keras.callbacks.Callback):
    """Reports this rank's ``fit``/``evaluate``/``predict`` progress to the
    notebook's dashboard (added by itself in ``%%hvd`` cells; add it yourself
    to control where, e.g. in a model subclass's own ``fit``).

    ``batch_size`` and ``num_samples`` (per epoch) give samples/s where Keras
    does not tell them; without them the dashboard shows steps/s.

    >>> model.fit(dataset, epochs=3, callbacks=[hvd_notebook.ProgressCallback(batch_size=64)])
    """

    def __init__(self, batch_size: int | None = None, num_samples: int | None = None) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.num_samples = num_samples
        self._run: RunReport | None = None
        self._kind: RunKind | None = None

    # -- a run
    def _begin(self, kind: RunKind) -> None:
        if self._kind == RunKind.FIT and kind == RunKind.EVALUATE:
            return  # validation inside fit: its val_ metrics arrive with the epoch's logs
        self._kind = kind
        run = self._run = RunReport(kind, self.batch_size, self.num_samples)
        params = self.params or {}
        run.steps = params.get("steps")
        run.epochs = params.get("epochs", 1) if kind == RunKind.FIT else 1
        run.update(force=True)

    def _batch(self, kind: RunKind, batch: int, logs: dict[str, Any] | None) -> None:
        run = self._run
        if run is None or self._kind != kind:
            return
        run.step = batch + 1
        if logs:
            run.logs.update(float_logs(logs))
        run.update()

    def _end(self, kind: RunKind, logs: dict[str, Any] | None = None) -> None:
        run = self._run
        if run is None or self._kind != kind:
            return
        run.logs.update(float_logs(logs))
        if run.steps is None:
            run.steps = run.step
        if kind != RunKind.FIT:
            run.step = run.steps or run.step
        run.update(RankState.DONE)
        self._run, self._kind = None, None

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
        run.update(force=True)

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
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
