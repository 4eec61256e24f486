"""The cluster layer: every process hvd_notebook starts or kills, in three sub-packages by concern.

``launching``: a cluster's worlds and how they start, run and end. ``cluster.MPICluster`` runs an ipyparallel
controller plus one launcher's world of engines (``world.LaunchedWorld``, which a restart replaces or swaps for
its warm standby's, ``standby``); ``channel.RankChannel`` carries every message to the ranks; ``placements``
(one module per launcher, registered by name) says where ranks run; ``hosts``, ``launch``, ``keycopy``,
``diagnosis``, ``status``, ``resets`` and ``run`` (``hvd-notebook run``) do the rest.

``node``: the node shared with other users, and its security: ``gpus`` (what the driver reports), ``leases``
(GPU leases between every user's notebooks) in the folder ``nodedir`` finds, ``policy`` (the node's fair-sharing
rules), ``registry`` (the world-readable register of clusters), ``privileges`` (root acting as a user), ``shm``
and ``shmguard`` (the ranks' shared memory, and the guard against names planted by another user).

``processes``: process hygiene: ``pids`` (the PID registry, recorded processes and killing), ``workdir`` (a
cluster directory's format), ``reaper`` (the watchdog that stops a cluster whose kernel died) and ``stacks``
(every rank's stack on demand). ``finding``, above ``node`` and ``processes``: this user's clusters found, and
the orphaned ones stopped (``hvd-notebook list`` and ``clean``, the panel).
"""

from __future__ import annotations

from ..config import ClusterOptions
from .errors import ClusterError

# Nothing else is imported here (a reaper or a panel loads only what it uses). ``MPICluster`` is in
# ``launching.cluster``, ``RankInfo`` in ``launching.world``, ``find_mpiexec`` in ``launching.placements``,
# ``rank_environment`` in ``launching.launch``.
__all__ = ["ClusterError", "ClusterOptions"]
