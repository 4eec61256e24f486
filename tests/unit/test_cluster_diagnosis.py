"""What the cluster layer reads from a launcher's output: the causes of a failed
launch, how each rank ended, and the messages built from them."""

from __future__ import annotations

import pytest

from hvd_notebook.cluster.launching import diagnosis

# printed by MPICH's hydra in this machine's network namespaces (tests/integration/test_multihost.py)
HYDRA_UNREACHABLE = "ssh: connect to host 10.231.0.12 port 22: No route to host\n[mpiexec@vm] Launch proxy failed.\n"
HYDRA_NO_CALLBACK = ('[proxy:1@hvdh2] HYDU_sock_connect (lib/utils/sock.c:140): unable to connect from "hvdh2" to '
                     '"10.231.0.1" (No route to host)\n')
HYDRA_NO_PYTHON = ("[proxy:1@hvdh2] HYDU_create_process (lib/utils/launch.c:73): execvp error on file "
                   "/nonexistent/venv/bin/python (No such file or directory)\n")


def test_hydra_failures_name_the_host():
    assert diagnosis.diagnose_launch(HYDRA_UNREACHABLE) == ["host 10.231.0.12 is unreachable (No route to host)"]
    (callback,) = diagnosis.diagnose_launch(HYDRA_NO_CALLBACK)
    assert callback.startswith("host hvdh2 cannot reach the launcher on this machine at 10.231.0.1")
    (python,) = diagnosis.diagnose_launch(HYDRA_NO_PYTHON)
    assert python.startswith("host hvdh2 cannot run /nonexistent/venv/bin/python (No such file or directory)")
    assert all(diagnosis.names_a_host([c]) for c in (callback, python))


def test_ssh_and_srun_failures():
    found = diagnosis.diagnose_launch("ssh: Could not resolve hostname nodex: Name or service not known\n"
                                      "Host key verification failed.\n"
                                      "srun: error: Unable to allocate resources: Invalid partition\n")
    assert found == ["host nodex does not resolve (Name or service not known)",
                     "ssh to a host was refused: set up password-less ssh keys between the hosts",
                     "srun: Unable to allocate resources: Invalid partition"]
    assert not diagnosis.names_a_host(found[1:])


def test_the_same_cause_is_said_once_and_noise_says_nothing():
    assert len(diagnosis.diagnose_launch(HYDRA_UNREACHABLE * 3)) == 1
    assert diagnosis.diagnose_launch("Traceback (most recent call last):\nValueError: x\n") == []


def test_telling_line_prefers_a_missing_file_then_an_error_then_the_last_line():
    assert diagnosis.telling_line("a\nbash: /x/python: No such file or directory\nRuntimeError: y\n") \
        == "bash: /x/python: No such file or directory"
    assert diagnosis.telling_line("a\nRuntimeError: y\nz\n") == "RuntimeError: y"
    assert diagnosis.telling_line("a\n  last  \n\n") == "last"
    assert diagnosis.telling_line("") == "it printed nothing"


def test_exit_reports_add_mpi_abort_to_what_the_placement_read():
    """Each launcher's own report is read by its placement (test_cluster_placement.py); MPICH's MPI_Abort line,
    printed whatever the launcher, is read here, after the launcher's word on the same rank."""
    output = ("Abort(5) on node 2 (rank 2 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 5) - process 2\n"
              "Abort(6) on node 1 (rank 1 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 6) - process 1\n")
    assert diagnosis.exit_reports(output, {0: "exit code 0", 1: "exit code 6"}) == {
        0: "exit code 0", 1: "exit code 6", 2: "MPI_Abort with code 5"}
    assert diagnosis.exit_reports("", {}) == {}


def test_mpi_init_failure_is_recognised():
    assert diagnosis.mpi_init_failed("Abort(1090959) on node 1: Fatal error in internal_Init_thread: Other MPI error")
    assert diagnosis.mpi_init_failed("Fatal error in PMPI_Init: Other MPI error")
    assert not diagnosis.mpi_init_failed("Fatal error in PMPI_Allreduce: Message truncated")


def test_tail_keeps_the_last_non_blank_lines_indented():
    assert diagnosis.tail("a\n\nb\nc\n", lines=2) == "    b\n    c"
    assert diagnosis.tail("  \n") == "    (mpiexec printed nothing)"


