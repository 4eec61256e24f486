"""Keras training on the runtime: ``DistributedOptimizer``,
``DistributedGradientTape``, their ``Partial`` forms (local layers), ``shard`` and
``scale_lr``; ``DistributedOptimizer`` of a TF1 ``tf.compat.v1.train.Optimizer`` is
built by ``tf1``, of a Keras 2 (``tf_keras``) optimizer by ``keras2``.

Horovod's Keras layer stops at Keras 2. Here ``DistributedOptimizer(opt)`` of a Keras 3 optimizer
returns an optimizer of a subclass of ``type(opt)`` built from the same config,
whose ``apply`` first averages the gradients over all ranks with one fused
``grouped_allreduce``: inside ``model.fit``'s compiled step that is a single
``tf.numpy_function`` around MPI.
"""

from __future__ import annotations

import math
from typing import Any

from ... import keras_flavour
from ..core import basics
from ..core.noise_scale import NoiseScale
from ..core.ops import Average, Sum, check_op
from ..core.process_sets import check as check_process_set
from ..core.rules import reject_unsupported
from ..tensorflow.compression import Compression
from ..tensorflow.gradients import reduce_gradients, telling_batch
from ..tensorflow.mpi_ops import not_converted
from . import keras2


def DistributedOptimizer(optimizer: Any, name: str | None = None, compression: Any = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         device_dense: str = "", device_sparse: str = "", process_set: Any = None,
                         num_groups: int = 0, groups: Any = None, use_locking: bool = False,
                         scale_local_gradients: bool = True) -> Any:
    """Wrap a TensorFlow optimizer so that gradients are reduced over all ranks before each update.

    It takes a Keras 3 optimizer, a Keras 2 one from ``tf_keras``, or a TF1 ``tf.compat.v1.train.Optimizer``. The
    gradients are averaged, by default, in one fused ``grouped_allreduce`` per step; inside ``model.fit``'s compiled
    step that is a single host call.

    >>> opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9))
    >>> model.compile(opt, loss="sparse_categorical_crossentropy")

    A wrapped Keras optimizer also has ``register_local_var(var)``, which keeps ``var``'s gradient on this rank, and
    ``noise_scale()``, the gradient noise scale it measured.

    Args:
        optimizer: the optimizer to wrap.
        name: the wrapped optimizer's name. The default, None, keeps a Keras optimizer's own name, and names a TF1
            one ``Distributed`` followed by its class name.
        compression: ``hvd.Compression.none`` (the default), or ``hvd.Compression.fp16`` to send floating gradients
            as float16.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors. By default, False, they are
            allgathered, as in Horovod.
        backward_passes_per_step: accumulate the gradients of this many steps on each rank, then reduce and apply
            them once. With a Keras 3 optimizer this is Keras's own gradient accumulation. Defaults to 1.
        op: ``hvd.Average`` (the default) or ``hvd.Sum``.
        gradient_predivide_factor: with ``hvd.Average``, divide the gradients by this factor before the sum, and
            multiply the sum by ``factor / size`` after it. Ignored with other ops. Defaults to 1.0.
        average_aggregated_gradients: with ``backward_passes_per_step`` above 1, apply the mean of the accumulated
            gradients instead of their sum. Defaults to False.
        device_dense: accepted for Horovod's signature; it must stay empty. Gradients are reduced where they live.
        device_sparse: accepted for Horovod's signature; it must stay empty.
        process_set: reduce over the ranks of this ``hvd.ProcessSet``. A rank outside it keeps its own gradients.
            The default, None, means every rank.
        num_groups: accepted for Horovod's signature; it must stay 0. Gradients are fused by dtype up to
            ``HOROVOD_FUSION_THRESHOLD`` bytes.
        groups: accepted for Horovod's signature; it must stay None.
        use_locking: the TF1 optimizer's ``use_locking``. It applies to TF1 optimizers only. Defaults to False.
        scale_local_gradients: divide the gradients of local variables by the number of ranks that reduce, as
            Horovod does. Defaults to True.

    Returns:
        For a Keras 3 or Keras 2 optimizer, a new optimizer of a subclass of its class, built from its config: the
        original's variables are not copied. For a TF1 optimizer, a ``tf.compat.v1.train.Optimizer`` whose
        ``compute_gradients`` returns reduced gradients.

    Raises:
        TypeError: ``optimizer`` is none of the three kinds.
        ValueError: ``device_dense``, ``device_sparse``, ``num_groups`` or ``groups`` is set; ``process_set`` is
            neither None nor an ``hvd.ProcessSet``; ``backward_passes_per_step`` is under 1; ``op`` is not
            ``hvd.Average`` or ``hvd.Sum``; ``use_locking`` is set for a Keras optimizer; or
            ``backward_passes_per_step`` is above 1 for a TF1 optimizer while TensorFlow runs eagerly.
        NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
    """
    from ..tensorflow import tf1

    reject_unsupported("hvd.DistributedOptimizer", device_dense=device_dense, device_sparse=device_sparse,
                       num_groups=num_groups, groups=groups)
    check_process_set(process_set, "hvd.DistributedOptimizer")
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be at least 1.")
    check_op(op, (Average, Sum), "hvd.DistributedOptimizer")
    settings = dict(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                    predivide=gradient_predivide_factor, process_set=process_set)
    k = backward_passes_per_step
    if tf1.is_v1_optimizer(optimizer):
        return tf1.distributed_v1_optimizer(optimizer, name, use_locking, settings, k, average_aggregated_gradients)
    if use_locking:
        raise ValueError("DistributedOptimizer(use_locking=True) applies to TF1 optimizers only: Keras "
                         "optimizers have no locking; omit it.")
    if keras_flavour.is_keras2_object(optimizer):
        return keras2.distributed_optimizer(optimizer, name, settings, k, average_aggregated_gradients,
                                            LocalVariables(scale_local_gradients))
    if not _is_keras3_optimizer(optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras optimizer (Keras 3's, or Keras 2's from tf_keras) "
                        f"or a tf.compat.v1.train.Optimizer, not {type(optimizer).__name__}.")
    return _distributed_keras_optimizer(optimizer, name, settings, k, average_aggregated_gradients,
                                        scale_local_gradients)


