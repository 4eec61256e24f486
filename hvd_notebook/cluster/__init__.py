"""The cluster layer: every process hvd_notebook starts or kills.

``cluster.MPICluster`` runs an ipyparallel controller plus one MPI world of
engines. Its parts: ``placement`` (one host, a hosts list, a Slurm allocation),
``hosts`` (host lists, hostfiles, routes), ``launch`` (ipyparallel's launchers
and the ranks' environment), ``diagnosis`` (what a launcher's output says),
``workdir`` (the cluster directory's format), ``pids`` (the PID registry and
killing), ``gpus`` (what the driver reports), ``leases`` (GPU leases shared by
every user of the node) and ``reaper`` (a watchdog that stops a cluster whose
kernel died).
"""

from ..config import ClusterOptions
from .cluster import MPICluster, RankInfo
from .errors import ClusterError
from .launch import rank_environment
from .placement import find_mpiexec

__all__ = ["ClusterError", "ClusterOptions", "MPICluster", "RankInfo", "find_mpiexec", "rank_environment"]