def test_messages_carry_command_causes_and_output():
    text = diagnosis.launcher_exited("mpiexec", 255, 2, 1, ["host b is unreachable (x)"], "mpiexec -n 2 python",
                                     "line one\nline two\n")
    assert text.startswith("mpiexec exited (code 255) before all 2 engines connected (1 did).")
    assert "\n  - host b is unreachable (x)\n" in text and "Command: mpiexec -n 2 python" in text
    assert "    line two" in text and "--mpi-args" in text
    assert "Only 1 of 2 engines connected within --timeout 30 s" in diagnosis.engines_late(2, 1, 30.0, "c", "")
    assert "--timeout 5 s" in diagnosis.setup_late(5.0)
    assert "they report sizes [1]" in diagnosis.not_one_world(2, [1], "/usr/bin/mpiexec")


def test_setup_failure_names_the_first_failed_engine():
    class Composite(Exception):
        elist = [("ImportError", "no module named tensorflow", "", {"engine_id": 3})]

    assert diagnosis.setup_failed(Composite()) == "Setting up engine 3 failed: ImportError: no module named tensorflow"
    assert diagnosis.setup_failed(ValueError("bad")) == "Setting up engine ? failed: ValueError: bad"


# ------------------------------------------------------------------ MPI_Init's one more try
INIT_FAILED = "Abort(1090959) on node 1: Fatal error in internal_Init_thread: Other MPI error"


def starts(*results):
    """A start that returns ``results`` one after the other, and the list of what it returned."""
    given = []

    def start():
        given.append(results[len(given)])
        return given[-1]
    return start, given


def test_mpi_init_is_tried_once_more_and_no_more(capsys):
    start, given = starts("init failed", "up")
    assert diagnosis.tries_where_mpi_init_fails(start, lambda r: r == "init failed", "the script started") == "up"
    err = capsys.readouterr().err
    assert "MPI_Init failed on a rank before the script started; starting the ranks once more." in err
    start, given = starts(*["init failed"] * 5)
    assert diagnosis.tries_where_mpi_init_fails(start, lambda r: r == "init failed", "x") == "init failed"
    assert len(given) == diagnosis.MPI_INIT_TRIES == 2
    capsys.readouterr()
    start, given = starts("other failure", "up")
    assert diagnosis.tries_where_mpi_init_fails(start, lambda r: r == "init failed", "x") == "other failure"
    assert len(given) == 1 and capsys.readouterr().err == ""


def test_a_cluster_start_whose_mpi_init_keeps_failing_says_so_and_other_failures_are_not_retried(monkeypatch):
    from hvd_notebook.cluster.errors import ClusterError
    from hvd_notebook.cluster.launching.cluster import MPICluster

    cluster = MPICluster.__new__(MPICluster)  # no launch: _start_once is the fake
    tries = []

    def failing(message, init_failed):
        def start_once():
            tries.append(message)
            raise ClusterError(message, mpi_init_failed=init_failed)
        return start_once

    monkeypatch.setattr(cluster, "_start_once", failing(f"mpiexec exited: {INIT_FAILED}", True))
    with pytest.raises(ClusterError) as caught:
        cluster._start_cold()
    assert len(tries) == 2 and caught.value.mpi_init_failed
    assert str(caught.value).startswith("MPI_Init failed on a rank in two tries in a row. The second: mpiexec exited")
    tries.clear()
    monkeypatch.setattr(cluster, "_start_once", failing("Only 0 of 2 engines connected", False))
    with pytest.raises(ClusterError, match="Only 0 of 2"):
        cluster._start_cold()
    assert len(tries) == 1


def test_a_job_is_launched_once_more_only_where_mpi_init_failed_before_its_script(monkeypatch):
    from hvd_notebook.cluster.launching import run as runmod

    launched = []
    ends = iter([(1, INIT_FAILED), (0, "")])
    monkeypatch.setattr(runmod, "_launch", lambda argv, env, workdir: launched.append(argv) or next(ends))
    argv = ["mpiexec", "-n", "2", "python", "-m", runmod.SCRIPT_MAIN, "train.py"]
    assert runmod._launch_once_more_after_mpi_init(argv, {}, None) == (0, "")
    assert len(launched) == 2
    launched.clear()
    ends = iter([(1, INIT_FAILED), (0, "")])  # not under the runner: the script may have run already
    assert runmod._launch_once_more_after_mpi_init(["mpiexec", "-n", "2", "./a.out"], {}, None) == (1, INIT_FAILED)
    assert len(launched) == 1
