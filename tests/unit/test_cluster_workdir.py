"""The cluster directory's format, the PID registry, the reaper's kill and the
`hvd-notebook list/clean` command that reads them; the ranks' environment and the
launcher wrapper. Processes here are `sleep`s started by the tests themselves."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from hvd_notebook import cli
from hvd_notebook.cluster.launching.launch import EngineWorld, rank_environment
from hvd_notebook.cluster.launching.world import RankInfo
from hvd_notebook.cluster.processes import pids, reaper, workdir
from hvd_notebook.cluster.processes.workdir import WorkDir
from hvd_notebook.messages import RankReport


@pytest.fixture
def tmpdir_base(monkeypatch, tmp_path):
    """clusters_dir() under tmp_path."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return workdir.clusters_dir()


def test_a_new_cluster_directory_is_private_and_names_its_kernel(tmpdir_base):
    assert tmpdir_base.parent == Path(tempfile.gettempdir()) and tmpdir_base.name.startswith("hvd_notebook-")
    made = WorkDir.create(workdir.new_cluster_id())
    assert made.path.parent == tmpdir_base and made.path.stat().st_mode & 0o777 == 0o700
    me = psutil.Process()
    assert made.owner() == (me.pid, pytest.approx(me.create_time()))
    assert (made.path / "owner").read_text().split()[0] == str(me.pid)
    (made.profile / "security").mkdir(parents=True)
    (made.profile / "security" / "key.json").write_text("{}")
    made.make_private()
    assert (made.profile / "security" / "key.json").stat().st_mode & 0o777 == 0o600
    made.remove()
    assert not made.path.exists()


def test_a_starting_cluster_is_never_seen_without_its_owner(tmpdir_base, monkeypatch):
    """hvd-notebook clean stops what names no live owner: a directory being made must not be found before its
    owner is recorded (found once with two notebooks' clusters starting and cleaning side by side)."""
    seen = []
    write = WorkDir._write

    def watched(self, name, text):
        seen.append([w.path.name for w in workdir.find_workdirs(tmpdir_base)])
        write(self, name, text)

    monkeypatch.setattr(WorkDir, "_write", watched)
    made = WorkDir.create(workdir.new_cluster_id())
    assert seen == [[]] and [w.path for w in workdir.find_workdirs(tmpdir_base)] == [made.path]
    assert made.owner() is not None and made.path.stat().st_mode & 0o777 == 0o700


def test_pid_file_round_trip_skips_lines_that_are_not_records(tmpdir_base):
    made = WorkDir.create("c1")
    made.write_pids([(11, 1.5), (12, 2.25)])
    assert (made.path / "pids").read_text() == "11 1.5\n12 2.25"
    assert made.read_pids() == [(11, 1.5), (12, 2.25)]
    (made.path / "pids").write_text("11 1.5\ngarbage\n\n12 x\n")
    assert made.read_pids() == [(11, 1.5)]
    assert WorkDir(tmpdir_base / "none").read_pids() == [] and WorkDir(tmpdir_base / "none").owner() is None


def test_a_reused_pid_is_not_the_recorded_process(sleeper):
    created = psutil.Process(sleeper.pid).create_time()
    assert pids.same_process((sleeper.pid, created)).pid == sleeper.pid
    assert pids.same_process((sleeper.pid, created - 10)) is None
    assert pids.live_processes([(sleeper.pid, created), (sleeper.pid, created + 10)]) == [psutil.Process(sleeper.pid)]
    assert pids.is_alive((sleeper.pid, created)) and not pids.is_alive((sleeper.pid, created + 1))


def test_kill_all_ends_processes_given_by_pid_or_process(sleeper):
    other = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print(1, flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    other.stdout.readline()  # it ignores SIGTERM from here on: only SIGKILL ends it
    stubborn = psutil.Process(other.pid)
    pids.kill_all([sleeper.pid, stubborn, 2**22 + 7], grace=0.2)  # (kill_all reaps them: no exit codes for Popen)
    assert not psutil.pid_exists(sleeper.pid) and not stubborn.is_running()
    other.wait()


def _parent_of_a_sleeper() -> subprocess.Popen:
    """A process that has started a child (both sleep)."""
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable,"
                               " '-c', 'import time; time.sleep(60)']); print(1, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE)
    parent.stdout.readline()
    return parent


def test_registry_remembers_descendants_and_writes_them_for_the_reaper(tmpdir_base):
    parent = _parent_of_a_sleeper()
    try:
        registry = pids.PidRegistry()
        registry.workdir = WorkDir.create("c2")
        registry.add(parent.pid)
        (child,) = psutil.Process(parent.pid).children()
        assert registry.remember_descendants() == {parent.pid, child.pid}
        assert {pid for pid, _ in registry.workdir.read_pids()} == {parent.pid, child.pid}
        assert reaper.reap(registry.workdir) == 2
        assert not registry.workdir.path.exists() and not child.is_running()
    finally:
        parent.kill()
        parent.wait()


def test_the_reaper_kills_what_a_listed_process_started_since_the_pid_file_was_written(tmpdir_base):
    parent = _parent_of_a_sleeper()  # (a launcher whose ranks started after the last write)
    try:
        workdir = WorkDir.create("c3")
        workdir.write_pids([(parent.pid, psutil.Process(parent.pid).create_time())])
        (child,) = psutil.Process(parent.pid).children()
        assert reaper.reap(workdir) == 2
        assert not workdir.path.exists() and not child.is_running()
    finally:
        parent.kill()
        parent.wait()


def test_clean_stops_only_clusters_whose_kernel_is_gone(tmpdir_base, sleeper, capsys):
    mine = WorkDir.create("hvd-mine")  # owned by this process: a running kernel
    orphan = WorkDir.create("hvd-orphan")
    (orphan.path / "owner").write_text(f"{sleeper.pid} 1.0")  # that pid, but not the process that started it
    orphan.write_pids([(sleeper.pid, psutil.Process(sleeper.pid).create_time())])
    found = {c.path.name: c for c in cli.find_clusters()}
    assert not found["hvd-mine"].orphaned and found["hvd-orphan"].orphaned
    assert found["hvd-orphan"].live_pids == [sleeper.pid] and found["hvd-orphan"].kernel_pid == sleeper.pid
    assert cli.main(["clean", "--dry-run"]) == 0
    assert "would stop hvd-orphan: kernel" in capsys.readouterr().out and sleeper.poll() is None
    assert cli.main(["clean"]) == 0
    out = capsys.readouterr().out
    assert f"stopped hvd-orphan (kernel {sleeper.pid} is gone): killed 1 process(es) [{sleeper.pid}]" in out
    assert "left alone: hvd-mine: kernel" in out and "(running)" in out
    assert sleeper.wait(5) is not None and not orphan.path.exists() and mine.path.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="root's clean --user: needs root")
