"""``%hvd suspend`` and its resume as a user drives them, on real 2-rank clusters: a Keras 3 model trained, suspended
(the report names what could not be saved; no rank process, GPU lease or card is left), resumed by the next cell and
trained on to the weights of a run that never stopped; a cluster suspended by a kernel that then ended, taken back by
another shell (and by one only); the idle rule suspending; and bad input. Each test has a private folder of its own
(``XDG_RUNTIME_DIR``), so another run's suspended clusters are not seen."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest
from conftest import CLI, assert_gone, comes_within, figure

from hvd_notebook.cluster.node import leases, registry

SETUP = """%%hvd
import numpy as np, keras
keras.utils.set_random_seed(1)
def build():
    m = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    m.compile(hvd.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss="mse")
    return m
model, reference = build(), build()
reference.set_weights(model.get_weights())
rng = np.random.default_rng(hvd.rank())
xs, ys = rng.normal(size=(6, 16, 8)).astype("float32"), rng.normal(size=(6, 16, 1)).astype("float32")
step = 0
log = open({log!r} + str(hvd.rank()), "a")
"""
TRAIN = """%%hvd
for i in range(3):
    model.train_on_batch(xs[i], ys[i])
    step += 1
for i in range(6):
    reference.train_on_batch(xs[i], ys[i])  # (the run that never stops)
"""
GO_ON = """%%hvd
print("iterations before", int(model.optimizer.iterations), "step", step, "log closed", log.closed)
for i in range(3, 6):
    model.train_on_batch(xs[i], ys[i])
print("iterations after", int(model.optimizer.iterations))
print("max difference", max(float(np.abs(a - b).max()) for a, b in zip(model.get_weights(), reference.get_weights())))
"""


@pytest.fixture
def private(tmp_path, monkeypatch):
    """The test's own private folder (what ``private.base_dir`` finds, in this process and the ones it starts)."""
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    return runtime


def _card_of_this_kernel() -> list[registry.Card]:
    return [c for c in registry.read_all() if c.kernel == os.getpid()]


def test_a_suspended_keras_model_resumes_with_its_weights_and_optimizer_and_trains_on(session, run, private,
                                                                                       tmp_path, monkeypatch):
    monkeypatch.setenv("HVD_NOTEBOOK_GPUS", "0,1")  # (listed, not there: the ranks run on the CPU, the leases are real)
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(tmp_path / "node"))
    result, out = run("%hvd start -n 2")
    assert result.success, out
    pids = session.cluster.pids()
    assert sorted(leases.holders()) == ["0", "1"] and _card_of_this_kernel()
    for cell in (SETUP.format(log=str(tmp_path / "log")), TRAIN):
        result, out = run(cell)
        assert result.success, out
    result, out = run("%hvd suspend")
    assert result.success, out
    figure(f"%hvd suspend of a Keras 3 model on 2 CPU ranks:\n{out.strip()}")
    assert "Suspended hvd-" in out and "2 rank(s) saved" in out and "GPU(s) 0,1 went back to the node" in out, out
    assert "Not saved: log: an open file" in out and "its cell is replayed on resume" in out, out
    assert_gone(pids)  # no rank, controller or launcher left
    assert leases.holders() == {} and _card_of_this_kernel() == []
    result, out = run("%hvd status")
    assert not result.success and "This notebook's cluster is suspended (hvd-" in out, out
    result, out = run(GO_ON)
    assert result.success, out
    figure(f"The next cell resumes it:\n{out.strip()}")
    assert "Resumed hvd-" in out and "replayed 1 cell(s): 'import numpy as np, keras'" in out, out
    assert "iterations before 3 step 3 log closed False" in out and "iterations after 6" in out, out
    assert "max difference 0.0" in out, out  # the same weights as 6 steps that never stopped
    assert sorted(leases.holders()) == ["0", "1"]  # (the resume took its GPUs as a start does)
    assert not list((private / "hvd_notebook" / "suspended").iterdir())  # (taken back: gone from disk)


KERNEL = """
import sys
from IPython.testing.globalipapp import start_ipython
shell = start_ipython()
shell.run_line_magic("load_ext", "hvd_notebook")
for line in sys.stdin:
    result = shell.run_cell(line.replace("\\\\n", "\\n"))
    print("DONE", "ok" if result.success else "error", flush=True)
"""


