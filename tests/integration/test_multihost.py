"""Ranks on several hosts: two network namespaces on this machine, each a host
with its own address, hostname and IPC, joined by veth pairs on a private
subnet (tests/netns/setup.sh). MPICH's hydra reaches them through
tests/netns/nsexec, an ssh look-alike that enters the namespace, exactly as it
would reach real hosts through ssh. MPI between the hosts goes over TCP on the
veths (checked with their byte counters)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ProcessWatch, assert_gone, figure

from hvd_notebook.cluster.launching import diagnosis
from hvd_notebook.cluster.launching import hosts as hostlib
from hvd_notebook.kernel.session import Session

NETNS = Path(__file__).resolve().parent / "netns"
HOSTS = ("10.231.0.11", "10.231.0.12")
VIA_NETNS = f'--mpi-args "-launcher ssh -launcher-exec {NETNS / "nsexec"} -iface hvdbr0" --env UCX_TLS=tcp,self'


def _can_make_namespaces() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    probe = f"hvdprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create network namespaces here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture(scope="module")
def two_hosts():
    reason = _can_make_namespaces()
    if reason:
        pytest.skip(reason)
    t0 = time.monotonic()
    subprocess.run([NETNS / "setup.sh", "2"], check=True, capture_output=True)
    figure(f"multihost: 2 namespace hosts set up in {time.monotonic() - t0:.2f} s")
    try:
        yield HOSTS
    finally:
        subprocess.run([NETNS / "teardown.sh"], capture_output=True)
        assert "hvdh" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _ns_pids() -> list[str]:
    out = []
    for ns in ("hvdh1", "hvdh2"):
        out += subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
    return out


def _veth_bytes(ns: str) -> int:
    stats = json.loads(subprocess.run(["ip", "-j", "-s", "-n", ns, "link", "show", "eth0"], capture_output=True,
                                      text=True, check=True).stdout)[0]["stats64"]
    return stats["rx"]["bytes"] + stats["tx"]["bytes"]


def test_two_hosts_train_together(two_hosts, ip, run):
    t0 = time.monotonic()
    result, out = run(f"%hvd start -H {two_hosts[0]}:1,{two_hosts[1]}:1 {VIA_NETNS}")
    assert result.error_in_exec is None, out
    figure(f"multihost: %hvd start on 2 hosts x 1 rank in {time.monotonic() - t0:.1f} s")
    cluster = Session.get().cluster
    try:
        assert [r.host for r in cluster.ranks] == ["hvdh1", "hvdh2"], out
        assert [r.ip for r in cluster.ranks] == list(two_hosts), out
        assert "address" in out and two_hosts[0] in out and two_hosts[1] in out
        assert [(r.local_rank, r.local_size) for r in cluster.ranks] == [(0, 1), (0, 1)]
        # the controller listens where the hosts reach it, with CurveZMQ
        assert cluster.world.ipp_cluster.controller_ip == "10.231.0.1"
        assert "--IPController.enable_curve=True" in cluster.world.ipp_cluster.controller_args

        before = _veth_bytes("hvdh1")
        result, out = run(
            "%%hvd --all-output\n"
            "import numpy as np, socket\n"
            "total = hvd.allreduce(np.full(1 << 18, hvd.rank() + 1.0, dtype=np.float32), op=hvd.Sum)\n"
            "print('host', socket.gethostname(), 'cross', hvd.cross_rank(), hvd.cross_size(), 'sum', total[:2])\n"
        )
        assert result.error_in_exec is None, out
        assert "host hvdh1 cross 0 2 sum [3. 3.]" in out and "host hvdh2 cross 1 2 sum [3. 3.]" in out, out
        crossed = _veth_bytes("hvdh1") - before
        assert crossed > 1 << 20, f"only {crossed} bytes crossed hvdh1's link for a 1 MiB allreduce"

        result, out = run(
            "%%hvd --no-progress\n"
            "import keras, numpy as np\n"
            "rng = np.random.default_rng(hvd.rank())\n"
            "x = rng.normal(size=(256, 8)).astype('float32'); y = (x.sum(1) > 0).astype('int32')\n"
            "model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, activation='softmax')])\n"
            "model.compile(hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), "
            "'sparse_categorical_crossentropy', jit_compile=False)\n"
            "model.fit(x, y, batch_size=32, epochs=2, verbose=0,\n"
            "          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])\n"
            "w = model.get_weights()[0]\n"
            "same = hvd.allgather_object(float(abs(w).sum()))\n"
            "print('weights equal on both hosts:', same[0] == same[1])\n"
        )
        assert result.error_in_exec is None, out
        assert "weights equal on both hosts: True" in out, out
        pids = cluster.pids()

        # a rank on the other host dies: its engine is unregistered and the cell fails, naming it
        t0 = time.monotonic()
        result, out = run("%%hvd\nimport os\nif hvd.rank() == 1:\n    os._exit(7)\nhvd.barrier()\n")
        assert result.error_in_exec is not None and "rank(s) [1] died" in out, out
        figure(f"multihost: a rank on another host died; the cell failed in {time.monotonic() - t0:.1f} s")
    finally:
        run("%hvd stop")
    assert_gone(pids)
    assert _ns_pids() == []


def test_an_unreachable_host_is_named_and_nothing_is_left(two_hosts, ip, run):
    subprocess.run(["ip", "link", "set", "vhvdh2", "down"], check=True)
    try:
        with ProcessWatch() as watch:
            t0 = time.monotonic()
            result, out = run(f"%hvd start -H {two_hosts[0]}:1,{two_hosts[1]}:1 {VIA_NETNS}")
            took = time.monotonic() - t0
    finally:
        subprocess.run(["ip", "link", "set", "vhvdh2", "up"], check=True)
    assert result.error_in_exec is not None
    assert f"host {two_hosts[1]} is unreachable" in out, out
    figure(f"multihost: unreachable host reported in {took:.1f} s")
    assert Session.get().cluster is None
    if watch.seen:
        assert_gone(watch.seen)
    assert _ns_pids() == []


def test_min_np_resumes_an_elastic_cell_on_the_hosts_that_still_answer(two_hosts, ip, run, tmp_path):
    """Rank 1's host goes off the network as rank 1 dies (the rank itself takes the host's link down):
    the resume's new world cannot start on both hosts, so with --min-np 1 it starts on the one that
    answers and the cell completes there."""
    from test_lifecycle import ELASTIC_CELL

    off_the_network = (f"import subprocess; subprocess.run(['nsenter', '--net=/proc/{os.getpid()}/ns/net', 'ip', "
                       "'link', 'set', 'vhvdh2', 'down'], check=True); os._exit(7)")  # (this process's netns)
    result, out = run(f"%hvd start -H {two_hosts[0]}:1,{two_hosts[1]}:1 --min-np 1 {VIA_NETNS}")
    assert result.error_in_exec is None, out
    session = Session.get()
    pids = session.cluster.pids()
    try:
        run("%%hvd\nbase = 1.0")
        t0 = time.monotonic()
        result, out = run(ELASTIC_CELL.format(mark=str(tmp_path / "died"), death=off_the_network))
        figure(f"multihost: --min-np 1 resume on the host that answers: the cell completed after "
               f"{time.monotonic() - t0:.1f} s")
        assert result.error_in_exec is None, out
        assert f"host {two_hosts[1]}" in out and "the new world has 1 rank(s) instead of 2 (--min-np 1)" in out, out
        assert "[0] result [12.0, 12.0, 12.0] step 8" in out, out  # steps 1-4 summed over 2 ranks, 5-8 over 1
        assert [r.host for r in session.cluster.ranks] == ["hvdh1"]
        pids |= session.cluster.pids()
    finally:
        subprocess.run(["ip", "link", "set", "vhvdh2", "up"], check=True)
        run("%hvd stop")
    assert_gone(pids)
    assert _ns_pids() == []


def test_a_host_without_the_environment_is_named(two_hosts, ip, run, monkeypatch):
    # on hvdh2 this environment's folder is empty, as on a host where it was never installed
    venv = Path(sys.executable).parent.parent
    monkeypatch.setenv("NSEXEC_MISSING", f"hvdh2:{venv}")
    with ProcessWatch() as watch:
        result, out = run(f"%hvd start -H {two_hosts[0]}:1,{two_hosts[1]}:1 {VIA_NETNS}")
    assert result.error_in_exec is not None
    assert f"host {two_hosts[1]} cannot start a rank of this environment" in out, out
    assert "No such file or directory" in out and f"host {two_hosts[0]} cannot" not in out, out
    assert Session.get().cluster is None
    if watch.seen:
        assert_gone(watch.seen)
    assert _ns_pids() == []


def test_too_few_slots_and_bad_host_lists_are_errors(ip, run):
    for line, expected in [
        ("%hvd start -n 3 -H a:1,b:1", "-n 3 ranks but the hosts have only 2 slot(s) (a:1,b:1)"),
        ("%hvd start -H a:x", "'a:x' is not HOST or HOST:SLOTS"),
        ("%hvd start -H a:1 --hostfile /nonexistent", "give the hosts with -H or with --hostfile, not both"),
        ("%hvd start -H no-such-host.invalid:1", "host 'no-such-host.invalid': the name does not resolve"),
        ("%hvd start --launcher srun", "--launcher srun needs a Slurm allocation"),
    ]:
        result, out = run(line)
        assert result.error_in_exec is not None and expected in out, (line, out)
        assert Session.get().cluster is None


def test_hostfiles_in_both_dialects(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# MPICH and Open MPI forms\nnode1:2\nnode2 slots=3\nnode1\n")
    assert hostlib.read_hostfile(str(f)) == [hostlib.Host("node1", 3), hostlib.Host("node2", 3)]
    assert hostlib.check_slots(hostlib.read_hostfile(str(f)), None) == 6
    f.write_text("node1 slots=two\n")
    with pytest.raises(hostlib.HostError, match="line 1"):
        hostlib.read_hostfile(str(f))


def test_launch_failures_name_the_host():
    # what hydra printed in this machine's namespaces (see tests/netns) for each fault
    seen = {
        "ssh: connect to host 10.231.0.12 port 22: No route to host\n[mpiexec@vm] Launch proxy failed.":
            "host 10.231.0.12 is unreachable (No route to host)",
        '[proxy:1@hvdh2] HYDU_sock_connect (lib/utils/sock.c:140): unable to connect from "hvdh2" to '
        '"10.231.0.1" (No route to host)': "host hvdh2 cannot reach the launcher on this machine at 10.231.0.1",
        "[proxy:1@hvdh2] HYDU_create_process (lib/utils/launch.c:73): execvp error on file "
        "/nonexistent/venv/bin/python (No such file or directory)":
            "host hvdh2 cannot run /nonexistent/venv/bin/python (No such file or directory): every host needs "
            "the same Python environment at the same path",
    }
    for output, sentence in seen.items():
        assert any(d.startswith(sentence) for d in diagnosis.diagnose_launch(output)), (output, sentence)
