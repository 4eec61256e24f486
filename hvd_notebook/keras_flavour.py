"""Which Keras this process trains with: Keras 3 (``keras``), or Keras 2 (``tf_keras``) where
``TF_USE_LEGACY_KERAS`` asks for it, the way TensorFlow's own ``tf.keras`` chooses.

TensorFlow 2.16 and later make ``tf.keras`` Keras 3 unless ``TF_USE_LEGACY_KERAS`` is ``1``, ``true`` or
``True`` when TensorFlow is imported; then ``tf.keras`` is ``tf_keras``, Keras 2 as it was up to TensorFlow
2.15 (``import keras`` stays Keras 3). The runtime's Keras binding, the progress hook and the patches all
follow this one choice, so a cluster uses one Keras. This module imports nothing of the package and imports
Keras only when asked for it.

>>> keras_flavour.keras()          # the module that tf.keras is: keras, or tf_keras
>>> keras_flavour.label()          # 'Keras 3.15.1', or 'Keras 2 (tf_keras 2.21.0)'
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import sys
from typing import Any

VARIABLE = "TF_USE_LEGACY_KERAS"
_LEGACY_VALUES = ("true", "True", "1")  # exactly what TensorFlow's lazy loader of tf.keras accepts


def keras2() -> bool:
    """Does this process use Keras 2 (``tf_keras``), as ``TF_USE_LEGACY_KERAS`` says to TensorFlow?"""
    return os.environ.get(VARIABLE) in _LEGACY_VALUES


def module_name() -> str:
    """``tf_keras`` or ``keras``: the top-level module that ``tf.keras`` stands for here."""
    return "tf_keras" if keras2() else "keras"


def keras() -> Any:
    """The Keras module this process trains with (the one ``tf.keras`` is). ``ImportError`` saying what
    to install where ``TF_USE_LEGACY_KERAS`` asks for Keras 2 and ``tf_keras`` is missing."""
    name = module_name()
    module = sys.modules.get(name)
    if module is not None:
        return module
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if name == "tf_keras":
            raise ImportError(missing_tf_keras()) from exc
        raise


def missing_tf_keras() -> str:
    """What to say where Keras 2 is asked for and ``tf_keras`` does not import."""
    version = _version("tensorflow") or _version("tensorflow-cpu")
    pin = f"=={version}" if version else ""
    return (f"{VARIABLE}={os.environ.get(VARIABLE)} asks for Keras 2, but the tf_keras package is not installed: "
            f"pip install --no-deps tf_keras{pin} (TensorFlow's own Keras 2, the same version as TensorFlow; "
            f"make install does it), or unset {VARIABLE} for Keras 3.")


def label() -> str:
    """``Keras 3.15.1`` or ``Keras 2 (tf_keras 2.21.0)``, from the installed distributions' metadata (nothing
    is imported); ``Keras 2 (tf_keras missing)`` where it is asked for and absent."""
    if keras2():
        return f"Keras 2 (tf_keras {_version('tf_keras') or 'missing'})"
    return f"Keras {_version('keras') or 'missing'}"


def is_keras2_object(obj: Any) -> bool:
    """Is ``obj`` (an optimizer, a layer, a model) one of ``tf_keras``'s, whichever Keras this process chose?"""
    return any(cls.__module__.startswith("tf_keras.") for cls in type(obj).__mro__)


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


__all__ = ["VARIABLE", "is_keras2_object", "keras", "keras2", "label", "missing_tf_keras",
           "module_name"]
