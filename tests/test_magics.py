"""%hvd help and bad input: each gives a clear one-paragraph error, starts
nothing and leaves nothing running."""

from __future__ import annotations

import pytest
from conftest import cluster_processes

from hvd_notebook.session import Session

SUBCOMMANDS = ["start", "stop", "restart", "status", "pull", "push"]


@pytest.mark.parametrize("line", ["", "--help", "help"])
def test_usage_lists_every_subcommand(ip, capsys, line):
    ip.run_line_magic("hvd", line)
    out = capsys.readouterr().out
    for sub in SUBCOMMANDS:
        assert f"usage: %hvd {sub}" in out
    assert "usage: %%hvd" in out and "--output-ranks" in out and "--mpi-args" in out


def test_subcommand_help(ip, capsys):
    ip.run_line_magic("hvd", "start --help")
    out = capsys.readouterr().out
    assert "usage: %hvd start" in out and "--gpus" in out and "--timeout" in out


@pytest.mark.parametrize(
    "line, expected",
    [
        # caught by the parser: IPython's UsageError
        ("launch", "UsageError: %hvd: argument COMMAND: invalid choice: 'launch'"),
        ("start -n 0", "UsageError: %hvd start: argument -n: 0 must be at least 1"),
        ("start -n two", "UsageError: %hvd start: argument -n: 'two' is not a whole number"),
        ("start --timeout -3", "must be more than 0 seconds"),
        ("start --env NOEQUALS", "UsageError: %hvd start: argument --env: 'NOEQUALS' is not KEY=VALUE"),
        ("start --frobnicate", "UsageError: %hvd: unrecognized arguments: --frobnicate"),
        ("pull", "UsageError: %hvd pull: the following arguments are required: name"),
        ("pull x --rank -1", "is negative"),
        ("start --mpi-args '-n", "UsageError: %hvd: cannot parse"),
        # caught before anything is launched
        ("start --mpiexec /nonexistent/mpiexec", "The cluster did not start: --mpiexec '/nonexistent/mpiexec' was not"),
        ("start --gpus 0,x", "The cluster did not start: --gpus '0,x' is not valid"),
        ("start --gpus 0 -n 2", "The cluster did not start: -n 2 ranks but only 1 GPU(s)"),
    ],
)
def test_bad_input_is_an_error_and_starts_nothing(ip, run, line, expected):
    before = cluster_processes()
    result, out = run(f"%hvd {line}")
    assert not result.success
    assert expected in out
    assert Session.get().cluster is None
    assert cluster_processes() <= before


def test_cells_need_a_cluster(ip, run):
    assert Session.get().cluster is None
    result, out = run("%%hvd\nprint(1)")
    assert not result.success and "No cluster is running. Start one with %hvd start" in out
    for line in ["status", "pull x", "push x", "stop"]:
        result, out = run(f"%hvd {line}")
        assert ("No cluster is running" in out) or ("No cluster was running" in out), (line, out)


def test_restart_without_a_start(ip, run, monkeypatch):
    monkeypatch.setattr(Session, "_instance", None)  # a kernel that never started a cluster
    result, out = run("%hvd restart")
    assert not result.success and "Nothing to restart" in out


def test_bad_cell_options(ip, run):
    result, out = run("%%hvd --ranks a,b\nprint(1)")
    assert not result.success and "UsageError" in out and "comma-separated list of ranks" in out
    result, out = run("%%hvd --all-output --output-ranks 0\nprint(1)")
    assert not result.success and "not allowed with argument" in out
