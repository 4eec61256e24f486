"""%hvd help and bad input: each gives a clear one-paragraph error, starts
nothing and leaves nothing running."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import cluster_processes

from hvd_notebook.kernel import completion
from hvd_notebook.kernel.auto import AutoCells
from hvd_notebook.kernel.session import Session

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


def test_status_shows_gpu_memory_from_the_driver():
    from hvd_notebook.cluster.node.gpus import parse_gpu_memory
    from hvd_notebook.kernel.magics import format_status
    from hvd_notebook.messages import RankActivity, RankStatus

    # the format nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits prints
    used = parse_gpu_memory("4242, 1530\n4243, 812\nNo running processes found\n")
    assert used == {4242: 1530 * 2**20, 4243: 812 * 2**20}
    rows = [RankStatus(rank=r, alive=True, host="n1", pid=pid, device=f"GPU {r} (NVIDIA H200)", rss=2**30,
                       gpu_memory=used.get(pid), running=RankActivity.IDLE) for r, pid in enumerate((4242, 4243))]
    table = format_status(rows)
    assert "GPU memory" in table.splitlines()[0]
    assert "GPU 0 (NVIDIA H200)" in table and "1530 MiB" in table and "812 MiB" in table
    assert table.splitlines()[1].split()[1] == "alive" and table.splitlines()[1].endswith("idle")
    cpu = format_status([dataclasses.replace(rows[0], device="CPU", gpu_memory=None)])
    assert "GPU memory" not in cpu


@pytest.fixture
def auto(ip):
    """The shell's %hvd auto, off again after the test."""
    cells = ip.magics_manager.registry["HvdMagics"].auto
    yield cells
    cells.on = False


def test_auto_puts_the_magic_line_before_plain_cells_only(ip, auto):
    auto.on = True
    assert ip.transform_cell("  \nx = 1\nprint(x)\n").startswith("get_ipython().run_cell_magic('hvd', '--auto', "
                                                                 "'x = 1\\nprint(x)\\n')")
    for cell in ("%hvd status\n", "%time x = 1\n", "%%hvd --all-output\nx = 1\n", "%%bash\necho\n", "\n\n"):
        assert "--auto" not in ip.transform_cell(cell), cell
    assert ip.input_transformer_manager.check_complete("x = 1\n")[0] == "complete"  # the console's Enter runs it
    auto.on = False
    assert ip.transform_cell("x = 1\n") == "x = 1\n"


def test_auto_leaves_what_a_line_magic_runs_in_the_kernel(ip, run, auto):
    auto.on = True  # (no cluster: a cell sent to the ranks would fail)
    result, out = run("%time auto_local = 6 * 7")
    assert result.success and ip.user_ns["auto_local"] == 42, out


def test_auto_needs_a_cluster_and_turns_off_when_it_is_gone(ip, run, auto):
    result, out = run("%hvd auto on")
    assert not result.success and "No cluster is running" in out and not auto.on
    auto.on = True  # as if the cluster stopped after %hvd auto on
    result, out = run("never_ran = 1")
    assert not result.success and "%hvd auto is now off, and this cell did not run" in out, out
    assert not auto.on and "never_ran" not in ip.user_ns
    result, out = run("ran_here = 1")
    assert result.success and ip.user_ns["ran_here"] == 1
    result, out = run("%hvd auto off")
    assert result.success and "auto: off" in out
    auto.on = True
    result, out = run("%hvd stop")
    assert "No cluster was running.\nauto: off" in out and not auto.on, out


def test_unloading_the_extension_takes_its_hooks_out_and_loading_puts_them_back(ip):
    def hooks() -> tuple[list, bool]:
        cells = [t for t in ip.input_transformers_cleanup if isinstance(t, AutoCells)]
        return cells, completion.rank_matcher in ip.Completer.custom_matchers

    ip.run_line_magic("unload_ext", "hvd_notebook")
    try:
        assert hooks() == ([], False)
    finally:
        ip.run_line_magic("load_ext", "hvd_notebook")
    cells, completing = hooks()
    assert completing and len(cells) == 1 and ip.magics_manager.registry["HvdMagics"].auto is cells[0]
