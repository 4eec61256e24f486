"""Keras 3 training on the runtime: ``DistributedOptimizer``,
``DistributedGradientTape``, ``shard`` and ``scale_lr``; ``DistributedOptimizer``
of a TF1 ``tf.compat.v1.train.Optimizer`` is built by ``tf1``.

Horovod's Keras layer stops at Keras 2. Here ``DistributedOptimizer(opt)``
returns an optimizer of a subclass of ``type(opt)`` built from the same config,
whose ``apply`` first averages the gradients over all ranks with one fused
``grouped_allreduce``: inside ``model.fit``'s compiled step that is a single
``tf.numpy_function`` around MPI.
"""

from __future__ import annotations

import math
from typing import Any

from . import basics
from .collectives import not_converted, reject_unsupported
from .compression import Compression
from .gradients import reduce_gradients
from .ops import Adasum, Average, Sum


def DistributedOptimizer(optimizer: Any, name: str | None = None, compression: Any = Compression.none,
                         sparse_as_dense: bool = False, backward_passes_per_step: int = 1, op: int = Average,
                         gradient_predivide_factor: float = 1.0, average_aggregated_gradients: bool = False,
                         device_dense: str = "", device_sparse: str = "", process_set: Any = None,
                         num_groups: int = 0, groups: Any = None, use_locking: bool = False) -> Any:
    """Wrap a Keras 3 optimizer (or a TF1 ``tf.compat.v1.train.Optimizer``) so that
    gradients are reduced over all ranks before each update.

    >>> opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size(), momentum=0.9))
    >>> model.compile(opt, loss="sparse_categorical_crossentropy")

    ``backward_passes_per_step=k`` accumulates k local steps (Keras's own
    gradient accumulation) and reduces once per k, summing the k gradients
    unless ``average_aggregated_gradients``. ``use_locking`` applies to TF1
    optimizers only.
    """
    import keras

    from . import tf1

    reject_unsupported("hvd.DistributedOptimizer", device_dense=device_dense, device_sparse=device_sparse,
                       process_set=process_set, num_groups=num_groups, groups=groups)
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step={backward_passes_per_step} must be at least 1.")
    if op not in (Average, Sum, Adasum):
        raise ValueError("DistributedOptimizer reduces with op=hvd.Average or hvd.Sum.")
    settings = dict(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                    predivide=gradient_predivide_factor)
    k = backward_passes_per_step
    if tf1.is_v1_optimizer(optimizer):
        return tf1.distributed_v1_optimizer(optimizer, name, use_locking, settings, k, average_aggregated_gradients)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(f"DistributedOptimizer wraps a Keras 3 optimizer or a tf.compat.v1.train.Optimizer, "
                        f"not {type(optimizer).__name__}.")
    if use_locking:
        raise ValueError("DistributedOptimizer(use_locking=True) applies to TF1 optimizers only: Keras 3 "
                         "optimizers have no locking; omit it.")
    return _distributed_keras_optimizer(optimizer, name, settings, k, average_aggregated_gradients)


def _distributed_keras_optimizer(optimizer: Any, name: str | None, settings: dict[str, Any], k: int,
                                 average_aggregated_gradients: bool) -> Any:
    """A copy of a Keras 3 optimizer, of a subclass of its class whose update reduces the gradients first."""
    base = type(optimizer)

    class _Distributed(base):  # type: ignore[misc, valid-type]
        _hvd_settings = settings
        _hvd_passes = k
        _hvd_average_aggregated = average_aggregated_gradients

        @not_converted
        def apply(self, grads: Any, trainable_variables: Any = None) -> Any:
            grads = list(grads)
            if self._hvd_passes == 1:
                grads = reduce_gradients(grads, **self._hvd_settings)
            return super().apply(grads, trainable_variables)

        @not_converted
        def _backend_update_step(self, grads: Any, trainable_variables: Any, learning_rate: Any) -> Any:
            if self._hvd_passes > 1:  # Keras hands over the mean of the k accumulated gradients
                grads = reduce_gradients(list(grads), **self._hvd_settings)
                if not self._hvd_average_aggregated:
                    grads = [None if g is None else g * self._hvd_passes for g in grads]
            return super()._backend_update_step(grads, trainable_variables, learning_rate)

    _install_compile_hook()
    _Distributed.__name__ = _Distributed.__qualname__ = f"Distributed{base.__name__}"
    config = optimizer.get_config()
    if k > 1:
        config["gradient_accumulation_steps"] = k
    if name:
        config["name"] = name
    return _Distributed.from_config(config)


def _install_compile_hook() -> None:
    """Keras's jit_compile="auto" would compile the host-side reduction with XLA: see keras_patches."""
    from .. import keras_patches

    keras_patches.patch_compile()