class Shell:
    """Another notebook kernel of the same user: an IPython shell with the extension, in a process of its own, fed
    cells on its stdin."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", KERNEL], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=os.environ)

    def run(self, cell: str) -> tuple[bool, str]:
        self.send(cell)
        said = []
        for line in self.proc.stdout:
            if line.startswith("DONE "):
                return line.split()[1] == "ok", "".join(said)
            said.append(line)
        raise AssertionError(f"the shell ended:\n{''.join(said)}")

    def send(self, cell: str) -> None:
        """Start ``cell`` without waiting for it."""
        self.proc.stdin.write(cell.replace("\n", "\\n") + "\n")
        self.proc.stdin.flush()

    def end(self) -> None:
        """The kernel ends (its stdin closed: atexit runs, as at a kernel's shutdown)."""
        self.proc.stdin.close()
        self.proc.wait(60)


def test_another_kernel_takes_a_suspended_cluster_back_after_the_first_ended_and_only_one_can(session, run,
                                                                                              private, tmp_path):
    first = Shell()
    try:
        ok, out = first.run("%hvd start -n 2")
        assert ok, out
        ok, out = first.run(f"%%hvd\nx = 40 + hvd.rank()\nf = open({str(tmp_path / 'f')!r} + str(hvd.rank()), 'w')")
        assert ok, out
        ok, out = first.run("%hvd suspend")
        assert ok and "Suspended hvd-" in out, out
        ident = out.split("Suspended ", 1)[1].split(":", 1)[0]
    finally:
        first.end()  # (the first notebook's kernel ends: its suspended cluster stays)
    listed = subprocess.run([sys.executable, "-m", "hvd_notebook.cli", "list"], capture_output=True, text=True,
                            timeout=60, env=os.environ)
    assert f"{ident}: suspended since " in listed.stdout and "(gone)" in listed.stdout, listed.stdout
    result, out = run("%hvd resume")  # (the user's only one)
    assert result.success and f"Resumed {ident}" in out and "replayed 1 cell(s)" in out, out
    result, out = run("%%hvd\nprint('x is', x, 'f open', not f.closed)")
    assert "[0] x is 40 f open True" in out, out
    result, out = run(f"%hvd resume {ident}")
    assert not result.success and "A cluster of 2 ranks runs in this notebook" in out, out
    second = Shell()
    try:
        ok, out = second.run(f"%hvd resume {ident}")
        assert not ok and f"No suspended cluster is named {ident!r}. You have none on this host" in out, out
    finally:
        second.end()


def test_the_idle_rule_suspends_and_the_next_cell_resumes(session, run, private, monkeypatch):
    monkeypatch.setenv("HVD_NOTEBOOK_IDLE_TIMEOUT", "3s")
    result, out = run("%hvd start -n 2")
    assert result.success and "a cluster is suspended after 3 s without a %%hvd cell" in out, out
    result, out = run("%%hvd\ny = 7 * (hvd.rank() + 1)")
    assert result.success, out
    pids = session.cluster.pids()
    assert comes_within(lambda: session.suspension.own is not None and session.cluster is None, 60.0, every=0.2)
    assert_gone(pids)
    result, out = run("%%hvd --all-output\nprint('y is', y)")
    assert result.success, out
    assert "This notebook's cluster was suspended at" in out and "it had run no %%hvd cell for 3 s" in out, out
    assert "Resumed hvd-" in out and "[0] y is 7" in out and "[1] y is 14" in out, out


def test_bad_input_says_what_to_do(session, run, private):
    result, out = run("%hvd suspend")
    assert not result.success and "No cluster is running. Start one with %hvd start" in out, out
    result, out = run("%hvd resume")
    assert not result.success and "Nothing to resume: you have no suspended cluster" in out, out
    assert "%hvd start starts a new one" in out
    result, out = run("%hvd resume hvd-1-2")
    assert not result.success and "No suspended cluster is named 'hvd-1-2'. You have none on this host" in out, out
    result, out = run("%hvd delete hvd-1-2")
    assert not result.success and "No suspended cluster is named 'hvd-1-2'" in out, out
    result, out = run("%hvd delete")
    assert not result.success and "the following arguments are required: ID" in out, out


def test_a_kept_cluster_is_suspended_when_its_kernel_ends_and_a_new_kernel_resumes_it(session, run, private):
    first = Shell()
    try:
        ok, out = first.run("%hvd start -n 2 --keep")
        assert ok, out
        ok, out = first.run("%%hvd\nz = [hvd.rank()] * 3")
        assert ok, out
        ok, out = first.run("print('PIDS', sorted(Session.get().cluster.pids()))".replace(
            "Session", "__import__('hvd_notebook.kernel.session').kernel.session.Session"))
        pids = {int(p) for p in out.split("PIDS", 1)[1].strip().strip("[]").split(",")}
    finally:
        first.end()  # (a shutdown: its atexit suspends the cluster it was asked to keep)
    assert_gone(pids)
    result, out = run("%hvd resume")
    assert result.success and "(suspended at " in out and ": its kernel ended): 2 rank(s)" in out, out
    result, out = run("%%hvd --all-output\nprint('z is', z)")
    assert "[0] z is [0, 0, 0]" in out and "[1] z is [1, 1, 1]" in out, out


def test_a_kept_cluster_whose_kernel_is_killed_in_a_cell_is_suspended_by_its_reaper(session, run, private,
                                                                                      tmp_path):
    first = Shell()
    try:
        ok, out = first.run("%hvd start -n 2 --keep")
        assert ok, out
        # (an open file: its cell, recorded after the start, is what the resume replays)
        ok, out = first.run(f"%%hvd\nw = {{'rank': hvd.rank()}}\nf = open({str(tmp_path / 'f')!r} + str(hvd.rank()), "
                            "'w')")
        assert ok, out
        ok, out = first.run("print('PIDS', sorted(__import__('hvd_notebook.kernel.session').kernel.session.Session"
                            ".get().cluster.pids()))")
        pids = {int(p) for p in out.split("PIDS", 1)[1].strip().strip("[]").split(",")}
        first.send("%%hvd\nimport time\nwhile True: time.sleep(0.1)")
        time.sleep(3)  # (the cell runs on the ranks)
    finally:
        first.proc.kill()  # SIGKILL: no atexit; the reaper finds the kernel gone
        first.proc.wait()
    suspended = private / "hvd_notebook" / "suspended"
    assert comes_within(lambda: suspended.is_dir() and [p for p in suspended.iterdir() if p.name[0] != "."], 120.0, 0.5)
    assert_gone(pids, timeout=60)
    result, out = run("%hvd resume")
    assert result.success and ": its kernel died while a cell ran, which was interrupted): 2 rank(s)" in out, out
    result, out = run("%%hvd --all-output\nprint('w is', w, 'f open', not f.closed)")
    assert "[0] w is {'rank': 0} f open True" in out and "[1] w is {'rank': 1} f open True" in out, out


def test_clean_suspends_a_kept_cluster_whose_kernel_and_reaper_were_both_killed(private):
    """``hvd-notebook clean`` on a ``--keep`` cluster with no reaper left to suspend it: suspended, then stopped."""
    first, reapers = Shell(), []
    try:
        ok, out = first.run("%hvd start -n 2 --keep")
        assert ok, out
        ok, out = first.run("%%hvd\nkept = [hvd.rank()] * 3")
        assert ok, out
        ok, out = first.run("c = __import__('hvd_notebook.kernel.session').kernel.session.Session.get().cluster\n"
                            "print('AT', c.workdir, *sorted(c.pids()))")
        assert ok, out
        workdir, *pids = out.split("AT", 1)[1].split()
        pids = {int(p) for p in pids}
        reapers = [p for p in psutil.process_iter(["cmdline"]) if "hvd_notebook.cluster.processes.reaper" in
                   " ".join(p.info["cmdline"] or []) and workdir in " ".join(p.info["cmdline"] or [])]
        assert reapers, "the cluster has no reaper"
    finally:
        for process in reapers:  # (first: a reaper that saw its kernel die would suspend the cluster itself)
            process.kill()
        first.proc.kill()
        first.proc.wait()
    assert any(psutil.pid_exists(p) for p in pids - {first.proc.pid}), "nothing outlived the kernel: proves nothing"
    cleaned = subprocess.run(CLI + ["clean"], capture_output=True, text=True, timeout=300)
    ident = os.path.basename(workdir)
    assert cleaned.returncode == 0 and f"suspended {ident} first" in cleaned.stdout, cleaned.stdout + cleaned.stderr
    assert f"stopped {ident}" in cleaned.stdout, cleaned.stdout
    assert_gone(pids - {first.proc.pid}, timeout=30)
    from hvd_notebook.cluster.launching import suspension

    manifest = suspension.find_one(ident).manifest()
    assert manifest.ranks == 2 and all("kept" in save["saved"] for save in manifest.saves), manifest.saves
