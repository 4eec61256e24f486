"""Where the ranks go, chosen from the %hvd start options: one host, a hosts list, a
Slurm allocation; how n is settled, which launcher and arguments, which GPUs."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import psutil
import pytest

from hvd_notebook.cluster import ClusterError
from hvd_notebook.cluster.launching.placements import STANDBY_BYTES_PER_RANK, choose_placement, host_list
from hvd_notebook.cluster.launching.placements.host_list import HostList
from hvd_notebook.cluster.launching.placements.one_host import OneHost
from hvd_notebook.cluster.launching.placements.pbs import PbsJob, read_node_file
from hvd_notebook.cluster.launching.placements.slurm import SlurmAllocation
from hvd_notebook.config import ClusterOptions


def _executable(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_text("#!/bin/sh\nexit 0\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def no_slurm(monkeypatch):
    for key in ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_NPROCS", "SLURM_JOB_NODELIST", "SLURM_NODELIST",
                "PBS_JOBID", "PBS_NODEFILE"):
        monkeypatch.delenv(key, raising=False)


@pytest.fixture
def slurm(monkeypatch, tmp_path):
    """A Slurm allocation of 4 tasks on this host, with an srun on PATH."""
    _executable(tmp_path, "srun")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    return tmp_path / "srun"


def test_one_host_by_default(no_slurm):
    chosen = choose_placement(ClusterOptions())
    assert type(chosen) is OneHost and chosen.launcher_name == "mpiexec"
    assert chosen.controller_ip() == "127.0.0.1"
    assert choose_placement(ClusterOptions(ip="0.0.0.0")).controller_ip() == "0.0.0.0"


def test_one_host_settles_n(no_slurm):
    chosen = OneHost(ClusterOptions())
    assert chosen.ranks([]) == 2  # DEFAULT_RANKS_WITHOUT_GPU
    assert chosen.ranks(["0", "1", "2"]) is None  # one rank per GPU free at start
    assert OneHost(ClusterOptions(n=2)).ranks(["0", "1"]) == 2
    with pytest.raises(ClusterError, match=r"-n 3 ranks but only 2 GPU\(s\) \(0,1\) on this host"):
        OneHost(ClusterOptions(n=3)).ranks(["0", "1"])
    with pytest.raises(ClusterError, match="-n 0: a cluster needs at least one rank"):
        OneHost(ClusterOptions(n=0)).ranks([])


def test_one_host_prefers_gforker_and_asks_it_for_exit_info(tmp_path):
    mpiexec = _executable(tmp_path, "mpiexec")
    assert OneHost._single_host_launcher(str(mpiexec)) == str(mpiexec)  # no gforker beside it
    gforker = _executable(tmp_path, "mpiexec.gforker")
    assert OneHost._single_host_launcher(str(mpiexec)) == str(gforker)
    chosen = OneHost(ClusterOptions(mpiexec=str(gforker), mpi_args=("-v",)))
    assert chosen.command == str(gforker) and chosen.launcher_args() == ["-exitinfo", "-v"]
    assert OneHost(ClusterOptions(mpiexec=str(mpiexec))).launcher_args() == []  # given: used as it is


def test_one_host_keeps_mpi_on_shared_memory_unless_told_otherwise(no_slurm):
    chosen = OneHost(ClusterOptions())
    assert chosen.rank_env({}) == {"UCX_TLS": "self,posix,cma"}
    assert chosen.rank_env({"UCX_TLS": "tcp"}) == {}
    assert HostList(ClusterOptions(hosts="localhost:2")).rank_env({}) == {}


def test_a_missing_mpiexec_is_an_error(no_slurm):
    with pytest.raises(ClusterError, match="--mpiexec '/nonexistent/mpiexec' was not found"):
        choose_placement(ClusterOptions(mpiexec="/nonexistent/mpiexec"))


def test_hosts_list(no_slurm, monkeypatch):
    chosen = choose_placement(ClusterOptions(hosts="localhost:2,127.0.0.1:1", mpi_args=("-v",)))
    assert type(chosen) is HostList and chosen.ranks([]) == 3
    assert chosen.controller_ip() == "127.0.0.1"  # every host is this one
    monkeypatch.setattr(host_list, "is_open_mpi", lambda command: False)
    assert chosen.launcher_args() == ["-hosts", "localhost:2,127.0.0.1:1", "-v"]
    monkeypatch.setattr(host_list, "is_open_mpi", lambda command: True)
    assert chosen.launcher_args()[:2] == ["--host", "localhost:2,127.0.0.1:1"]
    with pytest.raises(ClusterError, match=r"-n 4 ranks but the hosts have only 3 slot\(s\)"):
        HostList(ClusterOptions(n=4, hosts="localhost:2,127.0.0.1:1")).ranks([])


def test_hosts_list_without_some_or_every_host(no_slurm):
    """--min-np goes on without the hosts that stopped answering; where none answers, nothing is left (the
    cluster then says --min-np cannot be met), not a TypeError from reading a hostfile of None."""
    chosen = HostList(ClusterOptions(n=3, hosts="localhost:2,127.0.0.1:1"))
    rest = chosen.without(["127.0.0.1"])
    assert [h.name for h in rest.hosts] == ["localhost"] and rest.slots == 2 and rest.ranks([]) == 2
    assert rest.options.hosts == "localhost:2" and rest.options.n is None and chosen.slots == 3
    none = chosen.without(["localhost", "127.0.0.1"])
    assert none.hosts == [] and none.slots == 0


def test_hosts_list_from_a_hostfile(no_slurm, tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node1:2\nnode2 slots=2\n")
    chosen = choose_placement(ClusterOptions(hostfile=str(hostfile)))
    assert [h.name for h in chosen.hosts] == ["node1", "node2"] and chosen.ranks([]) == 4


def test_hosts_list_gpus_are_the_same_ids_on_every_host(no_slurm):
    assert HostList(ClusterOptions(hosts="localhost")).take_gpus(["0", "1"], None, "me") == (["0", "1"], None)


@pytest.mark.parametrize("options, message", [
    (ClusterOptions(hosts="a", hostfile="f"), "give the hosts with -H or with --hostfile, not both"),
    (ClusterOptions(hosts="a", launcher="srun"), "--launcher srun places the ranks on the allocation's nodes"),
    (ClusterOptions(launcher="ssh"), "--launcher 'ssh': use auto, mpiexec or srun"),
    (ClusterOptions(hosts="a:x"), "'a:x' is not HOST or HOST:SLOTS"),
    (ClusterOptions(launcher="srun"), "--launcher srun needs a Slurm allocation"),
])
def test_impossible_placements_are_errors(no_slurm, options, message):
    with pytest.raises(ClusterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        choose_placement(options)


def test_slurm_allocation(slurm, monkeypatch):
    chosen = choose_placement(ClusterOptions())
    assert type(chosen) is SlurmAllocation and chosen.launcher_name == "srun" and chosen.command == str(slurm)
    assert chosen.ranks([]) == 4
    assert chosen.launcher_args() == ["--mpi=pmi2", "--kill-on-bad-exit=1"]
    monkeypatch.setenv("HVD_NOTEBOOK_SRUN_MPI", "pmix")
    assert chosen.launcher_args()[0] == "--mpi=pmix"
    assert SlurmAllocation(ClusterOptions(n=3)).ranks([]) == 3
    with pytest.raises(ClusterError, match=r"-n 5 ranks but the Slurm allocation has 4 task\(s\)"):
        SlurmAllocation(ClusterOptions(n=5)).ranks([])


def test_slurm_is_not_chosen_over_an_explicit_mpiexec_or_launcher(slurm, tmp_path):
    mpiexec = _executable(tmp_path, "mpiexec")
    assert type(choose_placement(ClusterOptions(mpiexec=str(mpiexec)))) is OneHost
    assert type(choose_placement(ClusterOptions(launcher="mpiexec"))) is OneHost
    assert type(choose_placement(ClusterOptions(launcher="srun", mpiexec=str(mpiexec)))) is SlurmAllocation


def test_standby_choice_and_its_auto_rule(no_slurm, slurm, monkeypatch):
    from hvd_notebook.cluster.launching import standby
    from hvd_notebook.config import Standby

    monkeypatch.delenv("SLURM_JOB_ID")  # (the slurm fixture's srun stays on PATH)
    one_host = choose_placement(ClusterOptions())
    monkeypatch.setenv("HVD_NOTEBOOK_STANDBY", "on")
    assert standby.choose(ClusterOptions(), one_host) is Standby.ON  # the environment sets the default
    assert standby.choose(ClusterOptions(standby="off"), one_host) is Standby.OFF  # the option wins
    monkeypatch.setenv("HVD_NOTEBOOK_STANDBY", "sometimes")
    with pytest.raises(ClusterError, match="--standby 'sometimes' .* use auto, on or off"):
        standby.choose(ClusterOptions(), one_host)
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    in_slurm = choose_placement(ClusterOptions())
    assert type(in_slurm) is SlurmAllocation
    with pytest.raises(ClusterError, match="second job step would wait"):
        standby.choose(ClusterOptions(standby="on"), in_slurm)
    assert not standby.wanted(standby.choose(ClusterOptions(standby="auto"), in_slurm), in_slurm, 2)

    free = psutil.virtual_memory().available
    assert standby.wanted(Standby.AUTO, one_host, 1) == (free >= 2 * STANDBY_BYTES_PER_RANK)
    assert not standby.wanted(Standby.AUTO, one_host, free // STANDBY_BYTES_PER_RANK)  # no room twice over
    assert standby.wanted(Standby.ON, one_host, 10**6) and not standby.wanted(Standby.OFF, one_host, 1)


# ------------------------------------------------------------------ how each rank ended, in its launcher's words
def test_one_host_reads_gforker_exitinfo(no_slurm):
    output = ("[0]0:Return code = 0\n"
              "[0]1:Return code = 0, signaled with Kill\n"
              "[0]2:Return code = 7\n"
              "[0]3:Return code = -1, signaled with Segmentation_fault\n"
              "some engine output\n")
    assert OneHost(ClusterOptions()).exit_reports(output) == {0: "exit code 0", 1: "signal Kill", 2: "exit code 7",
                                                             3: "signal Segmentation_fault"}
    assert OneHost.report_line("[0]1:Return code = 3\n") and not OneHost.report_line("rank 1: hello\n")


def test_slurm_reads_srun_task_errors(slurm):
    output = ("srun: error: node1: task 1: Exited with exit code 7\n"
              "srun: error: node2: task 3: Killed\n"
              "srun: Terminating StepId=12.0\n")
    assert SlurmAllocation(ClusterOptions()).exit_reports(output) == {1: "exit code 7", 3: "Killed"}
    assert SlurmAllocation(ClusterOptions()).exit_reports("") == {}


def test_hosts_list_reads_hydras_exit_codes_by_where_it_placed_each_rank(no_slurm):
    """hydra places each host's slots in turn, round and round (-n 5 on a:1,b:2: a has ranks 0 and 3), and
    lists each host's wait statuses in that order (1280: exit code 5; 9: SIGKILL)."""
    chosen = HostList(ClusterOptions(hosts="a:1,b:2"))
    assert chosen.ranks_by_host(5) == {"a": [0, 3], "b": [1, 2, 4]}
    output = "rank output\n[mpiexec@node0] Exit codes: [a] 0,1280\n[b] 0,9,0\nmore output\n"
    assert chosen.exit_reports(output) == {0: "exit code 0", 3: "exit code 5", 1: "exit code 0", 2: "signal Kill",
                                           4: "exit code 0"}
    assert chosen.exit_reports("[mpiexec@node0] some other line\n") == {}


