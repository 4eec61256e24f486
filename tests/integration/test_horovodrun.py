"""``hvd-notebook run`` (and the same entry point under the name ``horovodrun``) launching real
scripts on 2 ranks: output of both ranks, the job's exit code, the rank that failed named, Horovod
settings reaching the ranks, a timeline written, Ctrl-C stopping every rank, the job's reaper ending
the ranks of a killed ``hvd-notebook run``, and nothing left running afterwards (bad input, which
launches nothing: unit/test_cli_run.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import assert_gone, left_running

from hvd_notebook.cli import find_clusters

BIN = Path(sys.executable).parent
HVD_NOTEBOOK = BIN / "hvd-notebook"
ENV = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}  # `python` is this environment's

SCRIPT = """
import os, sys, time
import numpy as np
import hvd_notebook.runtime as hvd
hvd.init()
total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)
print(f"rank {hvd.rank()} of {hvd.size()} sum {total[0]:g} fusion {os.environ.get('HOROVOD_FUSION_THRESHOLD')}",
      flush=True)
mode = sys.argv[1] if len(sys.argv) > 1 else ""
if mode == "exit3" and hvd.rank() == 1:
    sys.exit(3)
if mode == "kill" and hvd.rank() == 1:
    os.kill(os.getpid(), 9)
if mode == "sleep":
    print(f"ready {hvd.rank()} {os.getpid()}", flush=True)
    time.sleep(120)
