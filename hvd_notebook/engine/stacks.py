"""Each rank's Python stack on request, even inside an MPI call: the rank's side.

A rank calls ``register(rank, size)`` once: Python's ``faulthandler`` then writes every thread's
stack to the rank's file when the rank gets ``SIGNAL``. The handler runs in C, so a rank blocked in
MPI or in a C extension that never returns to Python answers too. The asking side
(``cluster.stacks``: ``hvd-notebook stacks``, ``%hvd stacks``) empties the file, signals the rank and
reads what it wrote. Files live in ``stacks/`` of the user's private folder (``private.base_dir()``,
owner only, checked): ``PID.txt`` the stacks, ``PID.who`` "rank R of N" and the process's start time;
a rank removes both at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import signal
from pathlib import Path

import psutil

from .. import private

SIGNAL = signal.SIGUSR2
_registered: list[object] = []  # the open file faulthandler writes to (it must stay open)


def stacks_dir() -> Path:
    """This user's folder of stack files (made owner-only where it does not exist, checked)."""
    return private.subdir("stacks")


def register(rank: int, size: int) -> None:
    """Make this process write its stacks to its file on ``SIGNAL`` (once per process).

    Args:
        rank: this process's rank, written in its stack file's name.
        size: the world's size, written in the file.
    """
    if _registered:
        return
    folder, pid = stacks_dir(), os.getpid()
    # its start time too: a PID reused by another process after a kill is never signalled
    private.write_text(folder / f"{pid}.who", f"rank {rank} of {size}\n{psutil.Process().create_time()}")
    # appending: the asking side empties it between dumps
    out = os.fdopen(os.open(folder / f"{pid}.txt", os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600), "a")
    faulthandler.register(SIGNAL, file=out, all_threads=True, chain=False)
    _registered.append(out)
    atexit.register(_unregister, folder, pid)


def _unregister(folder: Path, pid: int) -> None:
    faulthandler.unregister(SIGNAL)
    remove_files(folder, pid)


def remove_files(folder: Path, pid: int) -> None:
    """A registered process's files (at its exit, or after it was killed).

    Args:
        folder: the user's folder of stack files (``stacks_dir``).
        pid: the process whose files go.
    """
    for suffix in (".txt", ".who"):
        with contextlib.suppress(OSError):
            (folder / f"{pid}{suffix}").unlink()
