"""Keras callbacks for data-parallel training, as ``horovod.tensorflow.keras.callbacks``, on the Keras this
process trains with (Keras 3, or Keras 2 where ``TF_USE_LEGACY_KERAS`` says: ``keras_flavour``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ... import keras_flavour
from ..core import basics
from ..core.process_sets import check as check_process_set
from ..core.rules import reject_unsupported
from ..tensorflow.bridges import tf as _tf
from ..tensorflow.mpi_ops import allreduce, broadcast_variables
from ..tensorflow.util import optimizer_variables
from .training import one_or_list

keras = keras_flavour.keras()


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """A Keras callback that makes every rank start from the root rank's weights and optimizer state.

    >>> model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

    It broadcasts at the start of training, so that a model restored or initialised on the root only is shared too.
    It broadcasts once more after the first batch where the optimizer made its variables only then, or where the
    model built its weights then (a Keras 2 model without an input shape). The optimizer's state is broadcast whole,
    as Horovod does.

    Args:
        root_rank: the global rank whose values every rank gets. Defaults to 0.
        device: accepted for Horovod's signature; it must stay empty.
        local_variables: a variable, or a list of them, left out of the broadcast: each rank keeps its own values.
            ``register_local_var`` adds more. The default, None, leaves none out.
        process_set: an extension, since Horovod's callback has none: run among the ranks of this ``hvd.ProcessSet``
            only; the other ranks keep their own values. The default, None, means every rank.

    Raises:
        ValueError: ``device`` is set; ``process_set`` is neither None nor an ``hvd.ProcessSet``; or
            ``local_variables`` holds something other than ``keras.Variable`` or ``tf.Variable``.
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None,
                 process_set: Any = None) -> None:
        reject_unsupported("hvd.callbacks.BroadcastGlobalVariablesCallback", device=device)
        check_process_set(process_set, "hvd.callbacks.BroadcastGlobalVariablesCallback")
        super().__init__()
        self.root_rank = root_rank
        self.process_set = process_set
        self._optimizer_done = False
        self._local_vars: dict[int, Any] = {}  # by identity: variables compare by value
        variable_types = tuple(t for t in (getattr(keras, "Variable", None), _tf().Variable) if t is not None)
        for var in one_or_list(local_variables, variable_types,
                               "All local variables must be of keras.Variable or tf.Variable type."):
            self.register_local_var(var)

    def register_local_var(self, var: Any) -> None:
        """Leave a variable out of the broadcast, as Horovod's callback does: it keeps this rank's value.

        Args:
            var: the ``keras.Variable`` or ``tf.Variable`` to leave out.
        """
        self._local_vars[id(var)] = var

    def _broadcast(self, with_optimizer: bool) -> None:
        variables = [v for v in self.model.variables if id(v) not in self._local_vars]
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and with_optimizer:
            variables += optimizer_variables(optimizer)
            self._optimizer_done = True
        if self.process_set is None or self.process_set.included():
            broadcast_variables(variables, root_rank=self.root_rank, process_set=self.process_set)

    def on_train_begin(self, logs: Any = None) -> None:
        if not self.model.built:  # a Keras 2 model without an input shape is built by its first batch
            return  # (the broadcast after it makes the ranks equal, as Horovod's did on Keras 2)
        # (Keras 3 says when its optimizer has made its variables; Keras 2's makes them in its first update)
        self._broadcast(with_optimizer=bool(getattr(getattr(self.model, "optimizer", None), "built", False)))

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if not self._optimizer_done:
            self._broadcast(with_optimizer=True)


