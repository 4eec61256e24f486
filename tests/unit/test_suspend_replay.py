"""What a resume replays (the recorded cells that bind a name no rank could save, read with ``ast``), what a
suspend and a resume say, and when the node's idle rule suspends rather than stops."""

from __future__ import annotations

import time

import pytest

from hvd_notebook.cluster.launching.suspension import Manifest, SavedCell, Timings
from hvd_notebook.cluster.node import registry
from hvd_notebook.cluster.node.policy import Policy
from hvd_notebook.kernel.recovery import UNKNOWN, RecordedCell, bound_names, to_replay
from hvd_notebook.kernel.suspending import describe_resume, describe_suspend
from hvd_notebook.kernel.tenancy import suspends


@pytest.mark.parametrize("code, names", [
    ("import numpy as np, os.path\nfrom keras import layers as L, Model", ["L", "Model", "np", "os"]),
    ("x = y = 1\na, (b, *c) = f()\nd: int = 2\ne += 1\nm[0] = 1\nobj.attr = 2", ["a", "b", "c", "d", "e", "x", "y"]),
    ("def fit(): inner = 1\nclass Net:\n    layer = 2\nasync def go(): pass", ["Net", "fit", "go"]),
    ("for i, (j, k) in z: pass\nwith open(p) as f, g() as (h, _): pass\nwhile (n := n - 1): pass",
     ["_", "f", "h", "i", "j", "k", "n"]),
    ("if ok:\n    it = iter(ds)\nelse:\n    del it\ntry:\n    pass\nexcept E as err:\n    log = open('l')",
     ["err", "it", "log"]),
    ("squares = [v * v for v in r]\nbig = [w for q in r if (w := q) > 1]", ["big", "squares", "w"]),
    ("%time model = build()\n!ls\nf = open('log')", ["f"]),  # (IPython's syntax read as IPython runs it)
    ("match p:\n    case [first, *rest]: pass\n    case {'k': v} as whole: pass", ["first", "rest", "v", "whole"]),
    ("x = (", [UNKNOWN]),
])
def test_the_top_level_names_a_cell_binds(code, names):
    assert bound_names(code) == names


def test_only_the_cells_that_bind_what_could_not_be_saved_are_replayed_in_order():
    cells = [RecordedCell(code, None, None) for code in (
        "import keras\nmodel = build()", "f = open('log')\nit = iter(ds)", "model.fit(x)", "it = iter(ds2)",
        "x = (")]
    binds = [bound_names(c.code) for c in cells]
    assert to_replay(cells, binds, set()) == []
    assert to_replay(cells, binds, {"it"}) == [cells[1], cells[3], cells[4]]  # (the one not read may bind it)
    assert to_replay(cells[:4], binds[:4], {"f"}) == [cells[1]]
    assert to_replay(cells[:4], binds[:4], {"model.fit"}) == []


def _manifest(unsaved: dict[int, dict[str, str]], cells: list[SavedCell]) -> Manifest:
    saves = [{"rank": r, "bytes": 3 << 20, "saved": ["model"], "unsaved": unsaved.get(r, {})} for r in (0, 1)]
    return Manifest(id="hvd-1-2", user="me", kernel=1, ranks=2, gpus=["0", "1"], options={}, cells=cells,
                    saves=saves, suspended=time.time(), seconds=1.0, bytes=6 << 20)


def test_a_suspend_says_how_much_how_long_and_each_object_not_saved_per_rank_where_they_differ():
    timings = Timings({"save": 1.25, "stop": 0.5})
    manifest = _manifest({0: {"f": "an open file (log)", "it": "a generator"}, 1: {"f": "an open file (log.1)"}},
                         [SavedCell("f = open('log')", None, None, ["f"])])
    said = describe_suspend(manifest, timings)
    assert said.splitlines() == [
        "Suspended hvd-1-2: 2 rank(s) saved 6.0 MiB (rank 0: 3.0 MiB, rank 1: 3.0 MiB) in 1.8 s (save 1.2 s, stop "
        "0.5 s); the ranks ended and GPU(s) 0,1 went back to the node.",
        "Saved: model.",
        "Not saved: f: an open file (log) (rank 0); an open file (log.1) (rank 1); its cell is replayed on resume.",
        "Not saved: it: a generator (rank 0); no recorded cell binds it (a --no-replay cell, %hvd push?): it will be "
        "missing after a resume.",
        "The next %%hvd cell (or %hvd resume) brings it back; from another notebook of yours: %hvd resume hvd-1-2."]
    resumed = describe_resume(manifest, Timings({"start": 8.0, "restore": 1.0}), [RecordedCell("f = open('log')",
                                                                                              None, None)])
    assert resumed.startswith("Resumed hvd-1-2 (suspended at ")
    assert resumed.endswith("2 rank(s) in 9.0 s (start 8.0 s, restore 1.0 s); replayed 1 cell(s): \"f = open('log')\".")


def test_the_idle_rule_suspends_unless_it_says_stop_and_never_past_the_lease_time():
    now = 10_000.0
    idle = registry.Card(cluster="c", workdir="w", kernel=1, kernel_started=0.0, ranks=2, started=now - 100,
                         last_cell=now - 60)
    assert suspends(Policy(idle_timeout=30), idle, now)
    assert not suspends(Policy(idle_timeout=30, idle_action="stop"), idle, now)
    assert not suspends(Policy(idle_timeout=90), idle, now)  # (not idle long enough)
    assert not suspends(Policy(idle_timeout=30, max_lease_time=50), idle, now)  # (the lease is up: a stop)
    from dataclasses import replace
    assert not suspends(Policy(idle_timeout=30), replace(idle, busy=True), now)


def test_a_cluster_with_ranks_on_other_hosts_is_not_suspended(tmp_path, monkeypatch):
    """(Two hosts do not run here: a stand-in session whose rank 1 is elsewhere; the refusal comes before any
    rank or file is touched.)"""
    from types import SimpleNamespace

    from hvd_notebook.config import ClusterOptions
    from hvd_notebook.kernel.failures import HvdError
    from hvd_notebook.kernel.suspending import Suspension

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    ranks = [SimpleNamespace(rank=0, here=True), SimpleNamespace(rank=1, here=False)]
    cluster = SimpleNamespace(ranks=ranks, workdir=tmp_path / "hvd-1-2", gpus=[])
    session = SimpleNamespace(cluster=cluster, options=ClusterOptions(n=2), history=[], require=lambda: cluster)
    with pytest.raises(HvdError, match=r"Rank\(s\) \[1\] run on other hosts: a suspend keeps each rank's state"):
        Suspension(session).suspend()
    assert not (tmp_path / "hvd_notebook" / "suspended").exists()
