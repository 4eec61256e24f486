"""The node's fair-sharing rules on real kernels (jupyter_client's, as JupyterLab starts them) with real
clusters: a per-user GPU cap across a user's notebooks, idle release with its message at the next cell
and ``%hvd restart --replay``, the lease time, and the node's register that ``hvd-notebook list --all``
reads. Three GPUs are listed in ``HVD_NOTEBOOK_GPUS`` (no GPU here); the ranks run on the CPU."""

from __future__ import annotations

import json
import subprocess
import time

from conftest import CLI, assert_gone, cluster_pids, comes_within, execute, figure, started_kernel

START = "%load_ext hvd_notebook\nfrom hvd_notebook.kernel.session import Session\n%hvd start -n 2"


def _node_env(tmp_path, **rules: str) -> dict[str, str]:
    return {"HVD_NOTEBOOK_GPUS": "0,1,2", "HVD_NOTEBOOK_LEASE_DIR": str(tmp_path / "node"),
            "HVD_NOTEBOOK_STANDBY": "off", **rules}


def _list_all(env: dict[str, str]) -> str:
    import os

    done = subprocess.run(CLI + ["list", "--all"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    assert done.returncode == 0, done.stderr
    return done.stdout


def _wait_for(condition, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.2)


def test_a_users_gpu_cap_counts_all_their_notebooks_and_list_all_shows_them(tmp_path):
    env = _node_env(tmp_path, HVD_NOTEBOOK_MAX_GPUS_PER_USER="2")
    with started_kernel(env) as (_, a), started_kernel(env) as (_, b):
        reply, out = execute(a, START)
        assert reply["content"]["status"] == "ok", out
        assert "This node's rules: at most 2 GPU(s) per user" in out, out
        pids = cluster_pids(a)
        listing = _list_all(env)
        figure(f"hvd-notebook list --all, one notebook on GPUs 0,1:\n{listing}")
        assert "0,1" in listing and "running" in listing and "GPU 0: " in listing and "GPU 2" not in listing
        # the same user's second notebook: GPU 2 is free, but the user's cap is reached
        reply, out = execute(b, "%load_ext hvd_notebook\n%hvd start -n 1")
        assert reply["content"]["status"] == "error"
        assert "this node allows 2 GPU(s) per user ($HVD_NOTEBOOK_MAX_GPUS_PER_USER)" in out, out
        assert "your other clusters hold 2" in out and "GPU 0,1" in out, out
        # a card says busy while a cell runs
        execute(a, "%%hvd\nimport time; time.sleep(4)", wait=False)
        assert comes_within(lambda: "busy (a cell runs)" in _list_all(env), 4.0, every=0.3)
        a.get_shell_msg(timeout=60)
        execute(a, "%hvd stop")
        assert_gone(pids)
        assert "No clusters on this node." in _list_all(env)
        # the cap counts running clusters only (a longer --timeout, within the reply's 180 s: beside three test
        # workers, two ranks' imports of TensorFlow took over the default 120 s once)
        reply, out = execute(b, "%hvd start -n 2 --timeout 170")
        assert reply["content"]["status"] == "ok", out
        card = next((tmp_path / "node" / "register").glob("cluster-*.json"))  # (the register: node/register/)
        assert json.loads(card.read_text())["gpus"] == ["0", "1"]


def test_an_idle_cluster_is_released_says_why_and_restart_brings_it_back(tmp_path):
    env = _node_env(tmp_path, HVD_NOTEBOOK_IDLE_TIMEOUT="4s", HVD_NOTEBOOK_IDLE_ACTION="stop",
                    HVD_NOTEBOOK_MAX_LEASE_TIME="30s")
    with started_kernel(env) as (_, kc):
        reply, out = execute(kc, START)
        assert reply["content"]["status"] == "ok", out
        assert "a cluster stops after 30 s or after 4 s without a %%hvd cell" in out, out
        pids = cluster_pids(kc)
        reply, out = execute(kc, "%%hvd\nx = 40 + hvd.rank()")
        assert reply["content"]["status"] == "ok", out
        assert_gone(pids, timeout=15)  # released: no %%hvd cell for 4 s
        _wait_for(lambda: "No clusters on this node.\nGPU leases: none held" in _list_all(env), 10)
        reply, out = execute(kc, "%%hvd\nprint(x)")
        assert reply["content"]["status"] == "error"
        figure(f"The next cell after the idle release:\n{out.strip()}")
        assert "This notebook's cluster was stopped at" in out and "its GPU(s) 0,1 released" in out, out
        assert "it had run no %%hvd cell for 4 s ($HVD_NOTEBOOK_IDLE_TIMEOUT)" in out and "%hvd restart" in out
        reply, out = execute(kc, "%hvd restart --replay")
        assert reply["content"]["status"] == "ok" and "Replayed 1 cell(s)." in out, out
        reply, out = execute(kc, "%%hvd\nprint('x is', x)")
        assert "x is 40" in out, out
        # a cell that runs past the lease time ends first; the cluster stops after it
        pids = cluster_pids(kc)
        reply, out = execute(kc, "%%hvd\nimport time; time.sleep(31); print('slept')")
        assert reply["content"]["status"] == "ok" and "slept" in out, out
        assert "it had run for 30 s, the longest this node allows ($HVD_NOTEBOOK_MAX_LEASE_TIME)" in out, out
        assert_gone(pids)
        assert not list((tmp_path / "node" / "register").glob("cluster-*.json"))  # the card went with the cluster
