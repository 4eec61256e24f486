"""The one recovery loop (``cluster/resets.py``) and the session's use of it, against a stand-in world:
a cell whose ranks die after an ``hvd.elastic`` commit is run again on a new world, up to ``--max-resets``
times; without a commit, or with ``--max-resets 0``, it fails as it would without elastic; the replay of
a reset runs under the cell's command, so the node's rules cannot stop the cluster in the middle of it.
(One real run of each kind of death: tests/integration/test_lifecycle.py.)"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from hvd_notebook.cluster.launching.channel import RankChannel
from hvd_notebook.cluster.launching.resets import ResetsUsedUp, run_with_resets
from hvd_notebook.config import ClusterOptions, DashboardMode
from hvd_notebook.kernel import runner as runner_module
from hvd_notebook.kernel.failures import RankDied
from hvd_notebook.kernel.recovery import RecordedCell
from hvd_notebook.kernel.session import Session


# ------------------------------------------------------------------ the loop itself
def test_the_loop_resets_while_it_may_and_returns_the_first_success():
    class Died(Exception):
        pass

    def attempts(*outcomes):
        left = list(outcomes)

        def attempt():
            outcome = left.pop(0)
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome
        return attempt

    resets = []
    with pytest.raises(ResetsUsedUp) as used_up:  # the limit: the failure stays, with the resets' lines
        run_with_resets(attempts(Died("1"), Died("2"), Died("3"), "done"), lambda f: isinstance(f, Died),
                        lambda f, n: resets.append(n) or f"reset {n}", max_resets=2)
    assert (str(used_up.value.failure), used_up.value.lines, resets) == ("3", ["reset 1", "reset 2"], [1, 2])
    assert run_with_resets(attempts(Died(), "done"), lambda f: isinstance(f, Died), lambda f, n: "r", 3) == "done"
    with pytest.raises(Died):  # no reset allowed: the failure itself
        run_with_resets(attempts(Died()), lambda f: True, lambda f, n: pytest.fail("reset"), 0)
    with pytest.raises(ValueError):  # a failure that cannot resume: at once
        run_with_resets(attempts(ValueError()), lambda f: isinstance(f, Died), lambda f, n: pytest.fail("reset"), 3)


# ------------------------------------------------------------------ the session's cells on a stand-in world
@dataclass
class Rank:
    rank: int


class World:
    """A cluster whose worlds are counted; ``log`` says what happened to it, in order."""

    n, gpus, rules, workdir = 2, [], None, None

    def __init__(self, log: list[str]) -> None:
        self.log, self.ranks = log, [Rank(0), Rank(1)]
        self.channel = RankChannel(Client())  # the real channel, over a stand-in client
        self.channel.bind({0: 0, 1: 1})

    def alive(self):
        return {0: True, 1: True}

    def restart(self):
        self.log.append("restart")
        return self.ranks

    def stop(self):
        self.log.append("stop")


class Client:
    def __getitem__(self, targets):
        return self

    def apply_async(self, *args):
        pass


class Commits:
    """The session's commit folder; ``events``: the commit events each run of a cell sees (rank 0's);
    ``on_disk``: the summary beside the commit in the folder."""

    def __init__(self, events: list[str]) -> None:
        self.events, self.forgotten, self.on_disk = events, 0, None

    def summary(self):
        return self.on_disk

    def forget(self):
        self.forgotten += 1

    def environment(self):
        return "HVD_NOTEBOOK_ELASTIC_DIR", "/nonexistent"

    def remove(self):
        pass


class Tenancy:
    """The node's card; ``due`` says the lease is over from the first call on (``lease_over``)."""

    def __init__(self, log: list[str], lease_over: bool = False) -> None:
        self.log, self.lease_over = log, lease_over

    def cell(self, busy):
        self.log.append("busy" if busy else "idle")

    def due(self):
        return "the lease is over" if self.lease_over else None

    def suspends(self):
        return False  # (the lease's end stops the cluster)

    def begin(self, *args, **kwargs):
        pass

    def end(self):
        pass


def died() -> RankDied:
    return RankDied("RankDied: rank(s) [1] died while running the cell (rank 1: exit code 7)", {1: "exit code 7"})


@pytest.fixture
def world(monkeypatch):
    """A session on a stand-in world whose cells end as ``script`` says, code by code (a list of outcomes:
    a value, or an exception to raise); ``log`` records each run, restart and stop."""
    log: list[str] = []
    script: dict[str, list] = {}

    class Running:
        def __init__(self, cluster, code, ranks, show, timeout, mode, dashboard=None, said=None):
            self.code, self.dashboard, self.cluster_lost = code, dashboard, False
            self.commits = list(session.commits.events) if code == "train" else []
            log.append(f"run {code}")

        def wait(self):
            outcome = script[self.code].pop(0)
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

    monkeypatch.setattr(runner_module, "RunningCell", Running)
    session = Session()
    session.cluster, session.options = World(log), ClusterOptions(n=2, max_resets=2)
    session.tenancy = Tenancy(log)
    session.commits = Commits(["step=4"])
    yield session, script, log
    session.cluster = None


