"""What the kernel's suspend and resume call on each rank (through the rank channel): ``engine.suspension``'s
save, restore and reconcile, on the rank's own ``%%hvd`` namespace (the engine shell's)."""

from __future__ import annotations

from typing import Any


def _namespace() -> dict[str, Any]:
    from IPython import get_ipython

    return get_ipython().user_ns


def save(folder: str) -> dict[str, Any]:
    """This rank's state saved into ``folder`` (``suspension.save``); its report.

    Args:
        folder: this rank's private folder of the suspended cluster.
    """
    from . import suspension

    return suspension.save(_namespace(), folder)


def restore(folder: str) -> dict[str, Any]:
    """This rank's state loaded from ``folder`` (``suspension.restore``); its report.

    Args:
        folder: the folder this rank's predecessor saved into.
    """
    from . import suspension

    return suspension.restore(_namespace(), folder)


def reconcile() -> dict[str, Any]:
    """After the replay: the restored state loaded into what it rebuilt (``suspension.reconcile``); its report."""
    from . import suspension

    return suspension.reconcile(_namespace())
