"""The asking side of ``hvd-notebook stacks`` (``cluster/stacks.py``) with a real registered process."""

from __future__ import annotations

import subprocess
import sys
import time

from hvd_notebook.cluster.processes import stacks
from hvd_notebook.engine.stacks import remove_files, stacks_dir

REGISTERED = ("from hvd_notebook.engine import stacks; stacks.register(0, 1); print('ready', flush=True); "
              "import time; time.sleep(60)")


def registered_process() -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", REGISTERED], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return proc


def test_a_process_that_answers_gives_its_stacks():
    proc = registered_process()
    try:
        assert proc.pid in stacks.registered_pids()
        (who, dump), = stacks.collect([proc.pid]).values()
        assert who == "rank 0 of 1" and "<string>" in dump, dump  # (the process's code, run with -c)
    finally:
        proc.kill()
        proc.wait()


def test_a_process_that_ends_after_it_was_asked_is_left_out_not_a_crash(monkeypatch):
    """(Another cluster's rank ending while ``hvd-notebook stacks --all-threads`` waits for the answers: its
    files are removed at its exit.)"""
    proc = registered_process()
    try:
        def ends_when_asked(pid: int, sig: int) -> None:
            remove_files(stacks_dir(), pid)  # as its atexit does

        with monkeypatch.context() as patched:  # (os.kill itself: undone before the process is killed)
            patched.setattr(stacks.os, "kill", ends_when_asked)
            t0 = time.monotonic()
            assert stacks.collect([proc.pid]) == {}
            assert time.monotonic() - t0 < 1.0  # (not waited for until the timeout)
    finally:
        proc.kill()
        proc.wait()