hvd.allreduce(np.ones(4))
"""


@pytest.fixture
def script(tmp_path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    return path


def run(args: list[str], cwd: Path, program: Path = HVD_NOTEBOOK, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the command; past ``timeout``, stop it as a user would (Ctrl-C) and fail with what it printed."""
    proc = subprocess.Popen([str(program), *args], cwd=cwd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"{args} did not end within {timeout} s:\n{out}\n{err}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_two_ranks_run_a_script_with_horovod_settings(script, tmp_path):
    timeline = tmp_path / "timeline.json"
    done = run(["run", "-np", "2", "--fusion-threshold-mb", "2", "--timeline-filename", str(timeline),
                "python", str(script)], tmp_path)
    assert done.returncode == 0, done.stderr
    # the launcher passes each rank's output on as it comes: lines of two ranks may interleave
    lines = sorted(re.findall(r"rank \d of \d sum \d+ fusion (?:\d+|None)", done.stdout))
    assert lines == [f"rank {r} of 2 sum 3 fusion {2 * 1024 * 1024}" for r in (0, 1)]
    assert "Return code" not in done.stderr  # gforker's exit lines are read, not shown
    events = json.loads(timeline.read_text())["traceEvents"]  # HOROVOD_TIMELINE reached the ranks
    assert any("ALLREDUCE" in json.dumps(e).upper() for e in events)
    assert not left_running(str(tmp_path))


def test_a_rank_that_exits_non_zero_ends_the_job_and_is_named(script, tmp_path):
    started = time.monotonic()
    done = run(["run", "-np", "2", "python", str(script), "exit3"], tmp_path, timeout=90)
    assert done.returncode == 3, done.stderr
    assert "rank 1 (exit code 3) failed" in done.stderr, done.stderr
    assert time.monotonic() - started < 60  # rank 0, waiting in a collective for rank 1, was ended
    assert not left_running(str(tmp_path))


def test_a_rank_killed_by_a_signal_is_named(script, tmp_path):
    done = run(["run", "-np", "2", "python", str(script), "kill"], tmp_path, timeout=90)
    assert done.returncode == 128 + signal.SIGKILL  # the failed rank's status, as a shell reports it
    assert "rank 1 (signal Killed) failed" in done.stderr, done.stderr
    assert not left_running(str(tmp_path))


def test_the_entry_point_answers_to_horovodrun(script, tmp_path):
    link = tmp_path / "horovodrun"
    link.symlink_to(HVD_NOTEBOOK)
    done = run(["-np", "2", "python", str(script)], tmp_path, program=link)
    assert done.returncode == 0, done.stderr
    assert sorted(re.findall(r"rank \d of \d", done.stdout)) == ["rank 0 of 2", "rank 1 of 2"]
    help_text = run(["--help"], tmp_path, program=link).stdout
    assert help_text.startswith("usage: horovodrun") and "--cycle-time-ms" in help_text


def _sleeping_job(script: Path, cwd: Path) -> tuple[subprocess.Popen, set[int]]:
    """A job of 2 ranks that sleep, once both are ready; its processes (launcher, ranks, reaper)."""
    proc = subprocess.Popen([str(HVD_NOTEBOOK), "run", "-np", "2", "python", str(script), "sleep"], cwd=cwd,
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = []
    deadline = time.monotonic() + 90
    while len(ready) < 2 and time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:  # the job ended before its ranks were ready
            break
        if line.startswith("ready "):
            ready.append(int(line.split()[2]))
    assert len(ready) == 2, proc.stderr.read() if proc.poll() is not None else "ranks did not start"
    return proc, {c.pid for c in psutil.Process(proc.pid).children(recursive=True)} | set(ready)


def test_ctrl_c_stops_every_rank(script, tmp_path):
    proc, pids = _sleeping_job(script, tmp_path)
    started = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGINT
    assert "stopped by SIGINT" in err
    assert time.monotonic() - started < 10
    assert_gone(pids)
    assert not left_running(str(tmp_path))


def test_a_killed_job_leaves_nothing_behind(script, tmp_path):
    """``kill -9`` of ``hvd-notebook run`` (no handler runs): its reaper ends the ranks and removes the job's
    directory, as a killed kernel's does for its cluster."""
    proc, pids = _sleeping_job(script, tmp_path)
    (workdir,) = [c.path for c in find_clusters() if c.kernel_pid == proc.pid]
    assert workdir.exists() and len(pids) >= 4, pids  # launcher, 2 ranks, reaper (and gforker's own)
    proc.kill()
    proc.communicate(timeout=10)
    assert_gone(pids, timeout=20)
    assert not workdir.exists()
    assert not left_running(str(tmp_path))


ELASTIC_SCRIPT = """
import os, sys
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd
hvd.init()
weights = tf.Variable(np.zeros(3, np.float32))
state = hvd.elastic.TensorFlowState([weights], step=0)

@hvd.elastic.run
def train(state):
    if state.step:
        print(f"rank {hvd.rank()} resumed at step {state.step} weights {weights.numpy().tolist()}", flush=True)
    while state.step < 8:
        weights.assign_add(hvd.allreduce(np.ones(3, np.float32), op=hvd.Sum))
        state.step += 1
        if state.step % 2 == 0:
            state.commit()
        if state.step == 5 and hvd.rank() == 1 and not os.path.exists("died"):
            open("died", "w").close()
            os._exit(7)  # the first launch only: after step 5, whose commit (step 4) is on disk
    return weights.numpy().tolist()

print(f"rank {hvd.rank()} done {train(state)}", flush=True)
"""


def test_a_failed_elastic_job_is_launched_again_from_its_last_commit(tmp_path):
    """(--reset-limit 0 and a limit used up, which launch nothing more: unit/test_cli_run.py.)"""
    (tmp_path / "train.py").write_text(ELASTIC_SCRIPT)
    done = run(["run", "-np", "2", "python", "train.py"], tmp_path, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert ("the job failed (rank 1: exit code 7); launching it again from rank 0's last hvd.elastic commit "
            "(step=4, committed at") in done.stderr and "reset 1 of 3" in done.stderr, done.stderr
    # the relaunched ranks start from the commit of step 4 (weights 4 x 2), not from zero, and finish the 8 steps
    assert "rank 0 resumed at step 4 weights [8.0, 8.0, 8.0]" in done.stdout, done.stdout
    assert "rank 1 resumed at step 4 weights [8.0, 8.0, 8.0]" in done.stdout, done.stdout
    assert "rank 0 done [16.0, 16.0, 16.0]" in done.stdout and "rank 1 done [16.0, 16.0, 16.0]" in done.stdout
    assert not left_running(str(tmp_path))
