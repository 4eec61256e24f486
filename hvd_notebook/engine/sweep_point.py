"""One point of a ``%%hvd sweep``, as the ranks see it: the cell's code reads its settings from ``point``.

The kernel makes the grid of points and pushes each to the ranks of the point's world under the name
``point`` before the cell's code runs there. Plain Python (Keras is imported only by ``callbacks``), so
that both sides can unpickle it.

>>> point = SweepPoint(ranks=2, batch=64, lr_rule="linear", warmup=2, base_batch=32)
>>> point.global_batch, point.lr(0.01)
(128, 0.04)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

LR_RULES = ("none", "linear", "sqrt")


@dataclass(frozen=True)
class SweepPoint:
    """Ranks, per-rank batch, learning-rate rule and warm-up epochs of one run of a sweep."""

    ranks: int
    batch: int  # samples per step on each rank
    lr_rule: str = "none"  # how the rate grows with the global batch: none, linear (Goyal et al.), sqrt
    warmup: int = 0  # epochs over which the rate rises from the base rate to the scaled one
    base_batch: int = 1  # the global batch the base rate was tuned for
    index: int = 0  # 0-based, in the sweep's order
    total: int = 1  # points in the sweep

    @property
    def global_batch(self) -> int:
        return self.ranks * self.batch

    @property
    def key(self) -> str:
        """What names the point in the results file and the table: ``ranks=2 batch=64 lr=linear warmup=2``."""
        return f"ranks={self.ranks} batch={self.batch} lr={self.lr_rule} warmup={self.warmup}"

    def describe(self) -> str:
        """``2 ranks × 64, lr linear, warm-up 2``."""
        warmup = f", warm-up {self.warmup}" if self.warmup else ""
        return f"{self.ranks} rank{'s' if self.ranks > 1 else ''} × {self.batch}, lr {self.lr_rule}{warmup}"

    def lr(self, base_lr: float) -> float:
        """The learning rate after warm-up: ``base_lr`` (tuned for ``base_batch``) scaled to the point's global
        batch by its rule.

        Args:
            base_lr: the learning rate tuned for ``base_batch``.
        """
        ratio = self.global_batch / self.base_batch
        return base_lr * {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.lr_rule]

    def lr_at(self, base_lr: float, epoch: float) -> float:
        """The rate at (fractional) ``epoch``: rising linearly from ``base_lr`` to ``lr(base_lr)`` over the
        warm-up epochs, then ``lr(base_lr)`` (for a custom loop to set itself).

        Args:
            base_lr: the learning rate tuned for ``base_batch``.
            epoch: the (fractional) epoch now.
        """
        target = self.lr(base_lr)
        if epoch >= self.warmup:
            return target
        return base_lr + (target - base_lr) * epoch / self.warmup

    def callbacks(self, base_lr: float) -> list[Any]:
        """Keras callbacks that give the optimizer ``lr_at`` at every step (none without warm-up): pass them
        to ``fit`` beside your own, and compile the optimizer with ``lr(base_lr)``.

        Args:
            base_lr: the learning rate tuned for ``base_batch``.
        """
        if not self.warmup:
            return []
        from .. import keras_flavour

        keras = keras_flavour.keras()  # (the cluster's Keras: 3, or 2 under TF_USE_LEGACY_KERAS)
        point = self

        class WarmUp(keras.callbacks.Callback):
            def on_train_begin(self, logs: Any = None) -> None:
                self.steps, self.epoch = self.params.get("steps") or 1, 0

            def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
                self.epoch = epoch

            def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
                if self.epoch < point.warmup:
                    self.model.optimizer.learning_rate = point.lr_at(base_lr, self.epoch + (batch + 1) / self.steps)

        return [WarmUp()]
