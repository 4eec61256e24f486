"""Each rank's Python stack on request, even inside an MPI call: the rank's side.

A rank calls ``register(rank, size)`` once: Python's ``faulthandler`` then writes every thread's
stack to the rank's file when the rank gets ``SIGNAL``. The handler runs in C, so a rank blocked in
MPI or in a C extension that never returns to Python answers too. The asking side
(``cluster.stacks``: ``hvd-notebook stacks``, ``%hvd stacks``) empties the file, signals the rank and
reads what it wrote. Files live in ``$TMPDIR/hvd_notebook-$USER/stacks/`` (owner only): ``PID.txt``
the stacks, ``PID.who`` "rank R of N" and the process's start time; a rank removes both at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import getpass
import os
import signal
import tempfile
from pathlib import Path

import psutil

SIGNAL = signal.SIGUSR2
_registered: list[object] = []  # the open file faulthandler writes to (it must stay open)


def stacks_dir() -> Path:
    """This user's folder of stack files (made owner-only where it does not exist)."""
    path = Path(tempfile.gettempdir()) / f"hvd_notebook-{getpass.getuser()}" / "stacks"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def register(rank: int, size: int) -> None:
    """Make this process write its stacks to its file on ``SIGNAL`` (once per process)."""
    if _registered:
        return
    folder, pid = stacks_dir(), os.getpid()
    # its start time too: a PID reused by another process after a kill is never signalled
    (folder / f"{pid}.who").write_text(f"rank {rank} of {size}\n{psutil.Process().create_time()}")
    out = open(folder / f"{pid}.txt", "a")  # appending: the asking side empties it between dumps
    faulthandler.register(SIGNAL, file=out, all_threads=True, chain=False)
    _registered.append(out)
    atexit.register(_unregister, folder, pid)


def _unregister(folder: Path, pid: int) -> None:
    faulthandler.unregister(SIGNAL)
    remove_files(folder, pid)


def remove_files(folder: Path, pid: int) -> None:
    """A registered process's files (at its exit, or after it was killed)."""
    for suffix in (".txt", ".who"):
        with contextlib.suppress(OSError):
            (folder / f"{pid}{suffix}").unlink()
