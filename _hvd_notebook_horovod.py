"""``import horovod.tensorflow as hvd`` (or ``horovod.torch``) gives hvd_notebook's runtime where no real
Horovod is installed.

``hvd_notebook-horovod.pth`` in site-packages imports this module at interpreter start and calls
``install()``, which appends ``HorovodAliasFinder`` to ``sys.meta_path`` (the way setuptools' editable
installs and ``distutils-precedence.pth`` work). The finder answers only for the ``horovod`` names
that map, by ``PREFIXES``, to a module of the runtime, only when no other finder finds a real ``horovod``,
and only while ``HVD_NOTEBOOK_HOROVOD_ALIAS`` is on. Nothing else is imported until a ``horovod`` module
is: interpreter start stays as cheap as it was.

Each alias is a thin module that forwards every attribute to its runtime module, so
``horovod.tensorflow.allreduce is hvd_notebook.runtime.allreduce``; a public name is kept on the alias once read,
so that a training loop's ``hvd.allreduce(t, op=hvd.Sum)`` pays no forwarding call. This module lives outside the
``hvd_notebook`` package so that interpreter start does not import (and pin) the package.
"""

from __future__ import annotations

import sys

# Horovod's package -> the runtime's package that stands for it; a module below one of them maps to the same
# path below the other (``horovod.torch.optimizer`` -> ``hvd_notebook.runtime.torch.optimizer``). The longest
# prefix wins; None: an empty package.
PREFIXES = {
    "horovod": None,
    "horovod.common": "hvd_notebook.runtime.core",
    "horovod.tensorflow": "hvd_notebook.runtime.tensorflow",
    "horovod.tensorflow.keras": "hvd_notebook.runtime.keras",
    "horovod.keras": "hvd_notebook.runtime.keras",
    "horovod.torch": "hvd_notebook.runtime.torch",
}
MARKER = "__hvd_notebook_alias__"  # set on every alias module: the runtime module it stands for


def target_of(fullname: str) -> tuple[bool, str | None]:
    """(Is ``fullname`` one of ours, the runtime module it stands for): by the longest prefix of ``PREFIXES``."""
    parts = fullname.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in PREFIXES:
            base = PREFIXES[prefix]
            if base is None:
                return (n == len(parts), None)  # below an empty package: nothing
            return True, ".".join([base, *parts[n:]])
    return False, None


def alias_enabled() -> bool:
    """``HVD_NOTEBOOK_HOROVOD_ALIAS`` (hvd_notebook.config), read when a horovod module is imported."""
    try:
        from hvd_notebook.config import HOROVOD_ALIAS
    except ImportError:  # the package is gone but this .pth stayed: stay out of the way
        return False
    return HOROVOD_ALIAS.flag()


class HorovodAliasFinder:
    """A meta-path finder and loader for the alias modules of ``PREFIXES``."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> object:
        """A spec for an alias name when no real Horovod is installed and the alias is on; else None."""
        ours, target = target_of(fullname)
        if not ours or not alias_enabled():
            return None
        if fullname == "horovod":
            if self._real_horovod():
                return None
        elif not hasattr(sys.modules.get("horovod"), MARKER):  # below a real horovod: not ours
            return None
        from importlib.machinery import ModuleSpec

        if target is None:
            return ModuleSpec(fullname, self, is_package=True)
        from importlib.util import find_spec

        try:
            spec = find_spec(target)
        except ModuleNotFoundError:
            spec = None
        if spec is None:  # a Horovod module the runtime has no counterpart of: not found, as usual
            return None
        return ModuleSpec(fullname, self, is_package=spec.submodule_search_locations is not None)

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
        target_name = target_of(module.__name__)[1]
        setattr(module, MARKER, target_name or "")
        if target_name is None:
            module.__doc__ = "hvd_notebook's stand-in for Horovod (no real horovod is installed here)."
            return
        import importlib

        target = importlib.import_module(target_name)
        module.__doc__ = target.__doc__

        def forward(name: str) -> object:
            try:
                value = getattr(target, name)
            except AttributeError:
                raise AttributeError(f"module {module.__name__!r} (hvd_notebook's {target_name}) has no "
                                     f"attribute {name!r}") from None
            if not name.startswith("_"):  # kept: the next lookup is a plain one, not this call
                setattr(module, name, value)  # (the runtime never rebinds a public name; private state it may)
            return value

        module.__getattr__ = forward
        module.__dir__ = lambda: sorted(set(dir(target)) | set(vars(module)))


def install() -> None:
    """Append the finder to ``sys.meta_path`` once (what the .pth file calls)."""
    if not any(type(f).__name__ == HorovodAliasFinder.__name__ for f in sys.meta_path):
        sys.meta_path.append(HorovodAliasFinder())
