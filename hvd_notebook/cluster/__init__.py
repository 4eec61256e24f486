"""The cluster layer: every process hvd_notebook starts or kills.

An ipyparallel controller plus one MPI world of engines (``cluster``), where
its ranks go (``hosts``, Slurm), GPU leases shared by every user of the node
(``leases``), and a watchdog that stops a cluster whose kernel died
(``reaper``).
"""

from ..config import ClusterOptions
from .cluster import ClusterError, MPICluster, RankInfo, find_mpiexec, rank_environment

__all__ = ["ClusterError", "ClusterOptions", "MPICluster", "RankInfo", "find_mpiexec", "rank_environment"]
