"""The cluster layer: every process hvd_notebook starts or kills.

``cluster.MPICluster`` runs an ipyparallel controller plus one MPI world of
engines (``world.World``: one launched world, which a restart replaces or swaps for
its warm standby's, ``standby``). Its parts: ``placement`` (one host, a hosts list, a Slurm allocation),
``hosts`` (host lists, hostfiles, routes), ``launch`` (ipyparallel's launchers
and the ranks' environment), ``diagnosis`` (what a launcher's output says),
``workdir`` (the cluster directory's format), ``pids`` (the PID registry and
killing), ``gpus`` (what the driver reports), ``leases`` (GPU leases shared by
every user of the node), ``policy`` (the node's fair-sharing rules),
``registry`` (the node's world-readable register of clusters), ``shm`` (the
shared-memory segments killed ranks leave), ``reaper`` (a watchdog that stops a cluster whose
kernel died) and ``rankwatch`` (a watcher that names a rank of a plain
``mpiexec`` run that ends without a word).
"""

from __future__ import annotations

import importlib
from typing import Any

from ..config import ClusterOptions

# imported on first use, so that a rank can start its watcher (``rankwatch``) without the rest
_LAZY = {"MPICluster": "cluster", "RankInfo": "cluster", "ClusterError": "errors",
         "rank_environment": "launch", "find_mpiexec": "placement"}

__all__ = ["ClusterError", "ClusterOptions", "MPICluster", "RankInfo", "find_mpiexec", "rank_environment"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
