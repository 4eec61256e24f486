"""``hvd.elastic`` for Keras (Horovod's ``horovod.tensorflow.keras.elastic``): TensorFlow's elastic names
(``tensorflow/elastic.py``), ``KerasState``, and the callbacks that commit every N batches and keep
``state.batch`` and ``state.epoch`` current, so that training re-entered after a reset goes on where the
commit was. It is also what the cells' ``hvd.elastic`` gives."""

from __future__ import annotations

from typing import Any

from ... import keras_flavour
from ..tensorflow.elastic import (
    HorovodInternalError,
    HostsUpdatedInterrupt,
    HostUpdateResult,
    ObjectState,
    State,
    TensorFlowKerasState,
    TensorFlowState,
    run,
)

keras = keras_flavour.keras()


class KerasState(TensorFlowKerasState):
    """Elastic state of a Keras model, its optimizer and Python values, as Horovod's Keras ``KerasState``.

    It is ``TensorFlowKerasState`` under the name Horovod's Keras module gives it.

    >>> state = hvd.elastic.KerasState(model, optimizer, epoch=0, batch=0)

    Args:
        model: the Keras model. It must be built.
        optimizer: the optimizer. The default, None, takes the model's compiled optimizer.
        **kwargs: Python values, by name: each becomes an attribute, ``state.epoch``.

    Raises:
        ValueError: the model is not built, or it has no optimizer and none is given.
    """

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any) -> None:
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """A Keras callback that commits the elastic state every few batches and at the end of each epoch.

    Args:
        state: the ``State`` to commit.
        batches_per_commit: commit after every this many batches. Defaults to 1. A commit costs a collective and a
            copy of the state, so a larger number trains faster but loses more work to a reset.

    Raises:
        ValueError: ``batches_per_commit`` is under 1.
    """

    def __init__(self, state: Any, batches_per_commit: int = 1) -> None:
        if int(batches_per_commit) < 1:
            raise ValueError(f"CommitStateCallback: batches_per_commit must be 1 or more, not {batches_per_commit!r}.")
        super().__init__()
        self.state = state
        self.batches_per_commit = int(batches_per_commit)
        self.batches_remaining = self.batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self.batches_remaining = self.batches_per_commit  # every rank counts from the same point after a reset

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches_remaining -= 1
        if self.batches_remaining == 0:
            self.state.commit()
            self.batches_remaining = self.batches_per_commit

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """A Keras callback that keeps ``state.batch`` at the number of the last batch done in this epoch.

    ``state.batch`` goes back to 0 at each epoch's end. Keras 3 fixes an epoch's steps when ``fit`` starts, so the
    epoch after a reset runs whole: Horovod's callback shortened it on Keras 2 by the batches already done.

    Args:
        state: the ``State`` whose ``batch`` attribute it sets.
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """A Keras callback that keeps ``state.epoch`` at the number of epochs done, counted across resets.

    Either way of going on after a reset works: ``fit(epochs=total - state.epoch)``, as Horovod's examples do, where
    Keras counts from 0 again; or ``fit(initial_epoch=state.epoch, epochs=total)``, where Keras counts from there.

    Args:
        state: the ``State`` whose ``epoch`` attribute it sets.
    """

    def __init__(self, state: Any) -> None:
        super().__init__()
        self.state = state
        self.initial_epoch = state.epoch
        self._offset: int | None = None

    def on_train_begin(self, logs: Any = None) -> None:
        self.initial_epoch, self._offset = self.state.epoch, None

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        if self._offset is None:  # the first epoch of this fit says how Keras counts
            self._offset = self.initial_epoch if epoch == 0 else 0

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = (self._offset or 0) + epoch + 1


__all__ = ["CommitStateCallback", "HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt", "KerasState",
           "ObjectState", "State", "TensorFlowKerasState", "TensorFlowState", "UpdateBatchStateCallback",
           "UpdateEpochStateCallback", "run"]