class DistributedGradientTape:
    """A ``tf.GradientTape`` whose ``gradient()`` returns gradients reduced over all ranks.

    >>> with tf.GradientTape() as tape:
    ...     loss = loss_fn(model(x), y)
    >>> tape = hvd.DistributedGradientTape(tape)
    >>> grads = tape.gradient(loss, model.trainable_variables)
    """

    def __init__(self, gradtape: Any, device_dense: str = "", device_sparse: str = "",
                 compression: Any = Compression.none, sparse_as_dense: bool = False, op: int = Average,
                 gradient_predivide_factor: float = 1.0, num_groups: int = 0, groups: Any = None,
                 process_set: Any = None) -> None:
        reject_unsupported("hvd.DistributedGradientTape", device_dense=device_dense, device_sparse=device_sparse,
                           process_set=process_set, num_groups=num_groups, groups=groups)
        self._tape = gradtape
        self._settings = dict(op=op, compression=compression, sparse_as_dense=sparse_as_dense,
                              predivide=gradient_predivide_factor)

    @not_converted
    def gradient(self, target: Any, sources: Any, output_gradients: Any = None, **kwargs: Any) -> Any:
        import tensorflow as tf

        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat = tf.nest.flatten(grads)
        return tf.nest.pack_sequence_as(grads, reduce_gradients(flat, **self._settings))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._tape.__exit__(*exc)


def load_model(filepath: str, custom_optimizers: list[Any] | None = None, custom_objects: dict | None = None,
               compression: Any = Compression.none) -> Any:
    """Load a model saved (on rank 0) with a ``DistributedOptimizer``; its optimizer
    is wrapped again, with its state (step count, moments) restored.

    Every rank loads the same file: either put it where all ranks see it, or
    load on rank 0 and broadcast with ``BroadcastGlobalVariablesCallback``.
    ``custom_optimizers`` lists the classes of your own optimizers.
    """
    import keras

    objects = dict(custom_objects or {})
    classes = [c for c in vars(keras.optimizers).values()
               if isinstance(c, type) and issubclass(c, keras.optimizers.Optimizer)]
    for cls in classes + list(custom_optimizers or []):
        objects[f"Distributed{cls.__name__}"] = _rewrapping(cls, compression)
    return keras.models.load_model(filepath, custom_objects=objects)


def _rewrapping(cls: Any, compression: Any) -> Any:
    """A stand-in class that Keras's deserialisation calls to rebuild a wrapped optimizer."""

    def from_config(_: Any, config: dict, custom_objects: Any = None) -> Any:
        config = dict(config)
        passes = config.pop("gradient_accumulation_steps", None) or 1
        return DistributedOptimizer(cls.from_config(config), compression=compression,
                                    backward_passes_per_step=passes)

    return type(f"Distributed{cls.__name__}", (cls,), {"from_config": classmethod(from_config)})


def shard(data: Any) -> Any:
    """This rank's part of ``data``: rows ``rank, rank + size, rank + 2*size, ...``.

    A numpy array (or anything indexable by a slice), a tuple or list of them
    (sharded alike, so features and labels stay paired), or a
    ``tf.data.Dataset``. Arrays keep ``len // size`` rows on every rank, so
    that every rank runs the same number of steps (a rank with one batch more
    would wait for the others in its extra allreduce); the last ``len % size``
    rows are dropped. A dataset is ``dataset.shard(size, rank)``, which gives
    the first ``len % size`` ranks one element more: batch it with
    ``drop_remainder=True`` or repeat it.
    """
    size, rank = basics.size(), basics.rank()
    if isinstance(data, (tuple, list)):
        return type(data)(shard(d) for d in data)
    if type(data).__module__.startswith("tensorflow") and hasattr(data, "shard"):
        return data.shard(size, rank)
    keep = (len(data) // size) * size
    return data[rank:keep:size]


def scale_lr(base_lr: float, rule: str = "linear") -> float:
    """The learning rate for ``size()`` ranks from one tuned for one rank.

    ``linear`` (Goyal et al. 2017: ``base_lr * size``, pair it with
    ``LearningRateWarmupCallback``) or ``sqrt`` (``base_lr * sqrt(size)``,
    often better for adaptive optimizers such as Adam)."""
    if rule == "linear":
        return base_lr * basics.size()
    if rule == "sqrt":
        return base_lr * math.sqrt(basics.size())
    raise ValueError(f"scale_lr(rule={rule!r}): use 'linear' or 'sqrt'.")


__all__ = ["DistributedGradientTape", "DistributedOptimizer", "load_model", "scale_lr", "shard"]
