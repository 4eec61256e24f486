"""Keras 2 training on the runtime: ``DistributedOptimizer`` of a ``tf_keras`` optimizer (the optimizers of
``tf.keras.optimizers`` under ``TF_USE_LEGACY_KERAS=1``, and those of ``tf.keras.optimizers.legacy``), as
Horovod 0.28 had it on TensorFlow 2.15.

Keras 2 computes gradients in the optimizer (``minimize`` calls ``compute_gradients``, or the legacy
``_compute_gradients``; TF1-style Keras calls ``get_gradients``), so the wrapper reduces them there, with
the same ``reduce_gradients`` as every other binding. Keras 2 has no gradient accumulation of its own:
``backward_passes_per_step`` is ``Aggregation`` below. The wrapper's class has the wrapped class's name, as
Horovod's, so that a saved model loads without Horovod too.
"""

from __future__ import annotations

from typing import Any

from ..core.noise_scale import NoiseScale
from ..tensorflow.gradients import telling_batch
from ..tensorflow.mpi_ops import not_converted


def is_legacy_optimizer_class(cls: type) -> bool:
    """A Keras 2 ``OptimizerV2`` (``tf.keras.optimizers.legacy.*``) rather than Keras 2's newer ``Optimizer``?"""
    return hasattr(cls, "_compute_gradients")


def distributed_optimizer(optimizer: Any, name: str | None, settings: dict[str, Any], k: int,
                          average_aggregated_gradients: bool, local: Any) -> Any:
    """A copy of the Keras 2 ``optimizer`` (from its config) whose gradients are reduced over the ranks.
    ``local``: the ``LocalVariables`` whose gradients stay on this rank; ``k``: backward passes per step."""
    base = type(optimizer)
    legacy = is_legacy_optimizer_class(base)

    class _Distributed(base):  # type: ignore[misc, valid-type]
        _HAS_AGGREGATE_GRAD = True  # (legacy Keras: apply_gradients need not aggregate over replicas again)

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._hvd_settings = settings
            self._hvd_local = local
            self._hvd_noise = NoiseScale()
            self._agg_helper = Aggregation(k, average_aggregated_gradients) if k > 1 else None

        def register_local_var(self, var: Any) -> None:
            """Keep a variable's gradient on this rank instead of reducing it, as Horovod's optimizer does.

            Args:
                var: the variable whose gradient stays local. It is divided by the number of ranks unless the
                    optimizer was made with ``scale_local_gradients=False``.
            """
            self._hvd_local.register(var)

        def compute_gradients(self, loss: Any, var_list: Any, tape: Any = None) -> list[tuple[Any, Any]]:
            return self._compute_gradients(loss, var_list, None, tape)

        @not_converted
        def _compute_gradients(self, loss: Any, var_list: Any, grad_loss: Any = None,
                               tape: Any = None) -> list[tuple[Any, Any]]:
            import tensorflow as tf

            tape = tf.GradientTape() if tape is None else tape
            if legacy:
                pairs = super()._compute_gradients(loss, var_list, grad_loss, tape=tape)
            else:
                pairs = super().compute_gradients(loss, var_list, tape=tape)
            grads, variables = (list(x) for x in zip(*pairs)) if pairs else ([], [])
            return list(zip(self._hvd_reduce(grads, variables), variables))

        @not_converted
        def get_gradients(self, loss: Any, params: Any) -> list[Any]:
            params = list(params)
            return self._hvd_reduce(list(super().get_gradients(loss, params)), params)

        @not_converted
        def apply_gradients(self, grads_and_vars: Any, *args: Any, **kwargs: Any) -> Any:
            if self._agg_helper is None:
                return super().apply_gradients(grads_and_vars, *args, **kwargs)
            grads_and_vars = list(grads_and_vars)
            return self._agg_helper.apply(lambda: super(_Distributed, self).apply_gradients(
                grads_and_vars, *args, **kwargs), self.iterations)

        def _hvd_reduce(self, grads: list[Any], variables: list[Any]) -> list[Any]:
            def reduce(passes: int) -> Any:
                return lambda gs: self._hvd_local.reduce(gs, variables, self._hvd_settings, noise=self._hvd_noise,
                                                         passes=passes)

            if self._agg_helper is None:
                return reduce(1)(grads)
            return self._agg_helper.gradients(grads, reduce(k))

        def noise_scale(self, batch_size: int | None = None) -> float | None:
            """Return the gradient noise scale this optimizer measured, as ``hvd.noise_scale`` does.

            Args:
                batch_size: the samples per rank and backward pass, needed only where ``fit`` did not tell it.
                    Defaults to None.

            Returns:
                The noise scale in samples, as a float, or None while there is no estimate.
            """
            return self._hvd_noise.value(batch_size)

    from ... import keras_patches

    keras_patches.patch_train_step(telling_batch)  # (fit's batch size reaches the noise scale)
    _Distributed.__name__, _Distributed.__qualname__ = base.__name__, base.__qualname__
    config = optimizer.get_config()
    if name:
        config["name"] = name
    return _Distributed.from_config(config)