# ------------------------------------------------------------------ a PBS or Torque job
@pytest.fixture
def pbs_job(no_slurm, monkeypatch, tmp_path):
    """A PBS job whose node file lists two slots on node1 and one on node2, as PBS writes it."""
    node_file = tmp_path / "nodes"
    node_file.write_text("node1\nnode1\nnode2\n")
    monkeypatch.setenv("PBS_JOBID", "12.server")
    monkeypatch.setenv("PBS_NODEFILE", str(node_file))
    return node_file


def test_a_pbs_job_places_ranks_on_its_node_files_slots(pbs_job, monkeypatch):
    chosen = choose_placement(ClusterOptions())
    assert type(chosen) is PbsJob and chosen.ranks([]) == 3 and PbsJob(ClusterOptions(n=2)).ranks([]) == 2
    monkeypatch.setattr(host_list, "is_open_mpi", lambda command: False)
    assert chosen.launcher_args() == ["-hosts", "node1:2,node2:1", "-print-all-exitcodes"]
    assert type(choose_placement(ClusterOptions(hosts="localhost:2"))) is HostList  # hosts given win
    monkeypatch.delenv("PBS_JOBID")
    assert type(choose_placement(ClusterOptions())) is OneHost  # a node file alone is no PBS job


@pytest.mark.parametrize("text, message", [
    ("", "lists no host: ask qsub for nodes"),
    ("\n  \n", "lists no host"),
    ("node1\nnode1 slots=2\n", "line 2: 'node1 slots=2' is not a host name (PBS writes one host name a line"),
])
def test_a_bad_node_file_says_what_to_do(pbs_job, text, message):
    pbs_job.write_text(text)
    with pytest.raises(ClusterError, match=re.escape(message)):
        choose_placement(ClusterOptions())


def test_a_missing_node_file_says_what_to_do(pbs_job):
    pbs_job.unlink()
    with pytest.raises(ClusterError, match=r"PBS_NODEFILE=.*: cannot read it \(No such file or directory\)\. Start "
                                           r"the notebook inside the PBS job"):
        choose_placement(ClusterOptions())


def test_node_files_keep_first_seen_order_and_count_each_line_as_a_slot(tmp_path):
    node_file = tmp_path / "nodes"
    node_file.write_text("b\na\nb\n10.0.0.3\n")
    assert [(h.name, h.slots) for h in read_node_file(str(node_file))] == [("b", 2), ("a", 1), ("10.0.0.3", 1)]
