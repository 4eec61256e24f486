"""Every global change hvd_notebook makes to Keras, in one place, with ``undo``.

The patches, each applied at most once per process:

- ``fit``/``evaluate``/``predict`` of ``keras.Model`` add the dashboard's
  ``ProgressCallback`` (``patch_progress``, from ``engine.keras_progress``);
- ``train_step`` tells a ``DistributedOptimizer`` its batch size (``patch_train_step``, from the
  runtime's ``DistributedOptimizer``, for the gradient noise scale);
- ``compile`` switches XLA off where ``jit_compile="auto"`` would compile a
  ``DistributedOptimizer``'s host-side reduction (``patch_compile``, from the
  runtime's ``DistributedOptimizer``);
- for Horovod's TensorFlow code written against Keras 2 (``patch_keras2_idioms``, from the TensorFlow binding's
  ``hvd.init()``): ``BatchNormalization`` takes ``fused=False``, which Keras 3 dropped, and a TF1 session
  fetches a Keras variable (``session.run(layer.moving_mean)``) and ``variable.ref()`` gives a hashable
  reference, as for Keras 2's ``tf.Variable``.

``patched()`` lists what is patched now; ``undo()`` puts the originals back.
This module imports nothing of the package but ``keras_flavour`` (which Keras), and imports Keras only
when a patch is applied.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import keras_flavour

log = logging.getLogger(__name__)

Wrapper = Callable[[Callable[..., Any]], Callable[..., Any]]
_MISSING = object()


@dataclass(frozen=True)
class Patch:
    """One replaced attribute: where, and what was there before."""

    owner: type
    name: str
    original: Any  # the owner's own attribute, or _MISSING where it inherited one

    def __str__(self) -> str:
        return f"{self.owner.__module__}.{self.owner.__qualname__}.{self.name}"


_applied: list[Patch] = []


def patch(owner: type, name: str, wrap: Wrapper) -> bool:
    """Replace ``owner.name`` with ``wrap(owner.name)`` (``wrap(None)`` where it has none), once; False when it
    already is.

    >>> patch(keras.Model, "fit", with_progress)
    True
    """
    if any(p.owner is owner and p.name == name for p in _applied):
        return False
    current = getattr(owner, name, None)
    _applied.append(Patch(owner, name, owner.__dict__.get(name, _MISSING)))
    setattr(owner, name, wrap(current))
    return True


def patched() -> list[str]:
    """What is patched now, as ``module.Class.attribute``."""
    return [str(p) for p in _applied]


def undo() -> None:
    """Restore every original, newest patch first."""
    while _applied:
        p = _applied.pop()
        if p.original is _MISSING:
            delattr(p.owner, p.name)  # the class inherited it: inherit it again
        else:
            setattr(p.owner, p.name, p.original)


def patch_progress(wrap: Wrapper) -> None:
    """``Model.fit``, ``evaluate`` and ``predict`` through ``wrap`` (the progress hook), of the Keras this
    process trains with (``keras_flavour``: Keras 3, or Keras 2's ``tf_keras``)."""
    for name in ("fit", "evaluate", "predict"):
        patch(keras_flavour.keras().Model, name, wrap)


def patch_compile() -> None:
    """Keras's ``jit_compile="auto"`` turns XLA on wherever a GPU is visible, and
    XLA cannot compile the host-side reduction. After ``Model.compile`` with a
    ``DistributedOptimizer`` and jit left at "auto", switch XLA off for that
    model (with one log line); an explicit ``jit_compile=True`` is kept and
    fails at trace time with ``hvd.XLAUnsupportedError``."""
    import keras

    # patch the class that defines compile: Keras skips compile() on load for a
    # model class whose compile differs from that one's
    owner = next(cls for cls in keras.Model.__mro__ if "compile" in cls.__dict__)
    patch(owner, "compile", _without_auto_xla)


def _without_auto_xla(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compile(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        try:
            asked = signature.bind_partial(self, *args, **kwargs).arguments.get("jit_compile", "auto")
        except TypeError:  # arguments this Keras version's signature does not name
            asked = kwargs.get("jit_compile", "auto")
        if asked == "auto" and getattr(self.optimizer, "_hvd_settings", None) is not None and self.jit_compile:
            self.jit_compile = False
            log.info("hvd: jit_compile='auto' would compile the training step with XLA, which cannot run "
                     "DistributedOptimizer's reduction; compiling it without XLA.")
        return result

    return compile


def patch_train_step(wrap: Wrapper) -> None:
    """``Model.train_step`` through ``wrap`` (it tells a ``DistributedOptimizer`` the step's batch size, for the
    gradient noise scale), of the Keras this process trains with; a model class with its own ``train_step``
    keeps it."""
    patch(keras_flavour.keras().Model, "train_step", wrap)


def patch_keras2_idioms() -> None:
    """What Horovod's TensorFlow code does that Keras 3 no longer takes:

    - ``BatchNormalization(fused=False)``: Keras 2 took it for its unfused kernel, the only one a synchronised
      batch norm can follow. Accept ``fused=False`` and ``None`` (Keras 3 has only that kernel) and refuse
      ``fused=True`` saying so.
    - ``session.run(variable)`` in a TF1 graph: a Keras 3 variable is no ``tf.Variable``, so a session cannot
      fetch it. Give it the graph element of the ``tf.Variable`` it holds.
    - ``variable.ref()`` (a ``tf.Variable``'s hashable reference, a dict key): the held ``tf.Variable``'s."""
    import keras

    patch(keras.layers.BatchNormalization, "__init__", _without_fused)
    if keras.backend.backend() == "tensorflow":
        patch(keras.Variable, "_as_graph_element", lambda _: _graph_element)
        patch(keras.Variable, "ref", lambda _: _ref)


def _graph_element(self: Any) -> Any:
    return self.value._as_graph_element()


def _ref(self: Any) -> Any:
    return self.value.ref()


def _without_fused(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, fused: bool | None = None, **kwargs: Any) -> None:
        if fused:
            raise ValueError(f"{type(self).__name__}(fused=True): Keras 3 has no fused batch normalization; "
                             "pass fused=False or leave fused out.")
        original(self, *args, **kwargs)

    # Keras's Layer.__new__ reads the signature (which follows __wrapped__) and the argument spec (which does
    # not) of __init__ and must find them alike: this one's, which has *args
    del __init__.__wrapped__
    return __init__
