"""MPICH's shared-memory segments that killed ranks leave behind.

The ranks of one host exchange messages through files MPICH creates in
``/dev/shm`` (``mpich_shm_*``, about 2 MiB each) and unlinks in ``MPI_Finalize``.
A cluster's ranks are killed, not finalised, so every stopped world would leave
its segments: on a shared node that is memory no one gets back (2.5 GiB after a
day of this project's tests). After a cluster or job stops, ``remove_orphaned``
removes this user's segments that no process maps any more and that are older
than a starting world could be, so a world that is starting now keeps its own.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil

SHM_DIR = Path("/dev/shm")
PREFIX = "mpich_shm_"
MIN_AGE_S = 60.0  # a segment this old was mapped long ago by the ranks that made it, if they live


def _mapped(paths: set[str]) -> set[str]:
    """Those of ``paths`` that some process (of this user; all, for root) maps now."""
    found: set[str] = set()
    for proc in psutil.process_iter():
        try:
            with open(f"/proc/{proc.pid}/maps", errors="replace") as maps:
                for line in maps:
                    if PREFIX in line:
                        path = line.split(None, 5)[-1].strip()
                        if path in paths:
                            found.add(path)
        except OSError:  # gone, or another user's
            continue
    return found


def remove_orphaned(shm_dir: Path = SHM_DIR, min_age: float = MIN_AGE_S, uid: int | None = None) -> list[Path]:
    """Remove this user's (or, for root, user ``uid``'s) ``mpich_shm_*`` segments in ``shm_dir`` that no
    process maps and that are older than ``min_age`` seconds; those removed."""
    now, uid = time.time(), os.getuid() if uid is None else uid
    candidates = {}
    for path in shm_dir.glob(f"{PREFIX}*"):
        try:
            st = path.stat()
        except OSError:
            continue
        if st.st_uid == uid and now - st.st_mtime >= min_age:
            candidates[str(path)] = path
    if not candidates:
        return []
    removed = []
    for name in set(candidates) - _mapped(set(candidates)):
        try:
            candidates[name].unlink()
            removed.append(candidates[name])
        except OSError:
            pass
    return sorted(removed)
