"""``import horovod.tensorflow as hvd`` (or ``horovod.torch``) gives hvd_notebook's runtime where no real
Horovod is installed.

``hvd_notebook-horovod.pth`` in site-packages imports this module at interpreter start and calls
``install()``, which appends ``HorovodAliasFinder`` to ``sys.meta_path`` (the way setuptools' editable
installs and ``distutils-precedence.pth`` work). The finder answers only for the few ``horovod`` names of
``ALIASES``, only when no other finder finds a real ``horovod``, and only while ``HVD_NOTEBOOK_HOROVOD_ALIAS``
is on. Nothing else is imported until a ``horovod`` module is: interpreter start stays as cheap as it was.

Each alias is a thin module that forwards every attribute to its runtime module, so
``horovod.tensorflow.allreduce is hvd_notebook.runtime.allreduce``. This module lives outside the
``hvd_notebook`` package so that interpreter start does not import (and pin) the package.
"""

from __future__ import annotations

import sys

# alias -> the runtime module it forwards to (None: an empty package)
ALIASES = {
    "horovod": None,
    "horovod.tensorflow": "hvd_notebook.runtime",
    "horovod.tensorflow.util": "hvd_notebook.runtime.basics",  # _executing_eagerly, which Horovod's tests import
    "horovod.tensorflow.compression": "hvd_notebook.runtime.compression",
    "horovod.tensorflow.keras": "hvd_notebook.runtime.keras",
    "horovod.tensorflow.keras.callbacks": "hvd_notebook.runtime.callbacks",
    "horovod.keras": "hvd_notebook.runtime.keras",
    "horovod.keras.callbacks": "hvd_notebook.runtime.callbacks",
    "horovod.tensorflow.elastic": "hvd_notebook.runtime.elastic",
    "horovod.tensorflow.keras.elastic": "hvd_notebook.runtime.elastic",
    "horovod.keras.elastic": "hvd_notebook.runtime.elastic",
    "horovod.common": None,
    "horovod.common.elastic": "hvd_notebook.runtime.elastic",  # State, ObjectState
    "horovod.common.exceptions": "hvd_notebook.runtime.elastic",  # HorovodInternalError, HostsUpdatedInterrupt
    "horovod.torch": "hvd_notebook.runtime.torch",
    "horovod.torch.mpi_ops": "hvd_notebook.runtime.torch",  # Horovod's mpi_ops holds the queries too
    "horovod.torch.compression": "hvd_notebook.runtime.torch.compression",
    "horovod.torch.functions": "hvd_notebook.runtime.torch.functions",
    "horovod.torch.optimizer": "hvd_notebook.runtime.torch.optimizer",
    "horovod.torch.sync_batch_norm": "hvd_notebook.runtime.torch.sync_batch_norm",
}
PACKAGES = frozenset({"horovod", "horovod.tensorflow", "horovod.tensorflow.keras", "horovod.keras", "horovod.common",
                      "horovod.torch"})
MARKER = "__hvd_notebook_alias__"  # set on every alias module: the runtime module it stands for


def alias_enabled() -> bool:
    """``HVD_NOTEBOOK_HOROVOD_ALIAS`` (hvd_notebook.config), read when a horovod module is imported."""
    try:
        from hvd_notebook.config import HOROVOD_ALIAS
    except ImportError:  # the package is gone but this .pth stayed: stay out of the way
        return False
    return HOROVOD_ALIAS.flag()


class HorovodAliasFinder:
    """A meta-path finder and loader for the alias modules of ``ALIASES``."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        """A spec for an alias name when no real Horovod is installed and the alias is on; else None."""
        if fullname not in ALIASES or not alias_enabled():
            return None
        if fullname == "horovod":
            if self._real_horovod():
                return None
        elif not hasattr(sys.modules.get("horovod"), MARKER):  # below a real horovod: not ours
            return None
        from importlib.machinery import ModuleSpec

        return ModuleSpec(fullname, self, is_package=fullname in PACKAGES)

    def _real_horovod(self) -> bool:
        """Does any other finder (sys.path's first) find a ``horovod`` package?"""
        from importlib.machinery import PathFinder

        if PathFinder.find_spec("horovod") is not None:
            return True
        others = [f for f in sys.meta_path if f is not self and f is not PathFinder and hasattr(f, "find_spec")]
        return any(f.find_spec("horovod", None) is not None for f in others)

    def create_module(self, spec: object) -> None:
        return None  # the default module object

    def exec_module(self, module: object) -> None:
        """Point the alias at its runtime module (imported now, so that its import errors show here)."""
        target_name = ALIASES[module.__name__]
        setattr(module, MARKER, target_name or "")
        if target_name is None:
            module.__doc__ = "hvd_notebook's stand-in for Horovod (no real horovod is installed here)."
            return
        import importlib

        target = importlib.import_module(target_name)
        module.__doc__ = target.__doc__

        def forward(name: str) -> object:
            try:
                return getattr(target, name)
            except AttributeError:
                raise AttributeError(f"module {module.__name__!r} (hvd_notebook's {target_name}) has no "
                                     f"attribute {name!r}") from None

        module.__getattr__ = forward
        module.__dir__ = lambda: sorted(set(dir(target)) | set(vars(module)))


def install() -> None:
    """Append the finder to ``sys.meta_path`` once (what the .pth file calls)."""
    if not any(type(f).__name__ == HorovodAliasFinder.__name__ for f in sys.meta_path):
        sys.meta_path.append(HorovodAliasFinder())
