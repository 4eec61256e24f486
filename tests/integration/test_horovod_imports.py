"""A Horovod script, unchanged, under a plain ``mpiexec -n 2`` with the environment's Python: its import
line gives hvd_notebook's runtime; ``HVD_NOTEBOOK_HOROVOD_ALIAS=0`` turns that off."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hvd_notebook.cluster.launching.placements import find_mpiexec
from hvd_notebook.config import HOROVOD_ALIAS

SCRIPT = textwrap.dedent("""\
    import sys

    import numpy as np
    import tensorflow as tf
    import horovod.tensorflow as hvd

    hvd.init()
    weights = tf.Variable(tf.ones([4]) * (hvd.rank() + 1))
    hvd.broadcast_([weights], root_rank=0)
    total = hvd.allreduce(tf.constant([1.0, 2.0]) * (hvd.rank() + 1), op=hvd.Sum)
    with open(f"{sys.argv[1]}/rank{hvd.rank()}.txt", "w") as out:
        out.write(f"{hvd.__name__} {int(hvd.rank_op())}/{int(hvd.size_op())} {weights.numpy().tolist()} "
                  f"{total.numpy().tolist()}")
""")


def run_script(tmp_path, text: str = SCRIPT, **env_extra: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(text)
    env = {k: v for k, v in os.environ.items() if k != HOROVOD_ALIAS.name}  # the default unless a test sets it
    env.update(TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="-1", HOROVOD_STALL_SHUTDOWN_TIME_SECONDS="60",
               **env_extra)
    return subprocess.run([find_mpiexec(None), "-n", "2", sys.executable, str(script), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_a_horovod_script_runs_unchanged_under_mpiexec(tmp_path):
    proc = run_script(tmp_path)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "ended without a word" not in proc.stderr  # (each rank's watcher heard its goodbye)
    for rank in (0, 1):
        line = (tmp_path / f"rank{rank}.txt").read_text()
        assert line == f"horovod.tensorflow {rank}/2 [1.0, 1.0, 1.0, 1.0] [3.0, 6.0]", line


# (the import line alone: the alias is what is switched, and TensorFlow's import before it would only cost time)
IMPORT_LINE = "import horovod.tensorflow as hvd\n"


@pytest.mark.parametrize("off", ["0", "off"])
def test_the_switch_turns_the_alias_off(tmp_path, off):
    proc = run_script(tmp_path, IMPORT_LINE, HVD_NOTEBOOK_HOROVOD_ALIAS=off)
    assert proc.returncode != 0
    assert "ModuleNotFoundError: No module named 'horovod'" in proc.stderr, proc.stderr[-4000:]
    assert not list(tmp_path.glob("rank*.txt"))


def test_a_rank_that_fails_is_named_before_mpiexec_ends_the_job(tmp_path):
    failing = SCRIPT + textwrap.dedent("""\
        if hvd.rank() == 1:
            raise RuntimeError("no data on this rank")
        hvd.allreduce(tf.ones([2]))
    """)
    proc = run_script(tmp_path, failing)
    assert proc.returncode != 0
    assert "[hvd_notebook] rank 1 of 2 failed with RuntimeError: no data on this rank" in proc.stderr, \
        proc.stderr[-4000:]


@pytest.mark.parametrize("how", ["os._exit(3)", "os.kill(os.getpid(), signal.SIGKILL)"])
def test_a_rank_that_ends_without_a_word_is_named(tmp_path, how):
    dying = SCRIPT + textwrap.dedent(f"""\
        import os, signal, time
        if hvd.rank() == 1:
            time.sleep(0.5)  # (rank 0 waits in the allreduce)
            {how}
        hvd.allreduce(tf.ones([2]))
    """)
    proc = run_script(tmp_path, dying)
    assert proc.returncode != 0
    named = [line for line in proc.stderr.splitlines() if "ended without a word" in line]
    # one line, for the rank that ended first (not for rank 0, which mpiexec ended after it)
    assert len(named) == 1 and named[0].startswith("[hvd_notebook] rank 1 of 2 (pid "), proc.stderr[-4000:]


def test_a_rank_that_ends_normally_fails_the_collective_still_waiting_for_it(tmp_path):
    early = SCRIPT + textwrap.dedent("""\
        import time
        if hvd.rank() == 0:  # rank 1 has ended its program: this collective can never complete
            start = time.monotonic()
            try:
                hvd.allreduce(tf.ones([2]), name="only_on_rank_0")
            except Exception as exc:
                print(f"FAILED after {time.monotonic() - start:.1f} s: {type(exc).__name__}: {exc}", flush=True)
    """)
    proc = run_script(tmp_path, early)  # (stall shutdown at 60 s: without the note, the error would come then)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (failed,) = [line for line in proc.stdout.splitlines() if line.startswith("FAILED")]
    assert "StallError: rank 1 has shut down" in failed and "only_on_rank_0" in failed, failed
    assert float(failed.split()[2]) < 10, failed
    assert "stall" not in proc.stderr, proc.stderr[-4000:]
