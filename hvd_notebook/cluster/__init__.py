"""The cluster layer: every process hvd_notebook starts or kills.

``cluster.MPICluster`` runs an ipyparallel controller plus one MPI world of
engines (``world.LaunchedWorld``: one launched world, which a restart replaces or swaps for
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

from ..config import ClusterOptions
from .errors import ClusterError

# Nothing else is imported here: a rank starts its watcher (``rankwatch``) without the rest of the layer.
# ``MPICluster`` is in ``cluster``, ``RankInfo`` in ``world``, ``find_mpiexec`` in ``placement``,
# ``rank_environment`` in ``launch``.
__all__ = ["ClusterError", "ClusterOptions"]
