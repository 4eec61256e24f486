"""The rows of ``%hvd status``: each rank's process, its memory and what it runs, as the OS, the driver and
the controller's queues tell."""

from __future__ import annotations

import psutil

from ...messages import RankActivity, RankStatus
from ..node.gpus import gpu_memory_by_pid
from .cluster import MPICluster


def rank_status(cluster: MPICluster, busy: dict[int, bool] | None) -> list[RankStatus]:
    """One row per rank of ``cluster``.

    Args:
        cluster: a running cluster.
        busy: per rank, whether the controller's queue for it holds work (``RankChannel.settled_busy``); None
            where the controller did not answer (what each rank runs is then unknown).

    Returns:
        The rows, in rank order. A rank's memory is read only on this host; GPU memory only where the cluster
        has GPUs.
    """
    alive = cluster.alive()
    gpu_memory = gpu_memory_by_pid() if cluster.gpus else {}
    rows = []
    for r in cluster.ranks:
        rss = None
        if alive[r.rank] and r.here:
            try:
                rss = psutil.Process(r.pid).memory_info().rss
            except psutil.NoSuchProcess:
                alive[r.rank] = False
        running = (RankActivity.DEAD if not alive[r.rank] else RankActivity.UNKNOWN if busy is None
                   else RankActivity.BUSY if busy.get(r.rank) else RankActivity.IDLE)
        rows.append(RankStatus(rank=r.rank, alive=alive[r.rank], host=r.host, pid=r.pid, device=r.device, rss=rss,
                               gpu_memory=gpu_memory.get(r.pid) if r.here else None,  # another host's pid: not ours
                               running=running))
    return rows
