"""The JupyterLab panel's server side against a real cluster of a real kernel: what the server extension reads
(``hvd_notebook.lab.readings``) follows the cluster through idle, a training cell whose CPU figures move, a
stall in a named collective, a breakpoint, and its end; its buttons (``hvd_notebook.lab.actions``) act as the
magics do, through the kernel, and the notebook's next cell says what happened; a job of ``hvd-notebook run``
is listed with its ranks, and stopped; another user's cluster is a lease line and nothing more. (The panel
itself, in a browser: test_lab_browser.py.)"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import CLI, assert_gone, cluster_pids, collect, comes_within, execute, figure, started_kernel

from hvd_notebook.cluster.node import nodedir
from hvd_notebook.lab.actions import ActionError, carry_out
from hvd_notebook.lab.readings import Readings

NOTEBOOK = "experiments/panel.ipynb"  # (the user's other clusters, of tests beside this one, have other names)


def _mine(readings: Readings) -> dict:
    """The cluster of this test's kernel, as the panel reads it ({} where it has none)."""
    clusters = [c for c in readings.snapshot({})["clusters"] if c["notebook"] == NOTEBOOK]
    assert len(clusters) <= 1, clusters
    return clusters[0] if clusters else {}


def _state_is(readings: Readings, state: str) -> dict | None:
    cluster = _mine(readings)
    return cluster if cluster.get("state") == state else None


