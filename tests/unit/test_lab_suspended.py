"""The panel's suspended clusters (``lab.readings``' ``suspended`` list, ``lab.actions``' delete) on real folders
made as a suspend makes them (``suspension.Making``), in a private folder of the test's own: listed with their size,
at most ``MAX_SUSPENDED_SHOWN``, an unreadable one with why; deleted only where it is one of the user's, 409 while
a notebook takes it back; the panel's reading makes no folder."""

from __future__ import annotations

import os
import time

import pytest

from hvd_notebook.cluster.finding import own_suspended
from hvd_notebook.cluster.launching import suspension
from hvd_notebook.config import ClusterOptions
from hvd_notebook.lab import readings
from hvd_notebook.lab.actions import ActionError, carry_out


@pytest.fixture
def base(tmp_path, monkeypatch):
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(tmp_path / "node"))
    return runtime / "hvd_notebook"


def _suspend(ident: str, rank_bytes: int = 1000) -> suspension.Suspended:
    making = suspension.Making(suspension.suspended_root(), ident, [0, 1])
    for folder in making.rank_dirs.values():
        (folder / "state.pkl").write_bytes(b"x" * rank_bytes)
    return making.finish(suspension.Manifest(
        id=ident, user="me", kernel=os.getpid(), ranks=2, gpus=["0"], options=suspension.options_record(
            ClusterOptions(n=2)), cells=[], saves=[], suspended=time.time() - 5, seconds=0.1, bytes=2 * rank_bytes,
        why="its kernel died"))


def test_the_reading_lists_each_suspended_cluster_with_its_size_and_makes_no_folder(base):
    base.mkdir(mode=0o700)
    assert readings._suspended([]) == [] and not (base / "suspended").exists()
    made = _suspend("hvd-1-2")
    (base / "suspended" / "hvd-1-3").mkdir(mode=0o700)  # (no manifest: unreadable, still listed to be deleted)
    listed = {s["id"]: s for s in readings._suspended([])}
    assert listed["hvd-1-2"] | {"since": 0} == {
        "id": "hvd-1-2", "bytes": suspension.tree_size(made.path), "ranks": 2, "gpus": ["0"], "since": 0,
        "why": "its kernel died", "kernel": os.getpid(), "error": None}
    assert listed["hvd-1-2"]["bytes"] > 2000 and time.time() - listed["hvd-1-2"]["since"] < 60
    assert listed["hvd-1-3"]["ranks"] is None and "no longer suspended" in listed["hvd-1-3"]["error"]


def test_the_reading_shows_at_most_its_cap(base):
    for i in range(readings.MAX_SUSPENDED_SHOWN + 3):
        _suspend(f"hvd-1-{i}", rank_bytes=1)
    assert len(own_suspended()) == readings.MAX_SUSPENDED_SHOWN + 3
    assert len(readings._suspended([])) == readings.MAX_SUSPENDED_SHOWN


def test_delete_removes_only_the_users_own_and_not_while_it_is_taken_back(base):
    made = _suspend("hvd-1-2")
    claim = suspension.Claim(made)
    with pytest.raises(ActionError, match="being taken back") as refused:
        carry_out("hvd-1-2", "delete")
    assert refused.value.status == 409 and made.path.is_dir()
    claim.release()
    assert carry_out("hvd-1-2", "delete").startswith("Deleted the suspended cluster hvd-1-2 (")
    assert not made.path.exists()
    for ident in ("hvd-1-2", "hvd-9-9", "../hvd-1-2", "x"):
        with pytest.raises(ActionError) as missing:
            carry_out(ident, "delete")
        assert missing.value.status == 404, ident
