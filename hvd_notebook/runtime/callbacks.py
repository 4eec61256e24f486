"""Keras callbacks for data-parallel training, as ``horovod.tensorflow.keras.callbacks``."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from .collectives import allreduce, broadcast_variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Make every rank start from ``root_rank``'s weights and optimizer state.

    >>> model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

    Broadcasts at the start of training (so a model restored or initialised on
    the root only is shared too), and once more after the first batch if the
    optimizer created its variables only then.
    """

    def __init__(self, root_rank: int = 0, device: str = "") -> None:
        super().__init__()
        self.root_rank = root_rank
        self._optimizer_done = False

    def _broadcast(self) -> None:
        variables = list(self.model.variables)
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            variables += list(optimizer.variables)
            self._optimizer_done = True
        broadcast_variables(variables, root_rank=self.root_rank)

    def on_train_begin(self, logs: Any = None) -> None:
        self._broadcast()

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self._optimizer_done:
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Replace each epoch's metrics by their mean over all ranks, so every rank
    logs (and every later callback sees) the same figures.

    Put it before callbacks that read the metrics (checkpointing, early stopping)."""

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs:
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = allreduce(np.array([float(logs[k]) for k in keys], dtype=np.float64), name="metric_average")
        for k, v in zip(keys, values):
            logs[k] = float(v)


__all__ = ["BroadcastGlobalVariablesCallback", "MetricAverageCallback"]
