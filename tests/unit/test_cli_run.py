"""``hvd-notebook run`` (``horovodrun``) without launching anything: its options, the Horovod
settings they give the ranks, the ranks' command line, and how a job's end is told."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from hvd_notebook import cli
from hvd_notebook.cluster.errors import ClusterError
from hvd_notebook.cluster.launching import diagnosis
from hvd_notebook.cluster.launching import run as runmod
from hvd_notebook.cluster.launching.placements import host_list, is_report_line
from hvd_notebook.cluster.launching.placements.host_list import HostList
from hvd_notebook.cluster.launching.placements.one_host import OneHost
from hvd_notebook.config import ClusterOptions


def parse(*argv: str) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="horovodrun", allow_abbrev=False)
    cli.add_run_arguments(parser)
    return parser.parse_known_args(list(argv))


# ------------------------------------------------------------------ options
def test_horovodrun_spellings_and_the_command_after_them():
    args, unknown = parse("-np", "4", "-H", "a:2,b:2", "--verbose", "python", "train.py", "--verbose", "-np", "1")
    assert (args.n, args.hosts, args.verbose, unknown) == (4, "a:2,b:2", True, [])
    assert args.program == ["python", "train.py", "--verbose", "-np", "1"]  # the script's own arguments
    args, _ = parse("--num-proc", "2", "-hostfile", "hosts.txt", "python", "x.py")
    assert (args.n, args.hostfile) == (2, "hosts.txt")


def test_horovod_settings_become_the_variables_horovodrun_sets():
    args, _ = parse("-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5", "--timeline-filename",
                    "/tmp/t.json", "--timeline-mark-cycles", "--log-level", "DEBUG", "--no-stall-check",
                    "--stall-check-warning-time-seconds", "5", "--stall-check-shutdown-time-seconds", "9", "true")
    assert cli.horovod_environment(args) == {
        "HOROVOD_FUSION_THRESHOLD": str(32 * 1024 * 1024), "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_TIMELINE": "/tmp/t.json", "HOROVOD_TIMELINE_MARK_CYCLES": "1", "HOROVOD_LOG_LEVEL": "DEBUG",
        "HOROVOD_STALL_CHECK_DISABLE": "1", "HOROVOD_STALL_CHECK_TIME_SECONDS": "5",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "9"}
    args, _ = parse("-np", "2", "--fusion-threshold-mb", "0", "true")
    assert cli.horovod_environment(args) == {"HOROVOD_FUSION_THRESHOLD": "0"}  # 0: no fusion, not "unset"
    args, _ = parse("-np", "2", "--disable-cache", "true")
    assert cli.horovod_environment(args) == {}


def test_the_job_carries_placement_settings_and_the_ranks_variables():
    args, _ = parse("-np", "3", "--start-timeout", "12", "--mpi-args", "-bind-to core", "--fusion-threshold-mb", "1",
                    "python", "x.py", "a")
    job = cli.job_from_arguments(args)
    assert job.command == ("python", "x.py", "a")
    assert (job.options.n, job.options.host_check_timeout, job.options.mpi_args) == (3, 12.0, ("-bind-to", "core"))
    assert dict(job.options.env) == {"HOROVOD_FUSION_THRESHOLD": "1048576"}


@pytest.mark.parametrize("argv, says", [
    (["-np", "0", "python", "x.py"], "at least one rank"),
    (["-np", "2", "--fusion-threshold-mb", "-1", "python", "x.py"], "negative"),
    (["-np", "2", "--log-level", "LOUD", "python", "x.py"], "invalid choice"),
])
def test_bad_values_are_refused_by_the_parser(argv, says, capsys):
    with pytest.raises(SystemExit):
        parse(*argv)
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("argv, says", [
    (["python", "x.py"], "-np"),
    (["-np", "2", "--timeline-mark-cycles", "python", "x.py"], "--timeline-filename"),
])
def test_incomplete_lines_say_what_to_add(argv, says):
    args, _ = parse(*argv)
    with pytest.raises(ClusterError, match=says):
        cli.job_from_arguments(args)


def test_unknown_horovodrun_options_are_refused_not_ignored(capsys):
    args, unknown = parse("-np", "2", "--gloo", "python", "x.py")
    assert unknown == ["--gloo"]
    assert cli.run_command(args, unknown, "horovodrun") == 2
    err = capsys.readouterr().err
    assert "--gloo: not an option of horovodrun" in err and "Gloo" in err


PY = sys.executable  # (not "python": the unprivileged run's PATH has none)


@pytest.mark.parametrize("args, says", [
    (["-np", "0", PY, "train.py"], "at least one rank"),
    (["-np", "2", "-H", "localhost:2", "--hostfile", "hosts.txt", PY, "train.py"], "not both"),
    (["-np", "2", PY, "missing.py"], "missing.py: no such file"),
    (["-np", "2", "--mpiexec", "no-such-mpiexec", PY, "train.py"], "was not found"),
    (["-np", "2"], "give the command"),
    (["-np", "2", "--network-interface", "eth0", PY, "train.py"], "not an option"),
])
def test_bad_input_is_refused_with_what_to_do_and_status_2(args, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    monkeypatch.setattr(runmod, "_launch", lambda argv, env: pytest.fail(f"launched {argv}"))
    try:
        status = cli.main(["run", *args])
    except SystemExit as exc:  # (refused by the parser itself)
        status = exc.code
    assert status == 2
    assert says in capsys.readouterr().err


def test_the_entry_point_answers_to_horovodrun(monkeypatch):
    jobs = []
    monkeypatch.setattr(cli, "run_job", lambda job: jobs.append(job) or 7)
    monkeypatch.setattr(sys, "argv", ["/some/bin/horovodrun", "-np", "2", "python", "x.py"])
    assert cli.main() == 7
    assert jobs[0].command == ("python", "x.py") and jobs[0].options.n == 2
    monkeypatch.setattr(sys, "argv", ["/some/bin/hvd-notebook", "run", "-np", "3", "true"])
    assert cli.main() == 7 and jobs[1].options.n == 3


# ------------------------------------------------------------------ the ranks' command line
def test_split_python_reads_the_interpreters_own_options():
    assert runmod.split_python(("python", "-u", "-W", "ignore", "x.py", "-u")) == (
        ["python", "-u", "-W", "ignore"], ["x.py", "-u"])
    assert runmod.split_python(("/env/bin/python3.11", "-m", "pkg", "a")) == (
        ["/env/bin/python3.11"], ["-m", "pkg", "a"])
    assert runmod.split_python(("python3", "-c", "print(1)")) == (["python3"], ["-c", "print(1)"])
    assert runmod.split_python(("python", "-uc", "print(1)")) is None  # cannot be read safely: left alone
    assert runmod.split_python(("bash", "x.sh")) is None
    assert runmod.split_python(("python",)) is None


def test_a_script_of_this_environment_runs_under_the_fail_fast_runner():
    here = str(Path(sys.executable).parent / "python")
    main = runmod.SCRIPT_MAIN
    assert runmod.fail_fast((here, "-u", "x.py", "a")) == [here, "-u", "-m", main, "x.py", "a"]
    assert runmod.fail_fast((here, "-m", "pkg")) == [here, "-m", main, "-m", "pkg"]
    assert runmod.fail_fast((here, "-m", "mpi4py", "x.py")) == [here, "-m", "mpi4py", "x.py"]  # the user's choice
    assert runmod.fail_fast(("/nonexistent/env/bin/python", "x.py")) == ["/nonexistent/env/bin/python", "x.py"]
    assert runmod.fail_fast(("true",)) == ["true"]


def test_commands_that_cannot_run_are_refused_before_launch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ClusterError, match="give the command"):
        runmod.check_command(())
    with pytest.raises(ClusterError, match="no-such-program: command not found"):
        runmod.check_command(("no-such-program",))
    with pytest.raises(ClusterError, match="missing.py: no such file"):
        runmod.check_command((sys.executable, "missing.py"))
    (tmp_path / "there.py").write_text("")
    runmod.check_command((sys.executable, "there.py"))
    runmod.check_command((sys.executable, "-m", "json.tool"))


def test_the_launcher_line_on_one_host(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.py").write_text("")
    job = runmod.Job((sys.executable, "x.py"), ClusterOptions(n=2, env=(("HOROVOD_TIMELINE", "t.json"),)))
    placement, argv, env = runmod.prepare(job)
    guard = placement.launcher_prefix()  # gforker starts through shmguard, which then becomes it
    launcher = argv[len(guard):]
    assert argv[:len(guard)] == guard and launcher[0] == placement.command
    assert launcher[1:3] == ["-n", "2"] and argv[-4:] == [sys.executable, "-m", runmod.SCRIPT_MAIN, "x.py"]
    assert env["HOROVOD_TIMELINE"] == "t.json" and env["UCX_TLS"] == "self,posix,cma"  # MPI over shared memory only
    if placement.command.endswith("mpiexec.gforker"):
        assert "-exitinfo" in argv  # gforker says how each rank ended
        assert guard and guard[-1].endswith("shmguard.py")


def test_hosts_both_ways_is_refused():
    job = runmod.Job((sys.executable, "-c", "pass"), ClusterOptions(n=2, hosts="a:2", hostfile="f"))
    with pytest.raises(ClusterError, match="not both"):
        runmod.prepare(job)


def test_open_mpi_is_told_which_variables_reach_other_hosts(monkeypatch):
    placement = HostList(ClusterOptions(n=2, hosts="a:1,b:1"))
    monkeypatch.setattr(host_list, "is_open_mpi", lambda command: True)
    assert placement.forwarded_variables(["B", "A"]) == ["-x", "A", "-x", "B"]
    assert placement.command_line(2, ["A"], ["python", "x.py"])[-4:] == ["-x", "A", "python", "x.py"]
    monkeypatch.setattr(host_list, "is_open_mpi", lambda command: False)
    assert placement.forwarded_variables(["A"]) == []


# ------------------------------------------------------------------ how a job ends
def test_exit_reports_read_mpi_abort_and_gforker_lines():
    output = ("[0]0:Return code = 0, signaled with Quit\n[0]1:Return code = 3\n"
              "Abort(5) on node 2 (rank 2 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 5) - process 2\n")
    assert OneHost(ClusterOptions()).exit_reports(output) == {0: "signal Quit", 1: "exit code 3",
                                                             2: "MPI_Abort with code 5"}
    assert is_report_line("[0]1:Return code = 3\n") and not is_report_line("rank 1: hello\n")


def test_the_rank_that_failed_is_named_not_those_the_launcher_stopped():
    reports = {0: "signal Quit", 1: "exit code 3"}
    assert runmod.failed_ranks(reports) == {1: "exit code 3"}
    assert runmod.failed_ranks({0: "signal Terminated", 1: "signal Terminated"}) == {
        0: "signal Terminated", 1: "signal Terminated"}
    message = runmod.ending_message("mpiexec", 3, reports, [])
    assert message is not None and "rank 1 (exit code 3) failed" in message and "rank 0" not in message
    assert runmod.ending_message("mpiexec", 0, {0: "exit code 0", 1: "exit code 0"}, []) is None


def test_exit_status_is_the_failed_ranks():
    assert runmod.exit_status(3, {1: "exit code 3"}) == 3
    assert runmod.exit_status(130, {1: "signal Killed"}) == 137  # not the 130 of a rank the launcher stopped
    assert runmod.exit_status(0, {1: "signal Kill"}) == 137
    assert runmod.exit_status(0, {1: "MPI_Abort with code 5"}) == 5
    assert runmod.exit_status(0, {1: "strange"}) == 1  # a failed rank never reads as success
    assert runmod.exit_status(-9, {}) == 137
    assert runmod.exit_status(0, {}) == 0
    assert "host x is unreachable" in runmod.ending_message("mpiexec", 255, {}, ["host x is unreachable"])


def test_the_stderr_pump_shows_output_at_once_and_keeps_back_exit_lines():
    import io
    import os

    read_end, write_end = os.pipe()
    sink = io.BytesIO()
    pump = runmod.StderrPump(os.fdopen(read_end, "rb"), sink)
    pump.start()
    for piece in (b"epoch 1 10%\r", b"epoch 1 50%\r", b" done\nTrace", b"back: x\n[0]1:Return code = 3\n[0]0:Ret",
                  b"urn code = 0, signaled with Quit\n[not an exit line]\n"):
        os.write(write_end, piece)
    os.close(write_end)
    pump.join(timeout=10)
    assert sink.getvalue() == b"epoch 1 10%\repoch 1 50%\r done\nTraceback: x\n[not an exit line]\n"
    assert OneHost(ClusterOptions()).exit_reports(pump.output()) == {1: "exit code 3", 0: "signal Quit"}


def test_a_pump_whose_reader_left_closes_the_launchers_pipe():
    """``hvd-notebook run ... | head``: once head has gone, the launcher's writes fail, as they would unpumped,
    instead of filling a pipe nobody reads (the job would hang)."""
    import os

    read_end, write_end = os.pipe()
    sink_read, sink_write = os.pipe()
    os.close(sink_read)  # (head has gone)
    pump = runmod.StderrPump(os.fdopen(read_end, "rb"), os.fdopen(sink_write, "wb"), hold_back=False)
    pump.start()
    os.write(write_end, b"line\n")
    pump.join(timeout=10)
    assert not pump.is_alive()
    with pytest.raises(BrokenPipeError):
        os.write(write_end, b"more\n")
    os.close(write_end)


def test_the_stderr_pump_remembers_a_message_that_came_in_many_small_pieces():
    import io
    import os
    import time

    read_end, write_end = os.pipe()
    pump = runmod.StderrPump(os.fdopen(read_end, "rb"), io.BytesIO())
    pump.start()
    message = b"Abort(15) on node 0: Fatal error in internal_Init_thread: Other MPI error, error stack:\n" * 12
    for i in range(0, len(message), 2):  # (MPICH's error stack comes a few bytes at a time now and then)
        os.write(write_end, message[i:i + 2])
        time.sleep(2e-4)
    os.close(write_end)
    pump.join(timeout=10)
    assert pump.output() == message.decode()
    assert diagnosis.mpi_init_failed(pump.output())


# ------------------------------------------------------------------ a job that fails after a commit
GFORKER_RANK_1_EXIT_7 = "[1]1:Return code = 7\n"


FAILED_AFTER_A_COMMIT = (7, GFORKER_RANK_1_EXIT_7)


@pytest.mark.parametrize("max_resets, ends, status", [
    (3, [FAILED_AFTER_A_COMMIT, (0, "")], 0),  # the second launch resumes and ends well
    (0, [FAILED_AFTER_A_COMMIT], 7),  # no resets allowed: the first failure is the job's end
    (1, [FAILED_AFTER_A_COMMIT, FAILED_AFTER_A_COMMIT], 7),  # the one reset used up
])
def test_a_job_that_failed_after_a_commit_is_launched_again_up_to_the_limit(monkeypatch, capsys, max_resets, ends,
                                                                             status):
    """(The real run, a rank killed and the job resumed from its commit: integration/test_horovodrun.py.)"""
    from hvd_notebook.config import ELASTIC_COMMIT_SUMMARY, ELASTIC_DIR

    class Placement:
        launcher_name, command = "mpiexec", "mpiexec"

        def diagnose(self, output):
            return []

        def exit_reports(self, output):  # (gforker's -exitinfo lines)
            return OneHost(ClusterOptions()).exit_reports(output)

    folders, workdirs, scripted = [], [], iter(ends)

    def prepare(job):
        folders.append(Path(dict(job.options.env)[ELASTIC_DIR.name]))
        return Placement(), ["mpiexec", "-n", "2", "train"], {}

    def launch(argv, env, workdir):
        assert workdir.job() == "train"  # (the job's directory, for hvd-notebook list and the panel)
        workdirs.append(workdir.path)
        (folders[0] / ELASTIC_COMMIT_SUMMARY).write_text("step=4\n")  # rank 0 commits before rank 1 fails
        return next(scripted)

    monkeypatch.setattr(runmod, "prepare", prepare)
    monkeypatch.setattr(runmod, "_launch_once_more_after_mpi_init", launch)
    assert runmod.run_job(runmod.Job(("train",), ClusterOptions(n=2, max_resets=max_resets))) == status
    assert next(scripted, None) is None  # every scripted launch was made, and no more
    err = capsys.readouterr().err
    again = "the job failed (rank 1: exit code 7); launching it again from rank 0's last hvd.elastic commit (step=4)"
    assert err.count(again) == len(ends) - 1
    assert all(f"reset {n} of {max_resets}" in err for n in range(1, len(ends)))
    assert not folders[0].exists()  # the job's commit folder goes with it, and its directory
    assert len(set(workdirs)) == 1 and not workdirs[0].exists()


def test_reset_limit_is_horovodruns_name_for_max_resets():
    for spelling in ("--reset-limit", "--max-resets"):
        args, _ = parse("-np", "2", spelling, "0", "python", "x.py")
        assert cli.job_from_arguments(args).options.max_resets == 0
    args, _ = parse("-np", "2", "python", "x.py")
    assert cli.job_from_arguments(args).options.max_resets == 3
