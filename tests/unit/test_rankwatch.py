"""The rank watcher's choice and claim (``hvd_notebook.rankwatch``): only the watcher of a job that found its
rank ended first reports it, and no other user can take the claim first to silence the reports."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from hvd_notebook import rankwatch

RANKWATCH = rankwatch.__name__  # (run as python -m, as hvd.init() starts it)


def test_the_first_claim_of_a_job_wins_until_released(tmp_path):
    held = rankwatch.claim("host-1", tmp_path)
    assert held is not None and held.parent == tmp_path
    assert rankwatch.claim("host-1", tmp_path) is None  # the job's other watchers stay silent
    assert rankwatch.claim("host-2", tmp_path) is not None  # another job is another claim
    rankwatch.release(held)
    assert rankwatch.claim("host-1", tmp_path) is not None


def test_a_claim_left_by_a_killed_watcher_goes_stale(tmp_path):
    held = rankwatch.claim("host-1", tmp_path)
    old = time.time() - rankwatch.CLAIM_STALE_S - 1
    os.utime(held, (old, old))
    assert rankwatch.claim("host-1", tmp_path) == held


def test_the_watcher_that_woke_first_reports_though_it_noted_last(tmp_path):
    """A loaded host may run the watcher of the rank mpiexec ended (rank 0) before the one whose rank
    ended first (rank 1): the time each woke decides, not the order of their notes."""
    rankwatch.note_woken(tmp_path, "host-1", 0, 2_000)
    rankwatch.note_woken(tmp_path, "host-2", 1, 500)  # another job's note
    assert rankwatch.first_woken(tmp_path, "host-1") == 0
    rankwatch.note_woken(tmp_path, "host-1", 1, 1_000)
    assert rankwatch.first_woken(tmp_path, "host-1") == 1
    rankwatch.note_woken(tmp_path, "host-1", 3, 1_000)  # the same instant: the lower rank
    assert rankwatch.first_woken(tmp_path, "host-1") == 1
    assert rankwatch.first_woken(tmp_path, "host-3") is None


def test_a_note_left_by_a_killed_watcher_is_not_counted(tmp_path):
    stale = rankwatch.note_woken(tmp_path, "host-1", 0, 1)
    old = time.time() - rankwatch.CLAIM_STALE_S - 1
    os.utime(stale, (old, old))
    rankwatch.note_woken(tmp_path, "host-1", 1, 1_000)
    (tmp_path / "woke-host-1-x").write_text("not a note")
    assert rankwatch.first_woken(tmp_path, "host-1") == 1 and not stale.exists()


def test_a_watcher_whose_rank_ended_later_stays_silent(tmp_path, monkeypatch):
    """The watcher process itself: a note of an earlier-woken watcher of the job silences it."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    job = f"{socket.gethostname()}-{os.getpid()}-later"
    where = tmp_path / "hvd_notebook" / "rankwatch"
    where.mkdir(parents=True, mode=0o700)
    tmp_path.chmod(0o700)
    (tmp_path / "hvd_notebook").chmod(0o700)
    earlier = rankwatch.note_woken(where, job, 1, time.monotonic_ns())
    watcher = subprocess.Popen([sys.executable, "-m", RANKWATCH, job, "0", "2", "999999"],
                               stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watcher.stdin.close()
    said = watcher.stderr.read()
    assert watcher.wait(timeout=rankwatch.SETTLE_S + 30) == 0
    assert "ended without a word" not in said, said
    assert earlier.exists() and not list(where.glob(f"*{job}-0"))  # its own note removed, the other's kept


def test_the_claim_lives_in_the_private_folder(monkeypatch, tmp_path):
    base = tmp_path / "base"
    base.mkdir(mode=0o700)
    monkeypatch.setattr(rankwatch.private, "base_dir", lambda: base)
    held = rankwatch.claim("host-1")
    assert held.parent == base / "rankwatch" and (base / "rankwatch").stat().st_mode & 0o777 == 0o700


OTHER_UID = 65534  # nobody: "someone else", a real second uid


def as_other_user(act) -> None:
    """``act()`` in a forked child process that has become ``OTHER_UID`` (real and effective)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            act()
            code = 0
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0, f"acting as uid {OTHER_UID} failed"


def plant(path: Path) -> None:
    """Make ``path``'s folders open to everyone, and ``path`` an empty file in them."""
    os.umask(0)
    path.parent.mkdir(0o777, parents=True)
    path.touch()


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user (uid 65534) needs root")
def test_a_claim_planted_by_someone_else_does_not_silence_the_report(tmp_path):
    """Another user makes this user's base folder in a shared /tmp first (``hvd_notebook-USER``, open to all)
    and plants the job's claim in its ``rankwatch`` folder: the watcher must not use that folder (it is not
    the user's own), so it reports from its fallback folder instead of finding the claim taken."""
    shared_tmp = Path(tempfile.mkdtemp(prefix="hvd-rankwatch-"))  # (a /tmp of its own: world-writable, sticky)
    try:
        shared_tmp.chmod(0o1777)
        job = f"{socket.gethostname()}-{os.getpid()}-planted"
        planted = shared_tmp / f"hvd_notebook-{rankwatch.private.user_name()}" / "rankwatch" / f"ended-{job}"
        as_other_user(lambda: plant(planted))
        assert planted.stat().st_uid == OTHER_UID
        home = tmp_path / "home"
        home.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR"}
        watcher = subprocess.Popen([sys.executable, "-m", RANKWATCH, job, "1", "2", "999999"], cwd=tmp_path,
                                   env={**env, "TMPDIR": str(shared_tmp), "HOME": str(home)},
                                   stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        watcher.stdin.close()  # the rank's end of the pipe closes without a goodbye
        said = watcher.stderr.read()
        assert watcher.wait(timeout=rankwatch.SETTLE_S + rankwatch.CLAIM_HOLD_S + 30) == 0
        assert "[hvd_notebook] rank 1 of 2 (pid 999999" in said and "ended without a word" in said, said
        assert planted.exists()  # left as it was: the watcher used its own folder
    finally:
        shutil.rmtree(shared_tmp)
