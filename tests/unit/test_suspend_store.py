"""A suspended cluster on disk (``cluster.launching.suspension``): its manifest, its folder made whole or not at
all, the lock that lets only one kernel take it back, expiry, and ``hvd-notebook list``, ``delete`` and ``clean``
on it; in a private folder of the test's own (``XDG_RUNTIME_DIR``), real files and real processes."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import CLI

from hvd_notebook.cluster.finding import delete_suspended
from hvd_notebook.cluster.launching import suspension
from hvd_notebook.cluster.launching.suspension import Claim, Making, Manifest, SavedCell, SuspendError
from hvd_notebook.config import ClusterOptions


@pytest.fixture
def base(tmp_path, monkeypatch):
    """The user's private folder, the test's own: what the store, the CLI and a second process all find."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return runtime / "hvd_notebook"


def _manifest(ident: str, when: float | None = None, unsaved: dict | None = None) -> Manifest:
    options = ClusterOptions(n=None, env=(("A", "1"),), mpi_args=("-bind-to", "core"), gpus="0,1")
    saves = [{"rank": r, "bytes": 10, "seconds": 0.1, "saved": ["x"], "unsaved": (unsaved or {}).get(r, {})}
             for r in (0, 1)]
    return Manifest(id=ident, user="me", kernel=os.getpid(), ranks=2, gpus=["0", "1"],
                    options=suspension.options_record(options),
                    cells=[SavedCell("f = open('log')", None, None, ["f"])], saves=saves,
                    suspended=time.time() if when is None else when, seconds=0.5, bytes=20)


def _suspend(ident: str, **kwargs) -> suspension.Suspended:
    making = Making(suspension.suspended_root(), ident, [0, 1])
    for folder in making.rank_dirs.values():
        (folder / "state.pkl").write_bytes(b"x" * 1000)
    return making.finish(_manifest(ident, **kwargs))


def test_a_manifest_gives_back_the_start_options_and_what_was_not_saved(base):
    manifest = _manifest("hvd-1-2", unsaved={0: {"f": "an open file", "it": "a generator"}, 1: {"f": "an open file"}})
    back = Manifest.from_json(manifest.to_json(), Path("m.json"))
    assert back == manifest
    options = back.start_options()
    assert options == replace(ClusterOptions(env=(("A", "1"),), mpi_args=("-bind-to", "core"), gpus="0,1"), n=2)
    assert back.unsaved() == {"f": {0: "an open file", 1: "an open file"}, "it": {0: "a generator"}}
    with pytest.raises(SuspendError, match="is not a suspended cluster's manifest .*hvd-notebook delete"):
        Manifest.from_json('{"id": "x"}', Path("/s/hvd-1-2/manifest.json"))


def test_a_suspend_is_listed_only_once_whole_and_its_files_are_the_users_alone(base):
    making = Making(suspension.suspended_root(), "hvd-1-2", [0, 1])
    assert suspension.find_suspended() == []  # (under way: not listed)
    assert sorted(p.name for p in making.rank_dirs.values()) == ["rank-0", "rank-1"]
    suspended = making.finish(_manifest("hvd-1-2"))
    assert [s.id for s in suspension.find_suspended()] == ["hvd-1-2"]
    assert suspension.find_one("hvd-1-2").manifest().ranks == 2
    for path in (suspended.path, suspended.path / "rank-0", base / "suspended"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    assert stat.S_IMODE((suspended.path / "manifest.json").stat().st_mode) == 0o600
    with pytest.raises(SuspendError, match="No suspended cluster is named 'hvd-9'. Yours: hvd-1-2."):
        suspension.find_one("hvd-9")
    with pytest.raises(SuspendError, match="exists already"):
        Making(suspension.suspended_root(), "hvd-1-2", [0])


def test_a_suspend_that_failed_leaves_nothing_and_a_killed_kernels_leftovers_are_cleaned(base):
    making = Making(suspension.suspended_root(), "hvd-1-2", [0, 1])
    making.abandon()
    assert os.listdir(base / "suspended") == []
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = base / "suspended" / f".hvd-3-4.making-{dead.stdout.strip()}"
    left.mkdir(mode=0o700)
    mine = base / "suspended" / f".hvd-5-6.making-{os.getpid()}"  # (a live kernel's suspend under way: kept)
    mine.mkdir(mode=0o700)
    assert suspension.remove_leftovers() == [left]
    assert not left.exists() and mine.exists()


def test_only_one_kernel_takes_a_suspended_cluster_back(base):
    suspended = _suspend("hvd-1-2")
    # another process (another notebook's kernel) holds it while it resumes
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path\n"
        "from hvd_notebook.cluster.launching.suspension import Claim, Suspended\n"
        f"claim = Claim(Suspended(Path({str(suspended.path)!r})))\n"
        "print('held', flush=True); sys.stdin.readline(); claim.done(); print('done', flush=True)")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=os.environ)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(SuspendError, match="is being taken back by another notebook right now"):
            Claim(suspended)
        with pytest.raises(SuspendError, match="being taken back"):
            delete_suspended("hvd-1-2")
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "done"
    finally:
        holder.kill()
        holder.wait()
    assert suspension.find_suspended() == []
    with pytest.raises(SuspendError, match="is no longer suspended"):
        Claim(suspended)


