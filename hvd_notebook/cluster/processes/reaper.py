"""A watchdog that outlives a killed notebook kernel and stops its cluster.

``atexit`` does not run when a kernel is killed with SIGKILL (or by Jupyter
after its shutdown grace). Each cluster therefore starts this small process in
its own session: it polls the kernel once a second and, when the kernel is
gone, kills every process listed in the cluster's PID file and removes the
cluster's directory. When the cluster is stopped normally its directory
disappears and the reaper exits.

Run as ``python -m hvd_notebook.cluster.processes.reaper KERNEL_PID CLUSTER_DIR``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

from ..node import registry, shm
from .pids import alive, kill_all, live_processes
from .workdir import WorkDir

POLL_S = 1.0


def start_reaper(workdir: WorkDir) -> subprocess.Popen:
    """Start the watchdog of the cluster in ``workdir``, owned by this process (the kernel).

    Args:
        workdir: the cluster's directory.
    """
    return subprocess.Popen(
        [sys.executable, "-m", "hvd_notebook.cluster.processes.reaper", str(os.getpid()), str(workdir.path)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def reap(workdir: WorkDir) -> int:
    """Kill the cluster's processes, with their descendants (started since the PID file was last written),
    and remove its directory; return how many were killed.

    Args:
        workdir: the cluster's directory.
    """
    procs = {p.pid: p for p in live_processes(workdir.read_pids())}
    for listed in list(procs.values()):
        try:
            procs.update((child.pid, child) for child in listed.children(recursive=True))
        except psutil.Error:
            pass
    kill_all(procs.values(), grace=0.0, wait=5.0)
    workdir.remove()
    shm.remove_orphaned()  # the killed ranks' MPICH segments in /dev/shm
    return len(procs)


def suspend_kept(workdir: WorkDir, timeout: float = 600.0) -> None:
    """Where the dead kernel's cluster asked to be kept (``%hvd start --keep``), suspend it before it is reaped:
    ``launching.suspension``'s own process saves every rank's state (run, not imported: this layer is below it).

    Args:
        workdir: the cluster's directory.
        timeout: seconds the ranks get to save.
    """
    if workdir.kept:
        try:
            subprocess.run([sys.executable, "-m", "hvd_notebook.cluster.launching.suspension", str(workdir.path)],
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           timeout=timeout)
        except subprocess.TimeoutExpired:  # (the ranks are reaped anyway: nothing may outlive its kernel for long)
            pass


def watch(kernel_pid: int, workdir: WorkDir) -> None:
    """Reap the cluster once the kernel is gone; return when either is.

    Args:
        kernel_pid: the kernel's PID.
        workdir: the cluster's directory.
    """
    try:
        kernel = psutil.Process(kernel_pid)
    except psutil.NoSuchProcess:
        reap(workdir)
        registry.remove(kernel_pid)
        return
    while workdir.path.exists():
        if not alive(kernel):
            suspend_kept(workdir)
            reap(workdir)
            registry.remove(kernel_pid)  # (the kernel's card in the node's register)
            return
        time.sleep(POLL_S)


def main(argv: list[str]) -> int:
    """``python -m hvd_notebook.cluster.processes.reaper KERNEL_PID CLUSTER_DIR``.

    Args:
        argv: ``KERNEL_PID CLUSTER_DIR``.
    """
    if len(argv) != 3:
        print("usage: python -m hvd_notebook.cluster.processes.reaper KERNEL_PID CLUSTER_DIR", file=sys.stderr)
        return 2
    watch(int(argv[1]), WorkDir(Path(argv[2])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
