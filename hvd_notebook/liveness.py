"""The one check of whether a process is alive, for every layer.

A process that has ended but whose parent has not collected it yet (a zombie) still has its PID, so
``os.kill(pid, 0)``, ``psutil.pid_exists`` and ``Process.is_running`` call it alive: every question of
liveness in the package goes through ``alive`` instead (a layer test finds the others). It sits below the
layers because the node's register and shared memory, the cluster's processes, the engines' rendezvous files
and the panel all ask it. ``cluster/processes/pids.py`` adds what a recorded process is (PID and start time).
"""

from __future__ import annotations

import psutil


def alive(proc: psutil.Process) -> bool:
    """Is ``proc`` still the process it was, and running: not ended, nor a zombie?

    Args:
        proc: a process, as psutil opened it (it remembers the start time, so a reused PID is not it).
    """
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def pid_alive(pid: int) -> bool:
    """Is ``pid`` a live process here (``alive``)?

    Args:
        pid: any PID; one that was never used, or is not a number the kernel takes, is not alive.
    """
    try:
        return alive(psutil.Process(pid))
    except (psutil.Error, ValueError):
        return False
