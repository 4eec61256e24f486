"""Horovod's TF1 graph API on the runtime: ``DistributedOptimizer`` around a
``tf.compat.v1.train.Optimizer``, ``BroadcastGlobalVariablesHook`` and
``broadcast_global_variables``, for ``tf.compat.v1`` graphs and sessions.

A step's collectives must start in the same order on every rank, but a TF1
graph has no automatic control dependencies: its executor may run independent
ops in any order, on several threads. So each step's gradient reduction is a
single op (a ``tf.py_function`` that reduces every gradient, fused, inside),
and the variables are broadcast in one fused op.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from ..core.ops import check_op
from ..core.process_sets import check as check_process_set
from .gradients import reduce_gradients
from .mpi_ops import broadcast_variables


def is_v1_optimizer(optimizer: Any) -> bool:
    """Is ``optimizer`` a TF1 ``tf.compat.v1.train.Optimizer`` (rather than a Keras one)?"""
    return isinstance(optimizer, tf.compat.v1.train.Optimizer)


def reduce_in_one_op(grads: list[Any], settings: dict) -> list[Any]:
    """``reduce_gradients`` as one op of a TF1 graph, so that its collectives run in
    program order on every rank; eagerly, the reduction itself."""
    if tf.executing_eagerly():
        return reduce_gradients(grads, **settings)
    grads = list(grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    inputs: list[Any] = []
    for i in present:
        g = grads[i]
        if isinstance(g, tf.IndexedSlices) and settings["sparse_as_dense"]:
            g = grads[i] = tf.convert_to_tensor(g)
        inputs += [g.values, g.indices] if isinstance(g, tf.IndexedSlices) else [g]

    def reduce_eagerly(*flat: Any) -> list[Any]:
        it = iter(flat)
        rebuilt = [tf.IndexedSlices(next(it), next(it), grads[i].dense_shape)
                   if isinstance(grads[i], tf.IndexedSlices) else next(it) for i in present]
        outs: list[Any] = []
        for r in reduce_gradients(rebuilt, **settings):
            outs += [r.values, r.indices] if isinstance(r, tf.IndexedSlices) else [r]
        return outs

    if not inputs:
        return list(grads)
    flat_out = tf.py_function(reduce_eagerly, inputs, Tout=[t.dtype for t in inputs])
    out, it = list(grads), iter(flat_out)
    for i in present:
        g = grads[i]
        if isinstance(g, tf.IndexedSlices):
            values, indices = next(it), next(it)
            values.set_shape(tf.TensorShape([None]).concatenate(g.values.shape[1:]))
            indices.set_shape([None])
            out[i] = tf.IndexedSlices(values, indices, g.dense_shape)
        else:
            out[i] = next(it)
            out[i].set_shape(g.shape)
    return out


class _Accumulation:
    """``backward_passes_per_step=k`` in a graph: sum k local gradients in local
    variables, reduce over ranks on every k-th step, apply only then."""

    def __init__(self, passes: int, average: bool) -> None:
        self.passes, self.average = passes, average
        self.is_last: Any = None  # this step reduces and applies (set by accumulate)
        self._sums: list[Any] = []

    def _local(self, initial: Any, name: str) -> Any:
        return tf.compat.v1.Variable(initial, trainable=False, name=name, use_resource=True,
                                     collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])

    def accumulate(self, grads: list[Any], variables: list[Any], settings: dict) -> list[Any]:
        """Add this step's gradients to the sums; on every k-th step, the sums reduced over ranks."""
        present = [i for i, g in enumerate(grads) if g is not None]
        with tf.compat.v1.name_scope("hvd_aggregation"):
            self._sums = [self._local(tf.zeros(variables[i].shape, variables[i].dtype.base_dtype), "grad_sum")
                          for i in present]
            counter = self._local(tf.constant(0, tf.int64), "passes")
        adds = [s.scatter_add(grads[i]) if isinstance(grads[i], tf.IndexedSlices) else s.assign_add(grads[i])
                for s, i in zip(self._sums, present)]
        with tf.control_dependencies(adds):
            count = counter.assign_add(1)
        self.is_last = tf.equal(count % self.passes, 0)

        def reduced() -> list[Any]:
            sums = [s.read_value() for s in self._sums]
            if self.average:
                sums = [s / self.passes for s in sums]
            return reduce_in_one_op(sums, settings)

        summed = tf.cond(self.is_last, reduced, lambda: [s.read_value() for s in self._sums])
        out = list(grads)
        for i, s in zip(present, summed):
            out[i] = s
        return out

    def apply(self, apply_fn: Any, global_step: Any) -> Any:
        """Run ``apply_fn`` (and clear the sums) on every k-th step; else only count the step."""
        if self.is_last is None:
            raise ValueError("with backward_passes_per_step > 1, call the DistributedOptimizer's "
                             "compute_gradients (or minimize) before its apply_gradients.")

        def apply() -> Any:
            with tf.control_dependencies([apply_fn()]):
                clears = [s.assign(tf.zeros_like(s)) for s in self._sums]
            with tf.control_dependencies(clears):
                return tf.constant(True)

        def skip() -> Any:
            steps = [] if global_step is None else [global_step.assign_add(1)]
            with tf.control_dependencies(steps):
                return tf.constant(False)

        return tf.group(tf.cond(self.is_last, apply, skip))