def test_root_cleans_a_users_clusters_as_that_user(sleeper, monkeypatch, capfd):
    """What a user wrote cannot make root's clean act for them: a PID file of user nobody's naming a
    root process (its start time is readable by anyone) kills nothing; nobody's folder goes."""
    nobody = pwd.getpwnam("nobody")
    shared = Path(tempfile.mkdtemp(prefix="hvd-test-tmp-", dir="/tmp"))  # as /tmp: sticky, open to all
    shared.chmod(0o1777)
    try:
        monkeypatch.setattr(tempfile, "tempdir", str(shared))
        planted = shared / "hvd_notebook-nobody" / "hvd-1-1"
        planted.mkdir(mode=0o700, parents=True)
        planted.parent.chmod(0o700)
        (planted / "owner").write_text("1 1.0")  # pid 1, started at another time: a kernel that is gone
        (planted / "pids").write_text(f"{sleeper.pid} {psutil.Process(sleeper.pid).create_time()}")
        for path in (planted.parent, planted, planted / "owner", planted / "pids"):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        assert cli.main(["clean", "--user", "nobody"]) == 0
        out = capfd.readouterr().out
        assert "stopped hvd-1-1 (kernel 1 is gone): killed 0 process(es)" in out, out
        assert sleeper.poll() is None and not planted.exists()
    finally:
        monkeypatch.undo()
        shutil.rmtree(shared, ignore_errors=True)


def test_rank_environment_asks_for_huge_pages_unless_told_not_to():
    assert rank_environment({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert rank_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert rank_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}
    for off in ("0", "false", "no"):
        assert rank_environment({"HVD_NOTEBOOK_HUGEPAGES": off}) == {}


def test_rank_info_from_a_bootstrap_report():
    report = RankReport(rank=1, size=2, host="elsewhere", pid=42, device="CPU", local_rank=0, local_size=1,
                        intra_op_threads=1, inter_op_threads=2, backend="builtin", framework="", ip="10.0.0.2")
    info = RankInfo.from_bootstrap(7, report)
    assert (info.rank, info.engine_id, info.pid, info.ip, info.here) == (1, 7, 42, "10.0.0.2", False)


def test_engine_world_reads_the_log_while_running_and_ipyparallels_copy_after(tmp_path):
    log = tmp_path / "engines.log"
    log.write_text("[0]1:Return code = 7\n")
    launcher = SimpleNamespace(pid=5, args=["mpiexec", "-n", "2", "python x"], running=True, output_file=str(log),
                               poll=lambda: None, get_output=lambda: "kept by ipyparallel")
    world = EngineWorld(launcher)
    assert world.command == "mpiexec -n 2 'python x'" and world.exit_code() is None
    assert world.output() == "[0]1:Return code = 7\n"
    launcher.running, launcher.poll = False, lambda: 7
    assert world.output() == "kept by ipyparallel" and world.exit_code() == 7


def test_only_cluster_directories_are_clusters_and_what_killed_processes_left_goes(tmp_path):
    import os

    ended = subprocess.Popen(["true"])  # a process that has ended: its PID names no process
    ended.wait()
    for name in ("hvd-1-2", "stacks", f"elastic-{os.getpid()}-abc", f"elastic-{ended.pid}-def"):
        (tmp_path / name).mkdir(mode=0o700)
    # not ours to act on: a folder others may enter, a link to a folder, a link's stale elastic twin
    (tmp_path / "hvd-1-3").mkdir(mode=0o755)
    (tmp_path / "hvd-1-4").symlink_to(tmp_path / "hvd-1-2")
    (tmp_path / f"elastic-{ended.pid}-ghi").symlink_to(tmp_path / "stacks")
    # a cluster directory whose making was cut short by a kill two minutes ago, and one being made now
    (tmp_path / ".hvd-1-5.making").mkdir(mode=0o700)
    os.utime(tmp_path / ".hvd-1-5.making", (time.time() - 120,) * 2)
    (tmp_path / ".hvd-1-6.making").mkdir(mode=0o700)
    assert [w.path.name for w in workdir.find_workdirs(tmp_path)] == ["hvd-1-2"]
    assert workdir.remove_leftovers(tmp_path) == [tmp_path / f"elastic-{ended.pid}-def", tmp_path / ".hvd-1-5.making"]
    assert (tmp_path / f"elastic-{os.getpid()}-abc").exists() and (tmp_path / "stacks").is_dir()
    assert not (tmp_path / ".hvd-1-5.making").exists() and (tmp_path / ".hvd-1-6.making").is_dir()
