"""The JupyterLab panel's server side against a real cluster of a real kernel: what the server extension reads
(``hvd_notebook.lab.readings``) follows the cluster through idle, a training cell whose CPU figures move, a
stall in a named collective, a breakpoint, and its end; its buttons (``hvd_notebook.lab.actions``) act as the
magics do, through the kernel, and the notebook's next cell says what happened; a job of ``hvd-notebook run``
is listed with its ranks, and stopped; another user's clusters are one line, whose GPUs are those a lease lock
of theirs holds, and nothing more. (The panel itself, in a browser: test_lab_browser.py.)"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from conftest import CLI, assert_gone, cluster_pids, collect, comes_within, execute, figure, started_kernel

from hvd_notebook.cluster.node import leases
from hvd_notebook.lab.actions import ActionError, carry_out
from hvd_notebook.lab.readings import Readings

NOTEBOOK = "experiments/panel.ipynb"  # (the user's other clusters, of tests beside this one, have other names)
NOBODY = 65534  # the other user: nobody, whose processes root starts (no second account needed)


def nvml_gpus() -> int | None:
    """How many GPUs the driver reports (NVML, asked here, not through the panel); None without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetCount()
    except Exception:  # (no package, no driver, no GPU)
        return None


def _as_nobody() -> None:
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


@contextlib.contextmanager
def another_users_clusters() -> Iterator[tuple[Path, str]]:
    """As root: a node (lease folder for GPUs 0-3, as setup-node makes it, in a folder every user reaches) on
    which user nobody runs two clusters: real processes of uid 65534, one holding the lease locks of GPUs 2
    and 3 (``flock``); their cards claim GPUs 1, 2, 3 and 0, and 4 + 1 ranks. Yields the node's folder and
    the secret their cards name (a workdir no one else should see); every process of theirs ended after."""
    if os.geteuid() != 0:
        pytest.skip("another user's cluster needs processes of another uid (setuid) and cards given to it "
                    "(chown): needs root, as make test runs it")
    shared = Path(tempfile.mkdtemp(prefix="hvdt-panel-"))
    shared.chmod(0o755)
    node = shared / "node"
    leases.setup_node(["0", "1", "2", "3"], node)
    locks = [str(node / f"gpu{g}.lock") for g in ("2", "3")]
    holder = subprocess.Popen(["flock", "-x", locks[0], "flock", "-x", locks[1], "sleep", "120"],
                              preexec_fn=_as_nobody, start_new_session=True)
    idle = subprocess.Popen(["sleep", "120"], preexec_fn=_as_nobody)
    secret = "/home/nobody/secret-workdir"
    try:
        assert comes_within(lambda: _locked(node, locks), 30), "nobody's flock did not take GPUs 2 and 3"
        for kernel, gpus, ranks in ((holder.pid, ["1", "2", "3"], 4), (idle.pid, ["0"], 1)):
            _nobodys_card(node, kernel, gpus, ranks, secret)
        yield node, secret
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        idle.kill()
        for proc in (holder, idle):
            proc.wait()
        shutil.rmtree(shared, ignore_errors=True)


def _locked(node: Path, locks: list[str]) -> bool:
    files = {(st.st_dev, st.st_ino) for st in map(os.stat, locks)}
    return len(leases.lock_holders(files)) == 2


def _nobodys_card(node: Path, kernel: int, gpus: list[str], ranks: int, secret: str) -> None:
    card = node / "register" / f"cluster-{NOBODY}-{kernel}.json"
    card.write_text(json.dumps({"cluster": f"hvd-{kernel}-2", "workdir": secret, "kernel": kernel,
                                "kernel_started": psutil.Process(kernel).create_time(), "ranks": ranks, "gpus": gpus,
                                "started": time.time() - 600, "last_cell": time.time(), "busy": True}))
    os.chown(card, NOBODY, NOBODY)


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
        driver = nvml_gpus()  # the GPU figures where the driver answers; none (and no error) where it does not
        if driver is None:
            assert snapshot["gpus"] is None, snapshot["gpus"]
        else:
            assert [g["index"] for g in snapshot["gpus"]] == list(range(driver)), snapshot["gpus"]
            assert all(g["memory_total"] > 0 and g["name"] for g in snapshot["gpus"]), snapshot["gpus"]
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


def test_another_users_clusters_are_one_line_with_the_gpus_their_leases_hold():
    """Cards of another user's running clusters (their kernels: processes of that uid) in the node's register:
    the panel gives one line for the user, with their ranks, the GPUs a lease lock of theirs holds (2 and 3:
    not 0 and 1, which the cards only claim) and since when, and nothing of their kernels or directories."""
    with another_users_clusters() as (node, secret):
        done = subprocess.run([sys.executable, "-c", "import json\nfrom hvd_notebook.lab.readings import Readings\n"
                               "print(json.dumps(Readings().snapshot({})))"],
                              capture_output=True, text=True, timeout=60,
                              env={**os.environ, "HVD_NOTEBOOK_LEASE_DIR": str(node)})
        kernels = [int(c.name.split("-")[2].split(".")[0]) for c in (node / "register").iterdir()]
    assert done.returncode == 0, done.stderr
    snapshot = json.loads(done.stdout)
    assert snapshot["others"] == [{"user": "nobody", "gpus": ["2", "3"], "ranks": 5,
                                   "since": pytest.approx(time.time() - 600, abs=30)}], snapshot["others"]
    assert secret not in done.stdout and not any(str(k) in done.stdout for k in kernels), done.stdout


def test_a_card_naming_a_process_of_another_uid_is_no_cluster(tmp_path, monkeypatch):
    """A card of this user's whose kernel is another user's process (pid 1, root's, where this run is not
    root's; nobody's sleep where it is) is not a running cluster: not among the others, nor in the caps."""
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(tmp_path / "node"))
    leases.setup_node(["0"], tmp_path / "node")
    stranger = subprocess.Popen(["sleep", "60"], preexec_fn=_as_nobody) if os.geteuid() == 0 else None
    kernel = psutil.Process(stranger.pid if stranger else 1)
    try:
        card = tmp_path / "node" / "register" / f"cluster-{os.geteuid()}-{kernel.pid}.json"
        card.write_text(json.dumps({"cluster": "hvd-1-2", "workdir": "", "kernel": kernel.pid, "ranks": 3,
                                    "kernel_started": kernel.create_time(), "gpus": ["0"]}))
        snapshot = Readings().snapshot({})
    finally:
        if stranger:
            stranger.kill()
            stranger.wait()
    assert snapshot["caps"]["my_gpus"] == 0 and snapshot["caps"]["my_cpu_ranks"] == 0, snapshot["caps"]