def test_two_claims_of_one_kernel_conflict_too_and_a_released_one_can_be_taken_again(base):
    suspended = _suspend("hvd-1-2")
    first = Claim(suspended)
    with pytest.raises(SuspendError, match="being taken back"):
        Claim(suspended)
    first.release()  # (a resume that failed: it stays suspended)
    Claim(suspended).done()
    assert suspension.find_suspended() == []


def test_suspended_clusters_expire_by_the_nodes_rule_but_not_one_being_resumed(base):
    old, new, held = _suspend("hvd-1-1", when=1000.0), _suspend("hvd-2-2"), _suspend("hvd-3-3", when=1000.0)
    claim = Claim(held)
    assert suspension.remove_expired(None) == []
    assert suspension.remove_expired(3600) == ["hvd-1-1"]
    assert not old.path.exists() and new.path.exists() and held.path.exists()
    claim.release()


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(CLI + list(args), capture_output=True, text=True, timeout=60, env=os.environ)


def test_list_shows_suspended_clusters_delete_removes_one_and_clean_leaves_them(base):
    _suspend("hvd-1-2")
    listed = _cli("list")
    assert listed.returncode == 0, listed.stderr
    assert "hvd-1-2: suspended since " in listed.stdout and "2 rank(s), 2.9 KiB on disk" in listed.stdout
    assert "%hvd resume hvd-1-2 takes it back" in listed.stdout, listed.stdout
    cleaned = _cli("clean")
    assert cleaned.returncode == 0 and "left alone: hvd-1-2: suspended" in cleaned.stdout, cleaned.stdout
    gone = _cli("delete", "hvd-9")
    assert gone.returncode == 2 and "No suspended cluster is named 'hvd-9'. Yours: hvd-1-2." in gone.stderr
    deleted = _cli("delete", "hvd-1-2")
    assert deleted.returncode == 0 and "Deleted the suspended cluster hvd-1-2" in deleted.stdout, deleted.stderr
    assert suspension.find_suspended() == [] and "hvd-1-2" not in _cli("list").stdout


def test_clean_removes_what_is_past_the_nodes_suspended_ttl(base, monkeypatch):
    _suspend("hvd-1-2", when=time.time() - 7200)
    _suspend("hvd-3-4")
    monkeypatch.setenv("HVD_NOTEBOOK_SUSPENDED_TTL", "1h")
    cleaned = _cli("clean")
    assert "removed the suspended cluster hvd-1-2: suspended longer than the node's suspended_ttl" in cleaned.stdout
    assert "left alone: hvd-3-4: suspended" in cleaned.stdout, cleaned.stdout
    assert [s.id for s in suspension.find_suspended()] == ["hvd-3-4"]
    assert json.loads((base / "suspended" / "hvd-3-4" / "manifest.json").read_text())["ranks"] == 2
