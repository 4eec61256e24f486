"""``hvd.elastic`` for TensorFlow (Horovod's ``horovod.tensorflow.elastic``): the core's state and ``run``
loop (``core/elastic.py``), and the states of TensorFlow variables (``TensorFlowState``) and of a Keras
model with its optimizer (``TensorFlowKerasState``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..core.elastic import HostUpdateResult, ObjectState, State, run, spill
from ..core.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from .bridges import tf as _tf
from .mpi_ops import broadcast_variables
from .util import optimizer_variables


class _VariablesState(ObjectState):
    """Python values and TensorFlow variables (``_variables()``), read and assigned eagerly or, where
    ``session`` is set, in that TF1 session."""

    session: Any = None

    def __init__(self, **kwargs: Any) -> None:
        self._saved_values = _saved(self._variables(), self.session)
        super().__init__(**kwargs)

    def _variables(self) -> list[Any]:
        raise NotImplementedError

    def save(self) -> None:
        self._saved_values = _saved(self._variables(), self.session)
        super().save()

    def restore(self) -> None:
        _load(self._saved_values, self.session)
        super().restore()

    def sync(self) -> None:
        variables = self._variables()
        _broadcast(variables, self.session)
        self._saved_values = _saved(variables, self.session)
        super().sync()

    def _spilled(self) -> dict[str, Any]:
        return {**super()._spilled(), "variables": [value for _, value in self._saved_values]}

    def _resume(self, spilled: dict[str, Any]) -> None:
        self._saved_values = _matched(self._saved_values, spilled.get("variables", []))
        super()._resume(spilled)


class TensorFlowState(_VariablesState):
    """Elastic state made of TensorFlow variables and Python values.

    ``sync()`` broadcasts the variables from rank 0 in one fused broadcast, and the values as pickled objects.
    ``commit()`` keeps a copy of each variable's value.

    Args:
        variables: the TensorFlow variables to keep. The default, None, takes the graph's global variables, which
            eagerly are none.
        session: in a TF1 graph, the session that holds the variables' values. The default, None, takes the default
            session in a graph, and none eagerly.
        **kwargs: Python values, by name: each becomes an attribute, ``state.epoch``.
    """

    def __init__(self, variables: list[Any] | None = None, session: Any = None, **kwargs: Any) -> None:
        tf = _tf()
        self.variables = list(variables) if variables else tf.compat.v1.global_variables()
        self.session = session if session is not None or tf.executing_eagerly() else \
            tf.compat.v1.get_default_session()
        super().__init__(**kwargs)

    def _variables(self) -> list[Any]:
        return self.variables


class TensorFlowKerasState(_VariablesState):
    """Elastic state made of a built Keras model, its optimizer and Python values.

    The optimizer's variables, its step count and slots, are part of the state. An optimizer that has not made them
    yet makes them now, for the model's trainable variables.

    Args:
        model: the Keras model. It must be built.
        optimizer: the optimizer. The default, None, takes the model's compiled optimizer.
        backend: accepted for Horovod's signature, and kept as ``state.backend``; it is not used.
        **kwargs: Python values, by name: each becomes an attribute, ``state.epoch``.

    Raises:
        ValueError: the model is not built, or it has no optimizer and none is given.
    """

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any) -> None:
        if not getattr(model, "built", True):
            raise ValueError("hvd.elastic: the model must be built first: call model.build(input_shape), or "
                             "the model once on a batch.")
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        if self.optimizer is None:
            raise ValueError("hvd.elastic: the model has no optimizer: compile it, or pass optimizer=.")
        if getattr(self.optimizer, "built", True) is False and hasattr(self.optimizer, "build"):
            self.optimizer.build(model.trainable_variables)
        self.backend = backend
        super().__init__(**kwargs)

    def _variables(self) -> list[Any]:
        return [*self.model.variables, *optimizer_variables(self.optimizer)]


def _saved(variables: list[Any], session: Any) -> list[tuple[Any, Any]]:
    """Each variable with a copy of its value. Eagerly a ``tf.identity``, which shares the variable's
    buffer until the variable is next written (TensorFlow copies on that write): a commit costs
    little more than the step's own write."""
    if session is not None:
        return list(zip(variables, session.run(list(variables)), strict=True))
    tf = _tf()
    return [(v, tf.identity(v)) for v in variables]


def _load(saved: list[tuple[Any, Any]], session: Any) -> None:
    for variable, value in saved:
        if session is not None:
            variable.load(value, session)
        else:
            variable.assign(value)


def _matched(saved: list[tuple[Any, Any]], values: list[Any]) -> list[tuple[Any, Any]]:
    """The state's variables paired with the values of an earlier launch's commit, checked alike."""
    variables = [v for v, _ in saved]
    shapes = [tuple(v.shape) for v in variables]
    if [tuple(np.shape(x)) for x in values] != shapes:
        raise ValueError(f"hvd.elastic: the commit to resume from holds {len(values)} variables of other shapes "
                         f"than this state's {len(variables)}: the model changed between the launches. Remove "
                         f"{spill.path()} to start afresh.")
    return list(zip(variables, values))


def _broadcast(variables: list[Any], session: Any) -> None:
    if not variables:
        return
    op = broadcast_variables(variables, root_rank=0)
    if session is not None and op is not None:
        session.run(op)


__all__ = ["HorovodInternalError", "HostUpdateResult", "HostsUpdatedInterrupt", "ObjectState", "State",
           "TensorFlowKerasState", "TensorFlowState", "run"]
