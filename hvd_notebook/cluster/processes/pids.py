"""The PID registry: every process of a cluster, and how they are killed.

A PID alone is not a process: once it has exited, the operating system may
give its PID to an unrelated process. Every process is therefore remembered
with its creation time, and only a process whose PID and creation time both
match, and whose real user is this process's, is ever signalled: a start time is
readable by anyone, so a record someone else wrote could otherwise name any
process of the node.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterable

import psutil

from ...liveness import alive as alive  # (the one liveness check; pids.alive for the callers of pids)
from ...liveness import pid_alive as pid_alive
from .workdir import Record, WorkDir


def same_process(record: Record) -> psutil.Process | None:
    """The process ``record`` names, if it still exists, is that process, and runs as this user.

    Args:
        record: the recorded process.
    """
    pid, created = record
    try:
        proc = psutil.Process(pid)
        return proc if abs(proc.create_time() - created) < 0.01 and proc.uids().real == os.getuid() else None
    except psutil.Error:
        return None


def is_alive(record: Record) -> bool:
    """Is the recorded process still there (``same_process``) and ``alive``?

    Args:
        record: the recorded process.
    """
    proc = same_process(record)
    return proc is not None and alive(proc)


def live_processes(records: Iterable[Record]) -> list[psutil.Process]:
    """Those of ``records`` that are still the processes recorded.

    Args:
        records: the recorded processes.
    """
    return [p for p in map(same_process, records) if p is not None]


def interrupt_this_process() -> None:
    """SIGINT to this process: the cell it runs ends as with the notebook's stop button."""
    os.kill(os.getpid(), signal.SIGINT)


def ask_to_end(record: Record) -> psutil.Process | None:
    """SIGTERM to the recorded process where it still is that process of this user (a launcher such as
    ``hvd-notebook run`` then ends its ranks and itself); the process, or None where it had ended.

    Args:
        record: the recorded process.
    """
    process = same_process(record)
    if process is not None:
        try:
            process.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            return None
    return process


def kill_all(processes: Iterable[psutil.Process | int], grace: float, wait: float | None = None) -> None:
    """SIGTERM every process, SIGKILL those still there after ``grace`` seconds,
    then wait up to ``wait`` seconds (default ``grace``) for them to be gone.

    Args:
        processes: the processes, or their PIDs.
        grace: seconds between SIGTERM and SIGKILL.
        wait: seconds to wait after; None for ``grace``.
    """
    procs = []
    for p in processes:
        try:
            procs.append(p if isinstance(p, psutil.Process) else psutil.Process(p))
        except psutil.NoSuchProcess:
            pass
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace if wait is None else wait)


class PidRegistry:
    """The processes of one cluster, written to its PID file for the reaper."""

    def __init__(self) -> None:
        self._pids: set[int] = set()
        self.workdir: WorkDir | None = None
        self._lock = threading.Lock()  # a standby is launched in a thread while the kernel may ask

    def add(self, *pids: int) -> None:
        """Remember these processes, and their descendants.

        Args:
            *pids: the processes' PIDs.
        """
        with self._lock:
            self._pids.update(pids)
        self.remember_descendants()

    def remember_descendants(self) -> set[int]:
        """Add the children of every known process, tell the reaper, and return them all."""
        with self._lock:
            for pid in list(self._pids):
                try:
                    self._pids.update(c.pid for c in psutil.Process(pid).children(recursive=True))
                except psutil.NoSuchProcess:
                    pass
            if self.workdir is not None:
                records = []
                for pid in sorted(self._pids):
                    try:
                        records.append((pid, psutil.Process(pid).create_time()))
                    except psutil.NoSuchProcess:
                        pass
                self.workdir.write_pids(records)
            return set(self._pids)

    def clear(self) -> None:
        """Forget everything (the cluster has stopped)."""
        with self._lock:
            self._pids.clear()
            self.workdir = None