def test_a_cell_whose_ranks_die_after_a_commit_is_reset_and_resumed(world, capsys):
    session, script, log = world
    session.history = [RecordedCell("setup", None, None)]
    script.update(setup=[None], train=[died(), "trained"])
    assert session.run_cell("train", progress=DashboardMode.NONE) == "trained"
    assert log == ["busy", "run train", "restart", "run setup", "run train", "idle"]
    err = capsys.readouterr().err
    assert "resuming from the last commit (step=4): reset 1 of 2" in err and "replayed 1/1: setup" in err
    assert [c.code for c in session.history] == ["setup", "train"]  # the cell is recorded once, when it completes


def test_the_commit_resumed_from_is_the_one_on_disk_when_its_event_did_not_arrive(world, capsys):
    # rank 0 committed step 4 and was ended before that commit's event reached the kernel
    session, script, log = world
    session.commits.events, session.commits.on_disk = ["step=2"], "step=4"
    script.update(train=[died(), "trained"])
    assert session.run_cell("train", progress=DashboardMode.NONE) == "trained"
    assert "resuming from the last commit (step=4): reset 1 of 2" in capsys.readouterr().err


def test_resets_used_up_fail_the_cell_with_its_history(world):
    session, script, log = world
    script.update(train=[died(), died(), died()])
    with pytest.raises(RankDied) as failed:
        session.run_cell("train", progress=DashboardMode.NONE)
    assert "The cell was resumed 2 time(s) already, as many as --max-resets 2 allows:" in str(failed.value)
    assert "  reset 2: rank 1: exit code 7; resumed from the last commit (step=4)" in str(failed.value)
    assert log.count("restart") == 2 and session.commits.forgotten >= 1 and session.history == []


@pytest.mark.parametrize("committed, max_resets", [(False, 2), (True, 0)])
def test_without_a_commit_or_with_max_resets_0_a_dead_rank_fails_the_cell_as_before(world, committed, max_resets):
    session, script, log = world
    session.commits.events = ["step=4"] if committed else []
    session.options = ClusterOptions(n=2, max_resets=max_resets)
    script.update(train=[died()])
    with pytest.raises(RankDied) as failed:
        session.run_cell("train", progress=DashboardMode.NONE)
    assert str(failed.value) == str(died()) and "restart" not in log
    assert session.commits.forgotten >= 1  # no later cell resumes from this one's commit


def test_a_replay_that_fails_ends_the_resume_naming_the_cell(world):
    session, script, log = world
    session.history = [RecordedCell("setup", None, None)]
    script.update(setup=[died()], train=[died()])
    with pytest.raises(RankDied) as failed:
        session.run_cell("train", progress=DashboardMode.NONE)
    assert "The hvd.elastic resume failed: The replay stopped at cell 1 of 1 ('setup')" in str(failed.value)


def test_the_nodes_rules_do_not_stop_the_cluster_in_the_middle_of_a_resume(world, capsys):
    """The lease runs out while the cell runs: the cluster is released when the cell's command ends, not
    between the resume's replay and the resumed run (the replay once went through the public run_cell,
    which marked the card idle and let the release in)."""
    session, script, log = world
    session.tenancy = Tenancy(log, lease_over=True)
    session.history = [RecordedCell("setup", None, None)]
    script.update(setup=[None], train=[died(), "trained"])
    assert session.run_cell("train", progress=DashboardMode.NONE) == "trained"
    assert log == ["busy", "run train", "restart", "run setup", "run train", "idle", "stop"]
    assert session.cluster is None and "the lease is over" in capsys.readouterr().err


def test_a_commit_whose_run_returned_is_not_resumed(world):
    """``hvd.elastic.run`` returned (its commit removed: an empty commit event) before the rank died: the cell
    fails as it would without elastic, as the new world would have nothing to resume from."""
    session, script, log = world
    session.commits.events = ["step=4", ""]
    script.update(train=[died()])
    with pytest.raises(RankDied):
        session.run_cell("train", progress=DashboardMode.NONE)
    assert "restart" not in log


def test_the_commit_folder_is_the_sessions_own_and_emptied_when_a_cell_ends(tmp_path, monkeypatch):
    from hvd_notebook.config import ELASTIC_COMMIT_SUMMARY
    from hvd_notebook.kernel import recovery

    monkeypatch.setattr(recovery, "clusters_dir", lambda: tmp_path)
    commits = recovery.ElasticCommits()
    name, folder = commits.environment()
    assert name == "HVD_NOTEBOOK_ELASTIC_DIR" and (tmp_path / folder).stat().st_mode & 0o077 == 0
    assert commits.summary() is None
    (tmp_path / folder / ELASTIC_COMMIT_SUMMARY).write_text("step=4, committed at 12:00:00\n")
    assert commits.summary() == "step=4, committed at 12:00:00"
    commits.forget()
    assert list((tmp_path / folder).iterdir()) == []
    commits.remove()
    assert not (tmp_path / folder).exists()