class Aggregation:
    """``backward_passes_per_step=k`` for Keras 2: the gradients of k backward passes are summed on this rank
    (in variables, so that it works inside ``model.fit``'s ``tf.function`` as eagerly), reduced over the ranks
    once every k passes (divided by k where ``average``), and the optimizer applies them then; in between it
    applies nothing and only counts its ``iterations``. ``counter`` is the passes summed since the last
    update (Horovod's tests read it)."""

    def __init__(self, k: int, average: bool) -> None:
        self.k, self.average = k, average
        self.counter: Any = None
        self._sums: list[Any] | None = None

    def _create(self, grads: list[Any]) -> None:
        import tensorflow as tf

        with tf.init_scope():  # (inside tf.function: created once, on the first trace)
            self.counter = tf.Variable(0, dtype=tf.int32, trainable=False, name="aggregation_counter")
            self._sums = [None if g is None else tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False,
                                                             name=f"aggregated_gradient_{i}")
                          for i, g in enumerate(grads)]

    def gradients(self, grads: list[Any], reduce: Any) -> list[Any]:
        """Add this pass's ``grads`` to the sums; on every k-th pass, the sums reduced by ``reduce`` (a
        function of the list), else the sums so far."""
        import tensorflow as tf

        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]  # (sparse ones as dense)
        if self._sums is None:
            self._create(grads)
        added = [s.assign_add(g) for s, g in zip(self._sums, grads) if g is not None]
        with tf.control_dependencies(added):
            count = self.counter.assign_add(1)
        with tf.control_dependencies([count]):  # (a TF1 graph orders nothing by itself)
            sums = [None if s is None else s.read_value() for s in self._sums]
        present = [i for i, s in enumerate(sums) if s is not None]

        def reduced() -> list[Any]:
            out = reduce([s if s is None or not self.average else s / self.k for s in sums])
            return [out[i] for i in present]

        def kept() -> list[Any]:
            return [sums[i] for i in present]

        out = tf.cond(tf.equal(count, self.k), reduced, kept) if present else []
        result: list[Any] = [None] * len(grads)
        for i, g in zip(present, out):
            result[i] = g
        return result

    def apply(self, apply: Any, iterations: Any) -> Any:
        """``apply()`` (the optimizer's update) on the pass that reduced, then the sums start again from
        zero; on the other passes only ``iterations`` counts the step."""
        import tensorflow as tf

        def update() -> Any:
            applied = apply()
            with tf.control_dependencies([] if applied is None or tf.executing_eagerly() else [applied]):
                resets = [s.assign(tf.zeros_like(s)) for s in self._sums or [] if s is not None]
                with tf.control_dependencies(resets):
                    return tf.identity(self.counter.assign(0))

        def skip() -> Any:
            with tf.control_dependencies([iterations.assign_add(1)]):
                return tf.identity(self.counter.read_value())

        if self.counter is None:  # apply_gradients before any gradients: as the optimizer would
            return apply()
        return tf.cond(tf.greater_equal(self.counter, self.k), update, skip)


__all__ = ["Aggregation", "distributed_optimizer", "is_legacy_optimizer_class"]
