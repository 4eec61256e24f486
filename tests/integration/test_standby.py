"""The warm standby world: launched beside a cluster with TensorFlow imported and nothing held,
promoted by a restart (by hand or after an interrupt), and gone with the cluster. The time a
restart takes with and without it is measured by the soak benchmark, not here."""

from __future__ import annotations

import _thread
import os
import signal
import subprocess
import threading
import time

import pytest
from conftest import CLI, assert_gone, figure, wait_for_standby

from hvd_notebook.cluster import ClusterOptions
from hvd_notebook.cluster.launching.cluster import MPICluster
from hvd_notebook.cluster.node import leases

# what a standby rank holds, run on it (as source: the engines cannot import this test module)
WARM_RANK_FACTS = """
import os, sys
_fds = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{fd}")]
_runtime = sys.modules.get("hvd_notebook.runtime")
facts = {"pid": os.getpid(), "tensorflow": "tensorflow" in sys.modules, "keras": "keras" in sys.modules,
         "initialized": _runtime is not None and _runtime.is_initialized(),
         # a NCCL communicator needs CuPy's NCCL binding and libnccl in the process
         "nccl": "cupy" in sys.modules or "libnccl" in open("/proc/self/maps").read(),
         "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
         "lease_files": [fd for fd in _fds if fd.startswith(os.environ["HVD_NOTEBOOK_LEASE_DIR"])]}
"""


def _on_ranks(cluster: MPICluster, code: str, name: str) -> list:
    """Run ``code`` on every engine of ``cluster`` and pull ``name`` (engines cannot import this module)."""
    view = cluster.channel.ipp_client[:]
    view.execute(code, block=False).get(timeout=120)  # (a world that died fails the test, never hangs it)
    return view.pull(name, block=False).get(timeout=120)


@pytest.fixture
def gpus_and_standby(tmp_path, monkeypatch):
    """Two listed GPUs (none real: TensorFlow sees no GPU, the ranks run on CPU), a private lease folder,
    standby on."""
    monkeypatch.setenv("HVD_NOTEBOOK_GPUS", "0,1")
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(tmp_path / "leases"))
    monkeypatch.setenv("HVD_NOTEBOOK_STANDBY", "on")
    return tmp_path / "leases"


def test_the_standby_holds_nothing_and_a_restart_promotes_it(gpus_and_standby):
    cluster = MPICluster(ClusterOptions(n=2))
    pids: set[int] = set()
    try:
        cluster.start()
        pids |= cluster.pids()
        warm = wait_for_standby(cluster)
        pids |= warm
        listing = subprocess.run(CLI + ["list"], capture_output=True, text=True, timeout=60).stdout
        assert "the warm standby of its other cluster" in listing, listing

        facts = _on_ranks(cluster.standby.world, WARM_RANK_FACTS, "facts")
        assert all(f["tensorflow"] and f["keras"] for f in facts), facts  # the slow imports are done
        assert not any(f["initialized"] or f["nccl"] for f in facts), facts  # no runtime, no communicator
        assert sorted(f["cuda_visible"] for f in facts) == ["0", "1"], facts  # pinned to the cluster's GPUs
        assert all(f["lease_files"] == [] for f in facts), facts  # no lease of its own
        assert sorted(p.name for p in gpus_and_standby.iterdir()) == ["gpu0.lock", "gpu1.lock"]
        with pytest.raises(leases.LeaseError):  # the cluster's lease covers both worlds
            leases.acquire(["0", "1"], 1, "test")

        old_ranks = {r.pid for r in cluster.ranks}
        t0 = time.monotonic()
        ranks = cluster.restart()
        figure(f"restart promoting a warm standby (2 CPU ranks): {time.monotonic() - t0:.2f} s")
        assert {r.pid for r in ranks} <= {f["pid"] for f in facts}, "the new ranks are not the standby's"
        assert [r.device for r in ranks] == ["GPU 0", "GPU 1"]
        assert_gone(old_ranks)
        assert _on_ranks(cluster, "total = float(hvd.allreduce(1.0, op=hvd.Sum))", "total") == [2.0, 2.0]
        with pytest.raises(leases.LeaseError):  # the restart kept the GPUs: nobody could take them meanwhile
            leases.acquire(["0", "1"], 1, "test")
        assert cluster.standby_state == "starting"  # the next standby
        pids |= cluster.pids()
    finally:
        cluster.stop()  # also while the next standby is still starting
    assert_gone(pids)
    assert leases.acquire(["0", "1"], 2, "test").gpus == ["0", "1"]


def test_a_broken_standby_is_dropped_and_the_restart_starts_cold(monkeypatch):
    monkeypatch.setenv("HVD_NOTEBOOK_STANDBY", "on")
    cluster = MPICluster(ClusterOptions(n=2))
    pids: set[int] = set()
    try:
        cluster.start()
        warm = wait_for_standby(cluster)
        pids |= cluster.pids()
        engines = _on_ranks(cluster.standby.world, "import os; pid = os.getpid()", "pid")
        os.kill(engines[1], signal.SIGKILL)  # an idle standby rank the out-of-memory killer picked
        ranks = cluster.restart()
        assert not {r.pid for r in ranks} & warm
        assert_gone(warm)  # nothing of the broken standby is left
        assert _on_ranks(cluster, "size = hvd.size()", "size") == [2, 2]
        pids |= cluster.pids()
    finally:
        cluster.stop()
    assert_gone(pids)


BLOCKED = ("%%hvd --no-progress\nimport time\nfrom mpi4py import MPI\nif hvd.rank() == 0:\n"
           "    MPI.COMM_WORLD.barrier()  # rank 1 never joins; MPI's own barrier takes no interrupt\n"
           "else:\n    time.sleep(600)")


def test_status_shows_the_standby_and_an_interrupt_promotes_it(ip, run):
    from hvd_notebook.kernel.session import Session

    session = Session.get()
    result, out = run("%hvd start -n 2 --standby on")
    assert result.success, out
    try:
        _, out = run("%hvd status")
        assert "standby: starting 2 rank(s)" in out or "standby: ready" in out, out
        warm = wait_for_standby(session.cluster)
        _, out = run("%hvd status")
        assert "standby: ready: 2 rank(s) with the framework imported" in out, out
        run("%%hvd\nkept = 'lost with the world'")
        threading.Timer(1.5, _thread.interrupt_main).start()  # as the notebook's stop button does
        t0 = time.monotonic() + 1.5
        result, out = run(BLOCKED)
        assert not result.success and "restarted" in out.lower(), out
        result, out = run("%%hvd\nprint('kept' in globals(), hvd.allreduce(1.0, op=hvd.Sum))")
        figure(f"interrupt of a blocked collective with a warm standby: cells run again after "
               f"{time.monotonic() - t0:.1f} s")
        assert "False 2.0" in out, out
        assert {r.pid for r in session.cluster.ranks} <= warm
        pids = session.cluster.pids()
    finally:
        run("%hvd stop")
    assert_gone(pids)