def _answer_stdin(kc, msg_id: str, answer: str, seconds: float) -> str:
    """Answer the cell's first prompt with ``answer``; the cell's text output once it ended."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            kc.get_stdin_msg(timeout=0.1)
        except queue.Empty:
            continue
        kc.input(answer)
        return collect(kc, msg_id)[1]
    raise AssertionError("the cell asked for nothing")


def test_the_panel_follows_a_cluster_and_its_buttons_act_as_the_magics(tmp_path, monkeypatch):
    env = {"JPY_SESSION_NAME": NOTEBOOK, "HVD_NOTEBOOK_LEASE_DIR": str(tmp_path / "node"),
           "HVD_NOTEBOOK_MAX_CPU_RANKS_PER_USER": "8"}
    for name, value in env.items():  # (the server's environment: the same node and rules as the kernel's)
        monkeypatch.setenv(name, value)
    readings = Readings()
    with started_kernel(env) as (_, kc):
        reply, out = execute(kc, "%load_ext hvd_notebook\nfrom hvd_notebook.kernel.session import Session\n"
                                   "%hvd start -n 2 --env HOROVOD_STALL_CHECK_TIME_SECONDS=1")
        assert reply["content"]["status"] == "ok", out
        pids = cluster_pids(kc)
        first = _mine(readings)
        assert first["kind"] == "notebook", first
        assert first["state"] == "idle" and first["n"] == 2 and first["hosts"] == [os.uname().nodename], first
        assert "tensorflow" in first["framework"] and first["backend"], first
        assert [r["rank"] for r in first["ranks"]] == [0, 1] and all(r["device"] == "CPU" for r in first["ranks"])
        assert all(r["cpu_percent"] is None and r["rss"] > 10 * 2**20 for r in first["ranks"]), first["ranks"]
        snapshot = readings.snapshot({})
        assert snapshot["gpus"] is None  # no driver here: no GPU figures, no error
        assert snapshot["caps"] == {"max_gpus_per_user": None, "max_ranks_per_user": 8, "my_gpus": 0,
                                    "my_cpu_ranks": 2}, snapshot["caps"]  # (the rules and the kernel's card)
        assert set(first["actions"]) == {"interrupt", "restart", "stop", "stacks"}

        # a cell that computes: the panel says it runs, and each rank's CPU share is read
        msg_id = kc.execute("%%hvd\nimport time\nend = time.time() + 6\nwhile time.time() < end:\n    pass")
        running = comes_within(lambda: _state_is(readings, "running"), 20, every=0.3)
        assert running, _mine(readings)
        shares = []  # each rank's CPU share over the last 0.7 s, four times (beside other tests: a core shared)
        for _ in range(4):
            time.sleep(0.7)
            shares.append([r["cpu_percent"] for r in _mine(readings)["ranks"]])
        assert all(s is not None for row in shares for s in row), shares
        assert all(max(row[rank] for row in shares) > 20 for rank in (0, 1)), shares
        collect(kc, msg_id)
        assert comes_within(lambda: _state_is(readings, "idle"), 10), _mine(readings)

        # a stall in a named collective: rank 1 comes 5 s late
        msg_id = kc.execute("%%hvd\nimport numpy as np\nif hvd.rank() == 1:\n    time.sleep(5)\n"
                            "hvd.allreduce(np.ones(1), name='late_gradient')")
        stalled = comes_within(lambda: _state_is(readings, "stalled"), 20, every=0.3)
        assert stalled and "late_gradient" in stalled["detail"], _mine(readings)
        figure(f"the panel's detail of a stall: {stalled['detail']}")
        collect(kc, msg_id)
        assert comes_within(lambda: _state_is(readings, "idle"), 10), _mine(readings)

        # a breakpoint on rank 1
        msg_id = kc.execute("%%hvd\nhvd.breakpoint(rank=1)\nx = 1", allow_stdin=True)
        stopped = comes_within(lambda: _state_is(readings, "breakpoint"), 30, every=0.3)
        assert stopped and "rank 1" in stopped["detail"], _mine(readings)
        _answer_stdin(kc, msg_id, "c", 30)
        assert comes_within(lambda: _state_is(readings, "idle"), 10), _mine(readings)

        cluster = _mine(readings)["id"]
        # where is every rank: in the running cell's line, as %hvd stacks says
        msg_id = kc.execute("%%hvd\ntime.sleep(30)")
        assert comes_within(lambda: _state_is(readings, "running"), 20, every=0.3)
        # (the ranks begin the cell a moment after the kernel sent it)
        where = comes_within(lambda: (w := carry_out(cluster, "stacks")).count("at a cell, line 1") == 2 and w, 20,
                             every=0.5) or carry_out(cluster, "stacks")
        assert "rank 0 of 2" in where and "rank 1 of 2" in where and where.count("at a cell, line 1") == 2, where
        # interrupt: the cell ends as with the notebook's stop button
        said = carry_out(cluster, "interrupt")
        assert "interrupted" in said, said
        reply, out = collect(kc, msg_id)
        assert reply["content"]["status"] == "error" and "KeyboardInterrupt" in out, out
        assert carry_out(cluster, "interrupt").startswith("No %%hvd cell is running")

        # restart: new ranks; the next cell says so once
        said = carry_out(cluster, "restart")
        assert "restarted" in said, said
        restarted = _mine(readings)
        assert restarted["state"] == "idle" and {r["pid"] for r in restarted["ranks"]}.isdisjoint(
            {r["pid"] for r in first["ranks"]}), restarted
        reply, out = execute(kc, "%%hvd\nprint('x' in dir())")
        assert "restarted from the JupyterLab panel" in out and "[0] False" in out, out
        _, out = execute(kc, "%%hvd\nprint('again')")
        assert "restarted from the JupyterLab panel" not in out, out

        # stop, while a cell runs: the cell is interrupted, the cluster stopped, nothing left
        pids = cluster_pids(kc)
        msg_id = kc.execute("%%hvd\nimport time\ntime.sleep(30)")
        assert comes_within(lambda: _state_is(readings, "running"), 20, every=0.3), _mine(readings)
        cluster = restarted["id"]  # (a restarted cluster has a new directory, named anew)
        said = carry_out(cluster, "stop")
        assert "stopped" in said and "interrupted first" in said, said
        collect(kc, msg_id)
        assert_gone(pids)
        assert _mine(readings) == {}
        reply, out = execute(kc, "%%hvd\nprint(1)")
        assert reply["content"]["status"] == "error" and "stopped from the JupyterLab panel at" in out, out
        with pytest.raises(ActionError) as gone:
            carry_out(cluster, "stop")
        assert gone.value.status == 404 and "no running cluster" in str(gone.value)


def test_a_job_of_hvd_notebook_run_is_listed_and_stopped_from_the_panel(tmp_path):
    script = tmp_path / "slow_job.py"
    script.write_text("import time\n\ndef training_loop():\n    time.sleep(60)\n\ntraining_loop()\n")
    job = subprocess.Popen(CLI + ["run", "-np", "2", sys.executable, str(script)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    readings = Readings()

    def listed() -> dict | None:
        jobs = [c for c in readings.snapshot({})["clusters"] if str(script) in (c["command"] or "")]
        return jobs[0] if jobs and jobs[0]["n"] == 2 else None

    try:
        found = comes_within(listed, 60, every=0.5)
        assert found, (job.poll(), readings.snapshot({})["clusters"])
        assert found["kind"] == "script" and found["state"] == "running" and found["notebook"] is None, found
        assert found["command"] == f"{sys.executable} {script}" and found["hosts"] == [os.uname().nodename], found
        assert [r["rank"] for r in found["ranks"]] == [0, 1], found
        assert all(r["alive"] and r["device"] == "CPU" and r["rss"] for r in found["ranks"]), found
        assert set(found["actions"]) == {"stacks", "stop"}
        listing = subprocess.run(CLI + ["list"], capture_output=True, text=True, timeout=60).stdout
        assert f"{found['id']}: hvd-notebook run {job.pid} ({sys.executable} {script}) (running)" in listing, listing

        where = comes_within(lambda: (w := carry_out(found["id"], "stacks")).count("in training_loop()") == 2 and w,
                             20, every=0.5) or carry_out(found["id"], "stacks")
        assert "rank 0 of 2" in where and "rank 1 of 2" in where and where.count("in training_loop()") == 2, where
        with pytest.raises(ActionError) as refused:
            carry_out(found["id"], "interrupt")
        assert refused.value.status == 409 and "stacks, stop" in str(refused.value)

        pids = {job.pid} | {p.pid for p in psutil.Process(job.pid).children(recursive=True)}
        said = carry_out(found["id"], "stop")
        assert f"pid {job.pid}" in said, said
        _, err = job.communicate(timeout=30)
        assert job.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in err, err
        assert_gone(pids)
        assert listed() is None and not any(c["id"] == found["id"] for c in readings.snapshot({})["clusters"])
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()


def test_a_job_of_any_program_has_its_ranks_from_its_launcher(tmp_path):
    """A job that is no Python script of this environment (here ``sleep``) registers nothing: its ranks are the
    processes its launcher told their rank (``PMI_RANK``)."""
    job = subprocess.Popen(CLI + ["run", "-np", "2", "sleep", "60"], cwd=tmp_path, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
    readings = Readings()

    def listed() -> dict | None:
        jobs = [c for c in readings.snapshot({})["clusters"] if c["command"] == "sleep 60"
                and c["ranks"] and psutil.Process(c["ranks"][0]["pid"]).ppid() in _children(job.pid)]
        return jobs[0] if jobs and jobs[0]["n"] == 2 else None

    try:
        found = comes_within(listed, 30, every=0.5)
        assert found, readings.snapshot({})["clusters"]
        assert [(r["rank"], r["device"], r["alive"]) for r in found["ranks"]] == [(0, "CPU", True), (1, "CPU", True)]
        assert all(psutil.Process(r["pid"]).name() == "sleep" for r in found["ranks"]), found["ranks"]
        assert "No rank of this cluster answers" in carry_out(found["id"], "stacks")  # (sleep has no Python stack)
        carry_out(found["id"], "stop")
        assert job.wait(30) == 128 + signal.SIGTERM
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()


def _children(pid: int) -> set[int]:
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def test_another_users_cluster_is_a_lease_line(tmp_path, sleeper, monkeypatch):
    """A card of another user's running cluster in the node's register: the panel names the user, its GPUs
    and ranks and since when, and nothing of its kernel or its directory."""
    if os.geteuid() != 0:
        pytest.skip("gives a card to another uid (chown): needs root, as make test runs it")
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(tmp_path / "node"))
    register = nodedir.register_dir(create=True)  # (as a kernel makes it)
    nobody = 65534
    kernel = psutil.Process(sleeper.pid)
    card = register / f"cluster-{nobody}-{sleeper.pid}.json"
    card.write_text(json.dumps({"cluster": "hvd-1-2", "workdir": "/secret/of/nobody", "kernel": sleeper.pid,
                                "kernel_started": kernel.create_time(), "ranks": 4, "gpus": ["2", "3"],
                                "started": time.time() - 60, "last_cell": time.time(), "busy": True}))
    os.chown(card, nobody, nobody)
    done = subprocess.run([sys.executable, "-c", "import json\nfrom hvd_notebook.lab.readings import Readings\n"
                           "print(json.dumps(Readings().snapshot({})))"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    snapshot = json.loads(done.stdout)
    assert snapshot["others"] == [{"user": "nobody", "gpus": ["2", "3"], "ranks": 4,
                                   "since": pytest.approx(time.time() - 60, abs=30)}], snapshot["others"]
    assert "/secret/of/nobody" not in done.stdout and str(sleeper.pid) not in done.stdout
    assert Path(card).exists()
