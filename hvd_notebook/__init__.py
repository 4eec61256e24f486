"""hvd_notebook: interactive, data-parallel TensorFlow training from a notebook.

>>> %load_ext hvd_notebook
>>> %hvd start -n 2

The notebook kernel never imports TensorFlow: only the engines do.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    """``hvd_notebook.ProgressCallback`` (on the engines: it imports Keras) and ``hvd_notebook.progress``."""
    if name == "ProgressCallback":
        from .engine.progress import callback_class

        return callback_class()
    if name == "progress":
        import importlib

        return importlib.import_module(".progress", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%hvd`` and ``%%hvd`` (called by ``%load_ext hvd_notebook``)."""
    from .kernel.magics import HvdMagics

    ipython.register_magics(HvdMagics)


def unload_ipython_extension(ipython: Any) -> None:
    """Stop this kernel's cluster when the extension is unloaded."""
    from .kernel.session import Session

    Session.get().stop()
