"""cluster.shm: the MPICH segments that killed ranks leave in /dev/shm are removed once nothing maps them,
and only then; real files in /dev/shm, a real process mapping one."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from hvd_notebook.cluster import shm

MAPPER = """
import mmap, sys
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), 4096)
print("mapped", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def segments():
    """Three segments of this user: old and unmapped, old and mapped by a live process, new."""
    tag = uuid.uuid4().hex[:8]
    paths = [shm.SHM_DIR / f"{shm.PREFIX}test{tag}_{i}" for i in range(3)]
    for path in paths:
        path.write_bytes(b"\0" * 4096)
    old = time.time() - 2 * shm.MIN_AGE_S
    for path in paths[:2]:
        os.utime(path, (old, old))
    mapper = subprocess.Popen([sys.executable, "-c", MAPPER, str(paths[1])], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert mapper.stdout.readline().strip() == "mapped"
    yield paths
    mapper.kill()
    mapper.wait()
    for path in paths:
        path.unlink(missing_ok=True)


def test_only_old_unmapped_segments_are_removed(segments):
    unmapped, mapped, new = segments
    removed = shm.remove_orphaned()
    assert unmapped in removed and not unmapped.exists()
    assert mapped.exists() and new.exists()  # a live rank's, and a world that may be starting now
    assert mapped not in removed and new not in removed


def test_another_users_segments_are_left_alone(segments):
    unmapped = segments[0]
    assert shm.remove_orphaned(uid=os.getuid() + 12345) == []
    assert unmapped.exists()