def _is_keras3_optimizer(optimizer: Any) -> bool:
    import keras

    return isinstance(optimizer, keras.optimizers.Optimizer)


def _distributed_keras_optimizer(optimizer: Any, name: str | None, settings: dict[str, Any], k: int,
                                 average_aggregated_gradients: bool, scale_local_gradients: bool) -> Any:
    """A copy of a Keras 3 optimizer, of a subclass of its class whose update reduces the gradients first."""
    import keras

    from ... import keras_patches

    base = type(optimizer)

    class _Distributed(base):  # type: ignore[misc, valid-type]
        _hvd_settings = settings
        _hvd_passes = k
        _hvd_average_aggregated = average_aggregated_gradients

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._hvd_local = LocalVariables(scale_local_gradients)
            self._hvd_noise = NoiseScale()

        def register_local_var(self, var: Any) -> None:
            """Keep a variable's gradient on this rank instead of reducing it, as Horovod's optimizer does.

            Args:
                var: the variable whose gradient stays local. It is divided by the number of ranks unless the
                    optimizer was made with ``scale_local_gradients=False``.
            """
            self._hvd_local.register(var)

        @not_converted
        def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
            grads = list(grads)
            if trainable_variables is not None:
                trainable_variables = list(trainable_variables)
            if self._hvd_passes == 1:
                # without variables Keras applies to those it was built with (no public name for them)
                variables = self._trainable_variables if trainable_variables is None else trainable_variables
                grads = self._hvd_local.reduce(grads, variables, self._hvd_settings, **self._hvd_measure(1))
            return super().apply(grads, trainable_variables)

        @not_converted
        def _backend_update_step(self, grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
            if self._hvd_passes > 1:  # Keras hands over the mean of the k accumulated gradients
                grads = self._hvd_local.reduce(list(grads), list(trainable_variables), self._hvd_settings,
                                               **self._hvd_measure(self._hvd_passes))
                if not self._hvd_average_aggregated:
                    grads = [None if g is None else g * self._hvd_passes for g in grads]
            return super()._backend_update_step(grads, trainable_variables, learning_rate)

        def _hvd_measure(self, passes: int) -> dict[str, Any]:
            """The noise scale's arguments of ``reduce_gradients``: this optimizer's estimator, the accumulated
            passes and the factor that undoes the loss scale (``fit``'s batch reaches it by ``training_step``)."""
            unscale = None
            if isinstance(self, keras.optimizers.LossScaleOptimizer):  # (its scale is made with its variables)
                unscale = 1.0 / getattr(self, "dynamic_scale", self.initial_scale)
            return dict(noise=self._hvd_noise, passes=passes, unscale=unscale)

        def noise_scale(self, batch_size: int | None = None) -> float | None:
            """Return the gradient noise scale this optimizer measured, as ``hvd.noise_scale`` does.

            Args:
                batch_size: the samples per rank and backward pass, needed only where ``fit`` did not tell it.
                    Defaults to None.

            Returns:
                The noise scale in samples, as a float, or None while there is no estimate.
            """
            return self._hvd_noise.value(batch_size)

    # Keras's jit_compile="auto" would compile the host-side reduction with XLA: see keras_patches
    keras_patches.patch_compile()
    keras_patches.patch_train_step(telling_batch)
    _Distributed.__name__ = _Distributed.__qualname__ = f"Distributed{base.__name__}"
    config = optimizer.get_config()
    if k > 1:
        config["gradient_accumulation_steps"] = k
    if name:
        config["name"] = name
    return _Distributed.from_config(config)


class LocalVariables:
    """The variables whose gradients stay on this rank (Horovod's local sources and local layers).

    Kept by identity in a plain object, so that Keras's tracking does not count them among an
    optimizer's own variables. A local layer's weights are read when gradients are reduced, so a
    layer built after the wrapping counts too.
    """

    def __init__(self, scale: bool = True) -> None:
        self.scale = scale  # Horovod's scale_local_gradients: divide local gradients by size()
        self._registered: dict[int, Any] = {}
        self._layers: list[Any] = []

    def register(self, var: Any) -> None:
        self._registered[id(var)] = var

    def add_layers(self, layers: list[Any]) -> None:
        self._layers += layers

    def ids(self) -> set[int]:
        return set(self._registered) | {id(v) for layer in self._layers for v in layer.trainable_weights}

    def reduce(self, grads: list[Any], variables: list[Any], settings: dict[str, Any], **measure: Any) -> list[Any]:
        """``reduce_gradients`` of every gradient but the local variables' ones, which stay this
        rank's (divided by the size of the reducing set where ``scale``, as Horovod does); ``measure``:
        ``reduce_gradients``'s noise-scale arguments (the local gradients are no part of it)."""
        local = self.ids()
        if not local:
            return reduce_gradients(grads, **settings, **measure)
        mine = [id(v) in local for v in variables]
        shared = iter(reduce_gradients([g for g, m in zip(grads, mine) if not m], **settings, **measure))
        process_set = settings.get("process_set")
        n = basics.size() if process_set is None else process_set.size()
        return [self._scaled(g, n) if m else next(shared) for g, m in zip(grads, mine)]

    def _scaled(self, grad: Any, n: int) -> Any:
        import tensorflow as tf

        if grad is None or not self.scale:
            return grad
        if isinstance(grad, tf.IndexedSlices):
            return tf.IndexedSlices(grad.values / n, grad.indices, grad.dense_shape)
        return grad / n


def one_or_list(value: Any, kinds: Any, error: str) -> list[Any]:
    """Horovod's ``local_layers`` and ``local_variables``: None, one of ``kinds`` or a list of them; a
    ``ValueError(error)`` for a list with anything else."""
    if value is None:
        return []
    if isinstance(value, kinds):
        return [value]
    items = list(value)
    if not all(isinstance(item, kinds) for item in items):
        raise ValueError(error)
    return items


def _local_layers(local_layers: Any) -> list[Any]:
    return one_or_list(local_layers, keras_flavour.keras().layers.Layer,
                       "All local layers must be of keras.layers.Layer type.")


# A training loop makes a DistributedGradientTape each step: the noise scale's averages run over all of them
_tape_noise = NoiseScale()


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient()`` returns gradients reduced over all ranks.

    Wrap the tape after the forward pass, then call ``gradient`` as usual. Every other attribute is the wrapped
    tape's.

    >>> with tf.GradientTape() as tape:
    ...     loss = loss_fn(model(x), y)
    >>> tape = hvd.DistributedGradientTape(tape)
    >>> grads = tape.gradient(loss, model.trainable_variables)

    Args:
        gradtape: the ``tf.GradientTape`` to wrap.
        device_dense: accepted for Horovod's signature; it must stay empty. Gradients are reduced where they live.
        device_sparse: accepted for Horovod's signature; it must stay empty.
        compression: ``hvd.Compression.none`` (the default), or ``hvd.Compression.fp16`` to send floating gradients
            as float16.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors. By default, False, they are
            allgathered, as in Horovod.
        op: the reduction: ``hvd.Average`` (the default) or ``hvd.Sum``.
        gradient_predivide_factor: with ``hvd.Average``, divide the gradients by this factor before the sum, and
            multiply the sum by ``factor / size`` after it. Ignored with other ops. Defaults to 1.0.
        num_groups: accepted for Horovod's signature; it must stay 0. Gradients are fused by dtype up to
            ``HOROVOD_FUSION_THRESHOLD`` bytes.
        groups: accepted for Horovod's signature; it must stay None.
        process_set: reduce over the ranks of this ``hvd.ProcessSet``. A rank outside it keeps its own gradients.
            The default, None, means every rank.
        scale_local_gradients: divide the gradients of local variables by the number of ranks that reduce, as
            Horovod does. Defaults to True.

    Raises:
        ValueError: ``device_dense``, ``device_sparse``, ``num_groups`` or ``groups`` is set, or ``process_set`` is
            neither None nor an ``hvd.ProcessSet``.
    """

    def __init__(self, gradtape: Any, device_dense: str = "", device_sparse: str = "",
                 compression: Any = Compression.none, sparse_as_dense: bool = False, op: int = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 process_set: Any = None, scale_local_gradients: bool = True) -> None:
        reject_unsupported("hvd.DistributedGradientTape", device_dense=device_dense, device_sparse=device_sparse,
                           num_groups=num_groups, groups=groups)
        check_process_set(process_set, "hvd.DistributedGradientTape")
        self._tape = gradtape
        self._settings = dict(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                              predivide=gradient_predivide_factor, process_set=process_set)
        self._local = LocalVariables(scale_local_gradients)

    def register_local_source(self, source: Any) -> None:
        """Keep a variable's gradient on this rank instead of reducing it, as Horovod's tape does.

        Args:
            source: the variable whose gradient stays local. It is divided by the number of ranks unless the tape
                was made with ``scale_local_gradients=False``.
        """
        self._local.register(source)

    @not_converted
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, use_generic_names: bool = False,
                 **kwargs: Any) -> Any:
        """Compute the gradients of ``target`` with the wrapped tape, and reduce them over the ranks.

        All the dense gradients are reduced in one fused ``grouped_allreduce``. Gradients of local sources stay on
        this rank.

        Args:
            target: the tensor, or nested structure of tensors, to differentiate.
            sources: the variables or tensors, or a nested structure of them, to differentiate against.
            output_gradients: passed to the wrapped tape's ``gradient``. Defaults to None.
            use_generic_names: accepted for Horovod's signature; the runtime names its collectives itself.
            **kwargs: passed to the wrapped tape's ``gradient``, such as ``unconnected_gradients``.

        Returns:
            The reduced gradients, in the structure of ``sources``. A None gradient stays None; a
            ``tf.IndexedSlices`` is allgathered unless ``sparse_as_dense``.

        Raises:
            ValueError: the runtime is not initialised, or the tape's ``op`` is not an op.
            NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
            MismatchError: the ranks' gradient reductions do not match, such as models of different shapes.
            StallError: a reduction cannot complete: a rank it waits for has shut down, or the wait passed
                ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
            HorovodInternalError: another rank left a reduction to reset the world for ``hvd.elastic.run``.
        """
        import tensorflow as tf

        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat = self._local.reduce(tf.nest.flatten(grads), tf.nest.flatten(sources), self._settings,
                                  noise=_tape_noise)
        return tf.nest.pack_sequence_as(grads, flat)

    def get_local_and_global_gradients(self, target: Any, sources: Any, output_gradients: Any = None,
                                       use_generic_names: bool = False) -> tuple[list[Any], list[Any]]:
        """Compute the reduced gradients, split into those of the local sources and the others.

        Args:
            target: the tensor to differentiate.
            sources: a flat list of the variables to differentiate against.
            output_gradients: passed to the wrapped tape's ``gradient``. Defaults to None.
            use_generic_names: accepted for Horovod's signature; the runtime names its collectives itself.

        Returns:
            A tuple of two lists of ``(source, gradient)`` pairs: those of the local sources, then those of the
            others. Each keeps the order of ``sources``.

        Raises:
            ValueError: the runtime is not initialised, or the tape's ``op`` is not an op.
            NotImplementedError: ``op=hvd.Adasum``, which the built-in runtime does not implement.
            MismatchError: the ranks' gradient reductions do not match, such as models of different shapes.
            StallError: a reduction cannot complete: a rank it waits for has shut down, or the wait passed
                ``HOROVOD_STALL_SHUTDOWN_TIME_SECONDS``.
            HorovodInternalError: another rank left a reduction to reset the world for ``hvd.elastic.run``.
        """
        grads = self.gradient(target, sources, output_gradients=output_gradients)
        local = self._local.ids()
        pairs = list(zip(sources, grads))
        return [p for p in pairs if id(p[0]) in local], [p for p in pairs if id(p[0]) not in local]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)


def PartialDistributedGradientTape(gradtape: Any, device_dense: str = "", device_sparse: str = "",
                                   compression: Any = Compression.none, sparse_as_dense: bool = False,
                                   op: int = Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                                   groups: Any = None, process_set: Any = None, local_layers: Any = None,
                                   scale_local_gradients: bool = True) -> DistributedGradientTape:
    """Make a ``DistributedGradientTape`` that keeps the gradients of some layers on this rank.

    >>> tape = hvd.PartialDistributedGradientTape(tape, local_layers=model.layers[-1])

    Args:
        gradtape: the ``tf.GradientTape`` to wrap.
        device_dense: accepted for Horovod's signature; it must stay empty. Gradients are reduced where they live.
        device_sparse: accepted for Horovod's signature; it must stay empty.
        compression: ``hvd.Compression.none`` (the default), or ``hvd.Compression.fp16`` to send floating gradients
            as float16.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors. By default, False, they are
            allgathered, as in Horovod.
        op: the reduction: ``hvd.Average`` (the default) or ``hvd.Sum``.
        gradient_predivide_factor: with ``hvd.Average``, divide the gradients by this factor before the sum, and
            multiply the sum by ``factor / size`` after it. Ignored with other ops. Defaults to 1.0.
        num_groups: accepted for Horovod's signature; it must stay 0. Gradients are fused by dtype up to
            ``HOROVOD_FUSION_THRESHOLD`` bytes.
        groups: accepted for Horovod's signature; it must stay None.
        process_set: reduce over the ranks of this ``hvd.ProcessSet``. A rank outside it keeps its own gradients.
            The default, None, means every rank.
        local_layers: a Keras layer, or a list of them, whose weights' gradients stay on this rank. The default,
            None, keeps none local.
        scale_local_gradients: divide the gradients of local variables by the number of ranks that reduce, as
            Horovod does. Defaults to True.

    Returns:
        A ``DistributedGradientTape`` whose local sources are the weights of ``local_layers``. A layer built after
        the call counts too.

    Raises:
        ValueError: ``device_dense``, ``device_sparse``, ``num_groups`` or ``groups`` is set; ``process_set`` is
            neither None nor an ``hvd.ProcessSet``; or ``local_layers`` holds something other than Keras layers.
    """
    reject_unsupported("hvd.PartialDistributedGradientTape", device_dense=device_dense, device_sparse=device_sparse,
                       num_groups=num_groups, groups=groups)
    layers = _local_layers(local_layers)
    tape = DistributedGradientTape(gradtape, device_dense, device_sparse, compression, sparse_as_dense, op,
                                   gradient_predivide_factor, num_groups, groups, process_set,
                                   scale_local_gradients)
    tape._local.add_layers(layers)
    return tape


def PartialDistributedOptimizer(optimizer: Any, name: str | None = None, device_dense: str = "",
                                device_sparse: str = "", compression: Any = Compression.none,
                                sparse_as_dense: bool = False, gradient_predivide_factor: float = 1.0,
                                op: int = Average, groups: Any = None, process_set: Any = None,
                                local_layers: Any = None, scale_local_gradients: bool = True) -> Any:
    """Make a Keras ``DistributedOptimizer`` that keeps the gradients of some layers on this rank.

    >>> model.compile(hvd.PartialDistributedOptimizer(opt, local_layers=model.layers[-1]), loss="mse")

    Args:
        optimizer: the Keras 3 or Keras 2 optimizer to wrap.
        name: the wrapped optimizer's name. The default, None, keeps the optimizer's own name.
        device_dense: accepted for Horovod's signature; it must stay empty. Gradients are reduced where they live.
        device_sparse: accepted for Horovod's signature; it must stay empty.
        compression: ``hvd.Compression.none`` (the default), or ``hvd.Compression.fp16`` to send floating gradients
            as float16.
        sparse_as_dense: reduce ``tf.IndexedSlices`` gradients as dense tensors. By default, False, they are
            allgathered, as in Horovod.
        gradient_predivide_factor: with ``hvd.Average``, divide the gradients by this factor before the sum, and
            multiply the sum by ``factor / size`` after it. Ignored with other ops. Defaults to 1.0.
        op: the reduction: ``hvd.Average`` (the default) or ``hvd.Sum``.
        groups: accepted for Horovod's signature; it must stay None.
        process_set: reduce over the ranks of this ``hvd.ProcessSet``. A rank outside it keeps its own gradients.
            The default, None, means every rank.
        local_layers: a Keras layer, or a list of them, whose weights' gradients stay on this rank. The default,
            None, keeps none local.
        scale_local_gradients: divide the gradients of local variables by the number of ranks that reduce, as
            Horovod does. Defaults to True.

    Returns:
        The optimizer that ``DistributedOptimizer`` returns, with the weights of ``local_layers`` as local
        variables. A layer built after the call counts too.

    Raises:
        TypeError: ``optimizer`` is not a Keras optimizer.
        ValueError: ``op`` is neither ``hvd.Average`` nor ``hvd.Sum``; ``device_dense``, ``device_sparse`` or
            ``groups`` is set; ``process_set`` is neither None nor an ``hvd.ProcessSet``; or ``local_layers`` holds
            something other than Keras layers.
    """
    reject_unsupported("hvd.PartialDistributedOptimizer", device_dense=device_dense, device_sparse=device_sparse,
                       groups=groups)
    check_op(op, (Average, Sum), "hvd.PartialDistributedOptimizer", error=ValueError)
    if not (keras_flavour.is_keras2_object(optimizer) or _is_keras3_optimizer(optimizer)):
        raise TypeError(f"PartialDistributedOptimizer wraps a Keras optimizer, not {type(optimizer).__name__}.")
    layers = _local_layers(local_layers)
    wrapped = DistributedOptimizer(optimizer, name=name, compression=compression, sparse_as_dense=sparse_as_dense,
                                   op=op, gradient_predivide_factor=gradient_predivide_factor,
                                   device_dense=device_dense, device_sparse=device_sparse, process_set=process_set,
                                   groups=groups, scale_local_gradients=scale_local_gradients)
    wrapped._hvd_local.add_layers(layers)
    return wrapped


def load_model(filepath: str, custom_optimizers: list[Any] | None = None, custom_objects: dict | None = None,
               compression: Any = Compression.none) -> Any:
    """Load a Keras model saved with a ``DistributedOptimizer``, and wrap its optimizer again.

    The optimizer's state, such as its step count and moments, is restored. Every rank loads the same file: put it
    where all ranks see it, or load it on rank 0 and share the weights with ``BroadcastGlobalVariablesCallback``.

    Args:
        filepath: the saved model's path.
        custom_optimizers: the classes of your own optimizers that the file may hold. Defaults to None.
        custom_objects: passed to ``keras.models.load_model``, added to the optimizers. Defaults to None.
        compression: the compression of the rebuilt ``DistributedOptimizer``. Defaults to ``hvd.Compression.none``.

    Returns:
        The loaded ``keras.Model``, compiled with a ``DistributedOptimizer`` where it was saved with one.

    Raises:
        ValueError: Keras cannot load ``filepath``, such as a missing ``.keras`` file or an unsupported format.
        OSError: an HDF5 file cannot be opened.
    """
    keras = keras_flavour.keras()
    by_name: dict[str, list[type]] = {}
    for cls in list(custom_optimizers or []) + _optimizer_classes(keras):
        by_name.setdefault(cls.__name__, []).append(cls)
    objects: dict[str, Any] = {}
    for name, classes in by_name.items():
        if keras_flavour.keras2():  # Keras 2 saves a wrapped optimizer under its own class's name
            objects[name] = objects[name.lower()] = _rewrapping(classes, name, compression)
        else:
            objects[f"Distributed{name}"] = _rewrapping(classes, f"Distributed{name}", compression)
    objects.update(custom_objects or {})
    return keras.models.load_model(filepath, custom_objects=objects)


def _optimizer_classes(keras: Any) -> list[type]:
    """The optimizer classes of ``keras.optimizers`` (and, in Keras 2, of ``keras.optimizers.legacy``)."""
    found = []
    for module in (keras.optimizers, getattr(keras.optimizers, "legacy", None)):
        base = getattr(module, "Optimizer", None)
        found += [c for c in vars(module).values()
                  if isinstance(c, type) and base is not None and issubclass(c, base) and c is not base]
    return found


def _rewrapping(classes: list[type], name: str, compression: Any) -> Any:
    """A stand-in class named ``name`` that Keras's deserialisation calls to rebuild a wrapped optimizer: of
    ``classes`` (Keras 2 has a legacy and a new ``SGD``), the first of the kind the saved config names."""

    def from_config(_: Any, config: dict, custom_objects: Any = None) -> Any:
        config = dict(config)
        passes = config.pop("gradient_accumulation_steps", None) or 1
        legacy = config.get("is_legacy_optimizer", True)  # (Keras 2's rule: a config without it is a legacy one's)
        cls = next((c for c in classes if keras2.is_legacy_optimizer_class(c) == legacy), classes[0])
        return DistributedOptimizer(cls.from_config(config), compression=compression,
                                    backward_passes_per_step=passes)

    return type(name, (classes[0],), {"from_config": classmethod(from_config)})


def shard(data: Any) -> Any:
    """Return this rank's part of a dataset: the rows ``rank, rank + size, rank + 2 * size``, and so on.

    Arrays keep ``len // size`` rows on every rank, so that every rank runs the same number of steps; the last ``len
    % size`` rows are dropped. A rank with one batch more would wait for the others in its extra allreduce. A
    ``tf.data.Dataset`` is ``dataset.shard(size, rank)``, which gives the first ``len % size`` ranks one element
    more: batch it with ``drop_remainder=True``, or repeat it.

    Args:
        data: a numpy array or anything a slice indexes; a tuple or list of them, sharded alike so that features and
            labels stay paired; or a ``tf.data.Dataset``.

    Returns:
        This rank's part, of ``data``'s type: an array slice, a tuple or list of them, or a dataset.

    Raises:
        ValueError: the runtime is not initialised.
    """
    size, rank = basics.size(), basics.rank()
    if isinstance(data, (tuple, list)):
        return type(data)(shard(d) for d in data)
    if type(data).__module__.startswith("tensorflow") and hasattr(data, "shard"):
        return data.shard(size, rank)
    keep = (len(data) // size) * size
    return data[rank:keep:size]


def scale_lr(base_lr: float, rule: str = "linear") -> float:
    """Scale a learning rate tuned for one rank to ``size()`` ranks.

    Args:
        base_lr: the learning rate for one rank.
        rule: ``"linear"`` (the default) gives ``base_lr * size``, as Goyal et al. (2017); pair it with
            ``LearningRateWarmupCallback``. ``"sqrt"`` gives ``base_lr * sqrt(size)``, often better for adaptive
            optimizers such as Adam.

    Returns:
        The scaled learning rate, as a float.

    Raises:
        ValueError: ``rule`` is neither ``"linear"`` nor ``"sqrt"``, or the runtime is not initialised.
    """
    if rule == "linear":
        return base_lr * basics.size()
    if rule == "sqrt":
        return base_lr * math.sqrt(basics.size())
    raise ValueError(f"scale_lr(rule={rule!r}): use 'linear' or 'sqrt'.")


__all__ = ["DistributedGradientTape", "DistributedOptimizer", "LocalVariables", "PartialDistributedGradientTape",
           "PartialDistributedOptimizer", "load_model", "scale_lr", "shard"]
