"""%%hvd cells on one shared 2-rank cluster, driven through a real IPython shell."""

from __future__ import annotations

import sys
import time

import numpy as np
from conftest import assert_gone

from hvd_notebook.kernel.session import Session


def test_one_mpi_world_with_hvd_ranks_matching(cluster, run):
    result, out = run(
        "%%hvd --all-output\n"
        "from mpi4py import MPI\n"
        "print('world', MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD.Get_rank(), hvd.size(), hvd.rank(),"
        " hvd.local_rank(), hvd.local_size())"
    )
    assert result.success, out
    assert "[0] world 2 0 2 0 0 2" in out
    assert "[1] world 2 1 2 1 1 2" in out
    assert [r.rank for r in cluster.ranks] == [0, 1]


def test_engines_are_pinned(cluster, run):
    result, out = run(
        "%%hvd --all-output\n"
        "import os, tensorflow as tf\n"
        "print('pin', os.environ['CUDA_VISIBLE_DEVICES'], tf.config.threading.get_intra_op_parallelism_threads(),"
        " tf.config.threading.get_inter_op_parallelism_threads(), len(tf.config.list_physical_devices('GPU')))"
    )
    assert result.success, out
    cores = len(__import__("os").sched_getaffinity(0))
    intra = max(1, cores // 2)
    for rank in (0, 1):
        assert f"[{rank}] pin -1 {intra} 1 0" in out
    assert all(r.device == "CPU" and r.intra_op_threads == intra for r in cluster.ranks)


def test_ranks_ask_malloc_for_huge_pages(cluster, run):
    # TensorFlow's tensors on transparent huge pages, as numpy's large arrays are (cluster.rank_environment)
    result, out = run(
        "%%hvd --all-output\n"
        "import os, tensorflow as tf\n"
        "def huge_kb():\n"
        "    return int(next(l for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages')).split()[1])\n"
        "before = huge_kb(); big = tf.ones([16 << 20]); grown = huge_kb() - before; del big\n"
        "print('tunables', os.environ.get('GLIBC_TUNABLES'), 'grown', grown)"
    )
    assert result.success, out
    thp = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    for rank in (0, 1):
        line = next(s for s in out.splitlines() if s.startswith(f"[{rank}] tunables"))
        assert "glibc.malloc.hugetlb=1" in line, out
        if "[never]" not in thp:  # the kernel may refuse huge pages altogether; then only the setting shows
            assert int(line.split("grown")[1]) >= 32 * 1024, line  # most of the 64 MiB tensor on 2 MiB pages


def test_huge_pages_setting_adds_to_tunables_and_yields():
    from hvd_notebook.cluster.launching.launch import rank_environment

    assert rank_environment({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert rank_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}) == {
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}
    assert rank_environment({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) == {}  # the user's own choice
    assert rank_environment({"HVD_NOTEBOOK_HUGEPAGES": "0"}) == {}


def test_state_is_kept_between_cells(cluster, run):
    result, out = run("%%hvd\nkept = 10 * hvd.rank() + 7")
    assert result.success, out
    result, out = run("%%hvd --all-output\nprint('kept', kept)")
    assert "[0] kept 7" in out and "[1] kept 17" in out


def test_value_of_last_expression_comes_from_rank_0(cluster, run):
    result, out = run("%%hvd\n{'rank': hvd.rank(), 'size': hvd.size()}")
    assert result.success
    assert repr(result.result) == "{'rank': 0, 'size': 2}"
    result, _ = run("%%hvd\nz = 1")
    assert result.result is None


def test_display_calls_of_rank_0_are_shown(cluster, run):
    result, out = run("%%hvd\nfrom IPython.display import display\ndisplay(f'shown by {hvd.rank()}')")
    assert result.success
    assert "shown by 0" in out and "shown by 1" not in out


def test_output_streams_live_with_rank_prefixes(cluster, ip, monkeypatch):
    writes: list[tuple[float, str]] = []

    class Recorder:
        def write(self, text):
            writes.append((time.monotonic(), text))

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Recorder())
    monkeypatch.setattr(sys, "stderr", Recorder())
    t0 = time.monotonic()
    result = ip.run_cell(
        "%%hvd --all-output\nimport sys, time\nprint('early', hvd.rank(), flush=True)\n"
        "print('to stderr', hvd.rank(), file=sys.stderr, flush=True)\ntime.sleep(3)\nprint('late', hvd.rank())"
    )
    t_end = time.monotonic()
    monkeypatch.undo()
    assert result.success
    text = "".join(t for _, t in writes)
    for rank in (0, 1):
        assert f"[{rank}] early {rank}\n" in text
        assert f"[{rank}] to stderr {rank}\n" in text
        assert f"[{rank}] late {rank}\n" in text
    early_at = min(t for t, s in writes if "early" in s)
    assert early_at - t0 < t_end - t0 - 2.0, "the first line arrived only when the cell ended"


def test_only_rank_0_output_by_default_and_output_ranks(cluster, run):
    _, out = run("%%hvd\nprint('hello from', hvd.rank())")
    assert "[0] hello from 0" in out and "hello from 1" not in out
    _, out = run("%%hvd --output-ranks 1\nprint('hello from', hvd.rank())")
    assert "[1] hello from 1" in out and "hello from 0" not in out


def test_ranks_runs_on_a_subset(cluster, run):
    result, out = run("%%hvd --ranks 1\nonly_on_1 = True\nprint('ran on', hvd.rank())")
    assert result.success and "[1] ran on 1" in out
    result, out = run("%%hvd --all-output\nprint('has it', 'only_on_1' in globals())")
    assert "[0] has it False" in out and "[1] has it True" in out
    result, out = run("%%hvd --ranks 5\nprint(1)")
    assert not result.success and "Rank(s) [5] do not exist" in out


def test_exception_on_one_rank_fails_fast_and_keeps_the_cluster(cluster, run):
    run("%%hvd\nsurvivor = hvd.rank() + 100")
    t0 = time.monotonic()
    result, out = run(
        "%%hvd\nimport time\nif hvd.rank() == 1:\n    raise ValueError('bad shard on rank one')\ntime.sleep(60)"
    )
    elapsed = time.monotonic() - t0
    assert not result.success
    assert elapsed < 15, f"the cell took {elapsed:.1f} s to fail"
    assert "RankError: rank 1 raised ValueError: bad shard on rank one" in out
    assert "Traceback" in out and "raise ValueError" in out  # rank 1's traceback
    assert "rank 0: was still running (at a cell, line 4); interrupted" in out, out
    assert "rank 1: raised ValueError: bad shard on rank one" in out
    result, out = run("%%hvd --all-output\nprint('survivor', survivor)")
    assert result.success and "[0] survivor 100" in out and "[1] survivor 101" in out


def test_exceptions_on_every_rank(cluster, run):
    result, out = run("%%hvd\n1 / 0")
    assert not result.success
    assert "raised ZeroDivisionError" in out
    assert "rank 0: raised ZeroDivisionError" in out and "rank 1: raised ZeroDivisionError" in out


def test_timeout_names_running_ranks_and_interrupts_them(cluster, run):
    run("%%hvd\nbefore_timeout = 'kept'")
    t0 = time.monotonic()
    result, out = run("%%hvd --timeout 1\nimport time\ntime.sleep(60 if hvd.rank() == 1 else 0)")
    assert not result.success and time.monotonic() - t0 < 10
    assert "--timeout 1 s; rank(s) [1] were still running (rank 1 was at a cell, line 2)" in out, out
    assert "interrupted; their variables are kept" in out
    result, out = run("%%hvd --all-output\nprint(before_timeout)")
    assert result.success and "[1] kept" in out


def test_rank_stuck_in_a_collective_gets_a_fresh_world(cluster, run):
    old_pids = cluster.pids()
    result, out = run(
        "%%hvd --timeout 2\nfrom mpi4py import MPI\nif hvd.rank() == 0:\n    MPI.COMM_WORLD.barrier()"
    )
    assert not result.success
    assert "did not respond to an interrupt" in out and "MPI world was restarted" in out
    assert "(rank 0 was at a cell, line 3)" in out, out  # where it was stuck, from its Python stack
    assert_gone(old_pids)
    result, out = run("%%hvd --all-output\nprint('fresh', hvd.rank(), 'before_timeout' in globals())")
    assert result.success and "[0] fresh 0 False" in out and "[1] fresh 1 False" in out


def test_pull_and_push(cluster, ip, run):
    result, out = run("%%hvd\nimport numpy as np\narr = np.arange(6.0).reshape(2, 3) * (hvd.rank() + 1)\n"
                      "cfg = {'rank': hvd.rank(), 'lr': 0.1}")
    assert result.success, out
    ip.run_line_magic("hvd", "pull arr")
    np.testing.assert_array_equal(ip.user_ns["arr"], np.arange(6.0).reshape(2, 3))
    ip.run_line_magic("hvd", "pull cfg --rank 1")
    assert ip.user_ns["cfg"] == {"rank": 1, "lr": 0.1}

    ip.user_ns["weights"] = np.linspace(0, 1, 5)
    ip.user_ns["settings"] = {"batch": 32, "tags": ["a", "b"]}
    ip.run_line_magic("hvd", "push weights")
    ip.run_line_magic("hvd", "push settings")
    result, out = run("%%hvd --all-output\nprint('got', float(weights.sum()), settings['batch'], settings['tags'])")
    assert "[0] got 2.5 32 ['a', 'b']" in out and "[1] got 2.5 32 ['a', 'b']" in out


def test_pull_errors(cluster, run):
    result, out = run("%hvd pull no_such_name")
    assert not result.success and "Rank 0 has no variable named 'no_such_name'" in out
    result, out = run("%hvd pull arr --rank 7")
    assert not result.success and "--rank 7 does not exist" in out
    result, out = run("%hvd push not_in_notebook")
    assert not result.success and "no variable named 'not_in_notebook'" in out


def test_status_shows_each_rank(cluster, run):
    rows = Session.get().status()
    assert [r.rank for r in rows] == [0, 1]
    for row, info in zip(rows, cluster.ranks):
        assert row.state == "alive" and row.pid == info.pid and row.running == "idle"
        assert row.rss > 50 * 2**20  # TensorFlow is imported
    result, out = run("%hvd status")
    assert result.success
    assert "rank  state  host" in out and f" {cluster.ranks[1].pid} " in out and "MiB" in out


def test_starting_twice_is_an_error(cluster, run):
    result, out = run("%hvd start -n 2")
    assert not result.success
    assert "already running" in out and "%hvd stop" in out and "--restart" in out


def test_collectives_in_cells(cluster, run):
    result, out = run("%%hvd\nimport numpy as np\nhvd.allreduce(np.arange(3.0) * (hvd.rank() + 1), op=hvd.Sum)")
    assert result.success, out
    assert repr(result.result) == "array([0., 3., 6.])"


def test_horovod_import_line_in_a_cell(cluster, run):
    result, out = run("%%hvd --all-output\nimport horovod.tensorflow as hvd2\n"
                      "print('alias', hvd2.rank(), hvd2.size(), hvd2.allreduce is hvd.allreduce)")
    assert result.success, out
    assert "[0] alias 0 2 True" in out and "[1] alias 1 2 True" in out


def test_stall_warning_of_any_rank_is_shown(cluster, run):
    result, out = run(
        "%%hvd\nimport time, numpy as np\nfrom hvd_notebook.runtime.core import world\n"
        "world.current().negotiator.stall.check_s = 1.0\n"
        "if hvd.rank() == 0:\n    time.sleep(3)\n"
        "hvd.allreduce(np.ones(2), name='late')\n"
        "world.current().negotiator.stall.check_s = 60.0"
    )
    assert result.success, out
    assert "[1] [hvd_notebook] WARNING: stall: rank 1 has waited" in out
    assert "allreduce('late')" in out and "rank(s) [0] have not arrived" in out


def test_interrupt_in_a_collective_then_a_clear_way_out(cluster, run):
    """Rank 1 waits in an allreduce that rank 0 never reaches; the timeout interrupts both, saying where
    each was. MPI cannot cancel rank 1's half-done collective: its next one says to restart, and the
    rank that is then left inside MPI gets a fresh world."""
    t0 = time.monotonic()
    result, out = run(
        "%%hvd --timeout 2\nimport time, numpy as np\n"
        "if hvd.rank() == 0:\n    time.sleep(30)\nelse:\n    hvd.allreduce(np.ones(2))"
    )
    took = time.monotonic() - t0
    assert not result.success and ("rank(s) [0, 1] were still running (rank 0 was at a cell, line 3; rank 1 was in "
                                   "hvd.allreduce(), called from a cell, line 5)") in out, out
    assert "interrupted; their variables are kept" in out  # both responded: no MPI call was blocking
    assert took < 6, f"a 2 s timeout took {took:.1f} s to end the cell"
    result, out = run("%%hvd\nimport numpy as np\nhvd.allreduce(np.ones(2))")
    assert not result.success
    assert "can no longer agree on collectives" in out and "%hvd restart" in out
    result, out = run("%%hvd --all-output\nimport numpy as np\nprint('ok', hvd.allreduce(np.ones(2), op=hvd.Sum))")
    if not result.success:  # the session restarted the world after the failed cell
        result, out = run("%%hvd --all-output\nimport numpy as np\nprint('ok', hvd.allreduce(np.ones(2), op=hvd.Sum))")
    assert result.success, out
    assert "[0] ok [2. 2.]" in out and "[1] ok [2. 2.]" in out


TF1_EXAMPLE_CELL = """%%hvd --all-output
import tempfile
import numpy as np
import tensorflow as tf
with tf.Graph().as_default():
    rng = np.random.default_rng(hvd.rank())
    x = tf.constant(rng.normal(size=(16, 3)).astype(np.float32))
    y = tf.constant(rng.normal(size=(16, 1)).astype(np.float32))
    w = tf.compat.v1.get_variable("w", initializer=rng.normal(size=(3, 1)).astype(np.float32))
    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.AdagradOptimizer(0.01))
    seen = {}

    class Keep(tf.compat.v1.train.SessionRunHook):
        def after_create_session(self, session, coord):
            seen["start"] = session.run(w)

        def end(self, session):
            seen["end"] = session.run(w)

    hooks = [hvd.BroadcastGlobalVariablesHook(0), tf.compat.v1.train.StopAtStepHook(last_step=20), Keep()]
    train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    ckpt = tempfile.mkdtemp() if hvd.rank() == 0 else None
    with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=ckpt, hooks=hooks) as sess:
        while not sess.should_stop():
            sess.run(train_op)
both = hvd.allgather(np.stack([seen["start"], seen["end"]])[None])
print("tf1 same start", np.allclose(both[0, 0], both[1, 0]), "same end", np.allclose(both[0, 1], both[1, 1]),
      "trained", not np.allclose(both[0, 0], both[0, 1]))
"""


def test_tf1_graph_example_in_a_cell(cluster, run):
    """Horovod's original TF1 example: rank 1 starts from rank 0's weights, both end equal."""
    result, out = run(TF1_EXAMPLE_CELL)
    assert result.success, out
    for r in (0, 1):
        assert f"[{r}] tf1 same start True same end True trained True" in out, out


def test_a_stall_warning_is_followed_by_where_the_missing_rank_is(cluster, run):
    result, out = run(
        "%%hvd\nimport time\nfrom hvd_notebook.runtime.core import world\n"
        "world.current().negotiator.stall.check_s = 1.0  # (the warning after 1 s instead of 60)\n"
        "def preprocess():\n    time.sleep(4)\n"
        "if hvd.rank() == 1:\n    preprocess()\n"
        "hvd.barrier()\nworld.current().negotiator.stall.check_s = 60.0"
    )
    assert result.success, out
    assert "stall: rank 0 has waited" in out and "rank(s) [1] have not arrived" in out, out
    assert "rank 1 waits in collective" not in out, out  # (no stale answer to an earlier cell's query)
    assert "stall: rank 1 is at a cell, line 5, in preprocess() (all of its stack: %hvd stacks" in out, out
