"""hvd_notebook: interactive, data-parallel TensorFlow and PyTorch training from a notebook.

>>> %load_ext hvd_notebook
>>> %hvd start -n 2

The notebook kernel never imports TensorFlow or PyTorch: only the engines do.
"""

from __future__ import annotations

from typing import Any

from . import progress as progress  # hvd_notebook.progress.report, for custom loops (imports no framework)

__version__ = "0.1.0"


def ProgressCallback(batch_size: int | None = None, num_samples: int | None = None) -> Any:  # noqa: N802
    """A Keras callback (``engine/keras_progress.ProgressCallback``) that reports this rank's ``fit``, ``evaluate``
    and ``predict`` progress to the dashboard; ``%%hvd`` cells add one by themselves. It imports Keras, which
    the notebook kernel never does: hence a function that makes one, not the class itself.

    >>> model.fit(dataset, epochs=3, callbacks=[hvd_notebook.ProgressCallback(batch_size=64)])
    """
    from .engine.keras_progress import ProgressCallback as Callback

    return Callback(batch_size, num_samples)


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%hvd`` and ``%%hvd`` (called by ``%load_ext hvd_notebook``) and the extension's two hooks in
    the shell: ``%hvd auto``'s input transformer, and completion and inspection of ``%%hvd`` cells from rank 0.

    Args:
        ipython: the shell (IPython's ``InteractiveShell``) loading the extension. Loading twice changes nothing.
    """
    from .kernel import completion, waiting
    from .kernel.auto import AutoCells
    from .kernel.magics import HvdMagics

    ipython.register_magics(HvdMagics(ipython, auto=AutoCells(ipython).install()))
    completion.install(ipython)
    waiting.install(ipython)  # (a start waiting in the node's queue for GPUs: a line in its cell)


def unload_ipython_extension(ipython: Any) -> None:
    """Stop this kernel's cluster when the extension is unloaded; cells run, complete and are inspected in this
    kernel again.

    Args:
        ipython: the shell the extension was loaded into.
    """
    from .kernel import completion
    from .kernel.session import Session

    completion.uninstall(ipython)
    magics = ipython.magics_manager.registry.get("HvdMagics")
    if magics is not None and magics.auto is not None:
        magics.auto.uninstall()
    Session.get().stop()
