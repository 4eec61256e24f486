"""Where a cluster's ranks run: one placement class per module, registered by name (``base.register``).

Every module of this package is imported here, so that a placement added as a new module registers itself
with nothing else changed; a placement shipped by another package registers through the
``hvd_notebook.placements`` entry-point group (its value: the module to import).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import pkgutil

from .base import (
    AUTO,
    GFORKER,
    STANDBY_BYTES_PER_RANK,
    Placement,
    choose_placement,
    find_mpiexec,
    is_open_mpi,
    is_report_line,
    launcher_names,
    register,
    registered,
    unregister,
)

__all__ = ["AUTO", "GFORKER", "STANDBY_BYTES_PER_RANK", "Placement", "choose_placement", "find_mpiexec",
           "is_open_mpi", "is_report_line", "launcher_names", "register", "registered", "unregister"]

log = logging.getLogger(__name__)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")
for _entry in importlib.metadata.entry_points(group="hvd_notebook.placements"):
    try:
        _entry.load()
    except Exception:  # (another package's placement must not keep the notebook from starting clusters)
        log.warning("the placement %s (%s) did not load", _entry.name, _entry.value, exc_info=True)