class MetricAverageCallback(keras.callbacks.Callback):
    """A Keras callback that replaces each epoch's metrics by their mean over all ranks.

    Every rank then logs the same figures, and so does every later callback. Put it before the callbacks that read
    the metrics, such as checkpointing and early stopping. Only scalar metrics are averaged.

    Args:
        device: accepted for Horovod's signature; it must stay empty.
        process_set: an extension, since Horovod's callback has none: run among the ranks of this ``hvd.ProcessSet``
            only; the other ranks keep their own values. The default, None, means every rank.

    Raises:
        ValueError: ``device`` is set, or ``process_set`` is neither None nor an ``hvd.ProcessSet``.
    """

    def __init__(self, device: str = "", process_set: Any = None) -> None:
        reject_unsupported("hvd.callbacks.MetricAverageCallback", device=device)
        check_process_set(process_set, "hvd.callbacks.MetricAverageCallback")
        super().__init__()
        self.process_set = process_set

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if not logs or not (self.process_set is None or self.process_set.included()):
            return
        keys = sorted(k for k, v in logs.items() if np.ndim(v) == 0)
        values = allreduce(np.array([float(logs[k]) for k in keys], dtype=np.float64), name="metric_average",
                           process_set=self.process_set)
        for k, v in zip(keys, values):
            logs[k] = float(v)


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """A Keras callback that sets the learning rate to ``initial_lr * multiplier(epoch)`` for some epochs.

    The schedule runs from ``start_epoch`` until before ``end_epoch``, as Horovod's callback does. Each epoch's end
    also logs the rate as ``lr``.

    Args:
        initial_lr: the learning rate that ``multiplier`` scales.
        multiplier: a number, or a function of the epoch that returns the factor. The epoch is a float without
            ``staircase``.
        start_epoch: the first epoch the schedule sets. Defaults to 0.
        end_epoch: the epoch at which the schedule stops. The default, None, never stops.
        staircase: set the rate at the start of each epoch. With False, set it at every batch, the epoch counted
            fractionally as ``epoch + batch / steps_per_epoch``. Defaults to True.
        momentum_correction: scale the momentum by the new rate over the old for the step where the rate changes, as
            Goyal et al. (2017). Keras 3 compiles an optimizer's momentum into the training step as a constant, so
            this applies only to optimizers whose ``momentum`` is a variable. Defaults to True.
        steps_per_epoch: the batches per epoch, for ``staircase=False``. The default, None, takes what ``fit``
            reports.
        verbose: accepted for Horovod's signature; this callback prints nothing. Defaults to 0.
    """

    def __init__(self, initial_lr: float, multiplier: Any, start_epoch: int = 0, end_epoch: int | None = None,
                 staircase: bool = True, momentum_correction: bool = True, steps_per_epoch: int | None = None,
                 verbose: int = 0) -> None:
        super().__init__()
        self.initial_lr = initial_lr
        self.multiplier = multiplier if callable(multiplier) else (lambda epoch: multiplier)
        self.start_epoch, self.end_epoch = start_epoch, end_epoch
        self.staircase, self.momentum_correction = staircase, momentum_correction
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self.current_epoch = 0

    def _active(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set(self, epoch: float) -> None:
        optimizer = self.model.optimizer
        old = float(optimizer.learning_rate)
        new = self.initial_lr * self.multiplier(epoch)
        optimizer.learning_rate = new  # Keras assigns its learning-rate variable
        momentum = getattr(optimizer, "momentum", None)
        if self.momentum_correction and old > 0 and hasattr(momentum, "assign"):
            self._restore_momentum = float(momentum)
            momentum.assign(float(momentum) * new / old)

    def on_train_begin(self, logs: Any = None) -> None:
        if self.steps_per_epoch is None:
            self.steps_per_epoch = self.params.get("steps") or 1
        self._restore_momentum = None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.current_epoch = epoch
        if self.staircase and self._active(epoch):
            self._set(epoch)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        epoch = self.current_epoch + batch / self.steps_per_epoch
        if not self.staircase and self._active(self.current_epoch):
            self._set(epoch)

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._restore_momentum is not None:
            self.model.optimizer.momentum.assign(self._restore_momentum)
            self._restore_momentum = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            logs["lr"] = float(self.model.optimizer.learning_rate)


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """A Keras callback that ramps the learning rate up over the first epochs, for large batches.

    The rate goes from ``initial_lr / size()`` to ``initial_lr`` over ``warmup_epochs``, a little at every batch, as
    Goyal et al. (2017) and Horovod compute it: ``lr = initial_lr / size * (e * (size - 1) / warmup_epochs + 1)``,
    where ``e = epoch + (batch + 1) / steps_per_epoch``.

    >>> opt = hvd.DistributedOptimizer(keras.optimizers.SGD(hvd.scale_lr(0.01)))
    >>> callbacks = [hvd.callbacks.LearningRateWarmupCallback(hvd.scale_lr(0.01), warmup_epochs=3)]

    Args:
        initial_lr: the learning rate at the end of the warm-up, usually scaled by ``hvd.scale_lr``.
        warmup_epochs: the number of epochs the warm-up lasts. Defaults to 5.
        momentum_correction: scale the momentum by the new rate over the old for each step where the rate changes,
            where the optimizer's ``momentum`` is a variable. Defaults to True.
        steps_per_epoch: the batches per epoch. The default, None, takes what ``fit`` reports.
        verbose: with 1, rank 0 prints a line when the warm-up ends. Defaults to 0.
    """

    def __init__(self, initial_lr: float, warmup_epochs: int = 5, momentum_correction: bool = True,
                 steps_per_epoch: int | None = None, verbose: int = 0) -> None:
        def multiplier(epoch: float) -> float:
            epoch += 1.0 / self.steps_per_epoch  # round figures at the end of each epoch, as Horovod
            return 1.0 / basics.size() * (epoch * (basics.size() - 1) / warmup_epochs + 1)

        super().__init__(initial_lr, multiplier, start_epoch=0, end_epoch=warmup_epochs, staircase=False,
                         momentum_correction=momentum_correction, steps_per_epoch=steps_per_epoch,
                         verbose=verbose)
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        super().on_epoch_end(epoch, logs)
        if epoch == self.warmup_epochs - 1 and self.verbose and basics.rank() == 0:
            print(f"Epoch {epoch + 1}: finished gradual learning rate warmup to "
                  f"{float(self.model.optimizer.learning_rate):g}.")


class ModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keras's ``ModelCheckpoint`` that saves on rank 0 only.

    Every rank holds the same model, and several ranks writing one file would corrupt it. It takes
    ``keras.callbacks.ModelCheckpoint``'s arguments and raises what that callback raises.
    """

    def _save_model(self, epoch: int, batch: Any, logs: Any) -> None:
        if basics.rank() == 0:
            super()._save_model(epoch, batch, logs)


class BestModelCheckpoint(ModelCheckpoint):
    """A Keras callback that saves the best model so far, by ``monitor``, on rank 0 only, as Horovod's.

    It is ``ModelCheckpoint`` with ``save_best_only=True`` and ``save_weights_only=False``.

    Args:
        filepath: where to save the model; Keras's ``ModelCheckpoint`` placeholders, such as ``{epoch}``, are filled
            in.
        monitor: the metric that decides which model is best. Defaults to ``"val_loss"``.
        verbose: with 1, Keras prints a line when it saves. Defaults to 0.
        mode: ``"min"``, ``"max"`` or ``"auto"`` (the default): whether a lower or higher ``monitor`` is better;
            ``"auto"`` lets Keras decide from the metric's name.
        save_freq: ``"epoch"`` (the default) to check after each epoch, or a number of batches.

    Raises:
        ValueError: ``save_freq`` is neither ``"epoch"`` nor an int; or, under Keras 3, ``filepath`` does not end in
            ``.keras`` or ``.h5``.
    """

    def __init__(self, filepath: str, monitor: str = "val_loss", verbose: int = 0, mode: str = "auto",
                 save_freq: Any = "epoch") -> None:
        super().__init__(filepath=filepath, monitor=monitor, verbose=verbose, save_best_only=True,
                         save_weights_only=False, mode=mode, save_freq=save_freq)


__all__ = ["BestModelCheckpoint", "BroadcastGlobalVariablesCallback", "LearningRateScheduleCallback",
           "LearningRateWarmupCallback", "MetricAverageCallback", "ModelCheckpoint"]
