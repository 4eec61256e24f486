"""A watchdog that outlives a killed notebook kernel and stops its cluster.

``atexit`` does not run when a kernel is killed with SIGKILL (or by Jupyter
after its shutdown grace). Each cluster therefore starts this small process in
its own session: it polls the kernel once a second and, when the kernel is
gone, kills every process listed in the cluster's PID file and removes the
cluster's directory. When the cluster is stopped normally its directory
disappears and the reaper exits.

Run as ``python -m hvd_notebook.cluster.reaper KERNEL_PID CLUSTER_DIR``.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

import psutil

PID_FILE = "pids"  # one "pid create_time" per line, written by MPICluster
POLL_S = 1.0


def read_pid_file(cluster_dir: Path) -> list[psutil.Process]:
    """The listed processes that still exist and are the same processes (a PID
    may have been reused: the creation time must match)."""
    procs = []
    try:
        lines = (cluster_dir / PID_FILE).read_text().split("\n")
    except OSError:
        return procs
    for line in lines:
        try:
            pid, created = line.split()
            proc = psutil.Process(int(pid))
            if abs(proc.create_time() - float(created)) < 0.01:
                procs.append(proc)
        except (ValueError, psutil.Error):
            continue
    return procs


def reap(cluster_dir: Path) -> int:
    """Kill the cluster's processes and remove its directory; return how many were killed."""
    procs = read_pid_file(cluster_dir)
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=5)
    shutil.rmtree(cluster_dir, ignore_errors=True)
    return len(procs)


def watch(kernel_pid: int, cluster_dir: Path) -> None:
    try:
        kernel = psutil.Process(kernel_pid)
    except psutil.NoSuchProcess:
        reap(cluster_dir)
        return
    while cluster_dir.exists():
        if not kernel.is_running() or kernel.status() == psutil.STATUS_ZOMBIE:
            reap(cluster_dir)
            return
        time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python -m hvd_notebook.cluster.reaper KERNEL_PID CLUSTER_DIR", file=sys.stderr)
        return 2
    watch(int(argv[1]), Path(argv[2]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