class _DistributedV1Optimizer(tf.compat.v1.train.Optimizer):
    """A TF1 optimizer whose ``compute_gradients`` returns gradients reduced over all ranks."""

    def __init__(self, optimizer: Any, name: str | None, use_locking: bool, settings: dict, passes: int,
                 average_aggregated: bool) -> None:
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)
        self._optimizer = optimizer
        self._settings = settings
        self._accumulation = _Accumulation(passes, average_aggregated) if passes > 1 else None

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        """Compute the wrapped optimizer's gradients, reduced over all ranks.

        With ``backward_passes_per_step`` above 1, the gradients are added to local sums, and the sums are reduced
        on every k-th step only. The reduction is one op of the graph, so that its collectives run in the same order
        on every rank.

        Args:
            *args: passed to the wrapped optimizer's ``compute_gradients``, such as the loss.
            **kwargs: passed to the wrapped optimizer's ``compute_gradients``, such as ``var_list``.

        Returns:
            A list of ``(gradient, variable)`` pairs, the gradients reduced. A None gradient stays None.
        """
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = (list(x) for x in zip(*pairs))
        if self._accumulation is not None:
            grads = self._accumulation.accumulate(grads, variables, self._settings)
        else:
            grads = reduce_in_one_op(grads, self._settings)
        return list(zip(grads, variables))

    def apply_gradients(self, grads_and_vars: Any, global_step: Any = None, name: str | None = None) -> Any:
        """Apply the gradients with the wrapped optimizer.

        With ``backward_passes_per_step`` above 1, the update runs on every k-th step only, and clears the local
        sums; the other steps only count ``global_step``.

        Args:
            grads_and_vars: the ``(gradient, variable)`` pairs that ``compute_gradients`` returned.
            global_step: the step counter to increment. Defaults to None.
            name: the update op's name. Defaults to None.

        Returns:
            The op that applies the update.

        Raises:
            ValueError: with ``backward_passes_per_step`` above 1, ``compute_gradients`` (or ``minimize``) was not
                called first.
        """
        def apply() -> Any:
            return self._optimizer.apply_gradients(grads_and_vars, global_step=global_step, name=name)

        if self._accumulation is None:
            return apply()
        return self._accumulation.apply(apply, global_step)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's ``get_slot``."""
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's ``get_slot_names``."""
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's ``variables``."""
        return self._optimizer.variables(*args, **kwargs)


def distributed_v1_optimizer(optimizer: Any, name: str | None, use_locking: bool, settings: dict, passes: int,
                             average_aggregated: bool) -> Any:
    """``hvd.DistributedOptimizer`` for a TF1 optimizer (arguments already checked by training.py)."""
    check_op(settings["op"])  # now: in a graph the reduction runs, and would fail, only at session.run
    if passes > 1 and tf.executing_eagerly():
        raise ValueError(f"backward_passes_per_step={passes} needs a graph (tf.compat.v1) with a TF1 optimizer; "
                         "eagerly, use a Keras 3 optimizer, whose DistributedOptimizer accumulates.")
    return _DistributedV1Optimizer(optimizer, name, use_locking, settings, passes, average_aggregated)


def broadcast_global_variables(root_rank: int, process_set: Any = None) -> Any:
    """Build an op that assigns the root rank's values to every global variable of the TF1 graph.

    All of ``tf.compat.v1.global_variables()`` travel in one fused broadcast. Run the op once, after the variables
    are initialised or restored.

    Args:
        root_rank: the global rank whose values every rank gets. With ``process_set``, it must be one of the set's
            ranks.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.

    Returns:
        The op to run in the session. A ``tf.no_op`` where the graph has no global variables.

    Raises:
        RuntimeError: TensorFlow runs eagerly, where there are no global variables; use ``hvd.broadcast_variables``
            there.
        ValueError: the runtime is not initialised, or ``process_set`` is not a registered ``hvd.ProcessSet`` or
            does not hold this rank. When the op runs, it fails as ``hvd.broadcast_variables`` does.
    """
    if tf.executing_eagerly():
        raise RuntimeError("hvd.broadcast_global_variables() needs a TF1 graph (there are no global variables "
                           "eagerly); use hvd.broadcast_variables(model.variables, root_rank) instead.")
    op = broadcast_variables(tf.compat.v1.global_variables(), root_rank, process_set=process_set)
    return tf.no_op() if op is None else op


class BroadcastGlobalVariablesHook(tf.compat.v1.train.SessionRunHook):
    """A ``SessionRunHook`` that broadcasts all global variables from the root rank once the session exists.

    The broadcast runs after the session has initialised or restored the variables, so that every rank starts from
    the same values. The op is built in ``begin()``, and again for a new graph.

    >>> hooks = [hvd.BroadcastGlobalVariablesHook(0)]
    >>> with tf.compat.v1.train.MonitoredTrainingSession(hooks=hooks) as sess: ...

    Args:
        root_rank: the global rank whose values every rank gets.
        device: the device to build the broadcast op on, as ``tf.device`` takes it. The default, "", leaves the
            placement to TensorFlow.
        process_set: the ``hvd.ProcessSet`` whose ranks take part. The default, None, means every rank.

    Raises:
        ValueError: ``process_set`` is neither None nor an ``hvd.ProcessSet``.
    """

    def __init__(self, root_rank: int, device: str = "", process_set: Any = None) -> None:
        super().__init__()
        check_process_set(process_set, "hvd.BroadcastGlobalVariablesHook")
        self.root_rank = root_rank
        self.device = device
        self.process_set = process_set
        self.bcast_op: Any = None

    def begin(self) -> None:
        if self.bcast_op is None or self.bcast_op.graph is not tf.compat.v1.get_default_graph():
            with tf.device(self.device):
                self.bcast_op = broadcast_global_variables(self.root_rank, self.process_set)

    def after_create_session(self, session: Any, coord: Any) -> None:
        session.run(self.bcast_op)


__all__ = ["BroadcastGlobalVariablesHook", "broadcast_global_variables", "distributed_v1_optimizer",
           "is_v1_optimizer", "reduce_in_one_op"]
