"""A shared node: orphaned clusters and `hvd-notebook clean`, GPU leases between
notebooks, isolation of two kernels' clusters, and who can reach them.

Each "kernel" here is a separate Python process holding a Session, as a notebook
kernel does; every test proves by PID that what it started is gone."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import CLI, Kernel, assert_gone, figure, holds_for


def test_clean_stops_orphaned_clusters_and_leaves_live_ones(tmp_path):
    orphan, live = Kernel(), Kernel()
    try:
        orphan.wait_ready(), live.wait_ready()
        assert orphan.workdir and live.workdir, f"a kernel did not start its cluster: {orphan.error}{live.error}"
        assert orphan.workdir.stat().st_mode & 0o777 == 0o700
        # the kernel dies so hard that neither its atexit nor its watchdog runs
        reapers = [p for p in psutil.process_iter(["cmdline"])
                   if "hvd_notebook.cluster.processes.reaper" in " ".join(p.info["cmdline"] or []) and
                   str(orphan.workdir) in " ".join(p.info["cmdline"] or [])]
        assert reapers, "the cluster has no watchdog"
        for p in reapers + [psutil.Process(orphan.proc.pid)]:
            p.kill()
        orphan.proc.wait(10)
        survivors = {pid for pid in orphan.pids if psutil.pid_exists(pid)} - {orphan.proc.pid}
        assert survivors, "nothing of the cluster outlived its kernel: the test proves nothing"

        listed = subprocess.run(CLI + ["list"], capture_output=True, text=True, timeout=60)
        assert f"{orphan.workdir.name}: kernel {orphan.proc.pid} (gone)" in listed.stdout, listed.stdout
        assert f"{live.workdir.name}: kernel {live.proc.pid} (running)" in listed.stdout, listed.stdout
        dry = subprocess.run(CLI + ["clean", "--dry-run"], capture_output=True, text=True, timeout=60)
        assert f"would stop {orphan.workdir.name}" in dry.stdout and orphan.workdir.exists()

        t0 = time.monotonic()
        cleaned = subprocess.run(CLI + ["clean"], capture_output=True, text=True, timeout=60)
        assert cleaned.returncode == 0, cleaned.stderr
        assert f"stopped {orphan.workdir.name} (kernel {orphan.proc.pid} is gone)" in cleaned.stdout
        assert f"left alone: {live.workdir.name}" in cleaned.stdout
        assert_gone(survivors, timeout=10)
        assert time.monotonic() - t0 < 15 and not orphan.workdir.exists()
        figure(f"hvd-notebook clean: orphaned cluster gone {time.monotonic() - t0:.1f} s after the command started")
        assert all(psutil.pid_exists(pid) for pid in live.pids - {live.proc.pid}), "clean touched a live cluster"
        again = subprocess.run(CLI + ["clean"], capture_output=True, text=True, timeout=60)
        # (the count of clusters left alone includes those of tests that run beside this one: make test's -n 2)
        assert again.returncode == 0 and f"stopped {live.workdir.name}" not in again.stdout, again.stdout
        assert all(psutil.pid_exists(pid) for pid in live.pids - {live.proc.pid}), "clean touched a live cluster"
    finally:
        for kernel in (orphan, live):
            kernel.close()
    assert_gone(live.pids | orphan.pids, timeout=20)


def test_gpus_are_leased_between_notebooks(tmp_path):
    """Three GPUs (listed, as on a node that restricts them): a second notebook
    gets the free ones or an error naming the holder; leases end with the cluster
    or with the kernel, however it dies."""
    from hvd_notebook.cluster.node import leases

    env = {"HVD_NOTEBOOK_GPUS": "0,1,2", "HVD_NOTEBOOK_LEASE_DIR": str(tmp_path / "leases")}
    a = Kernel("auto", n=2, env=env).wait_ready()
    kernels = [a]
    try:
        assert a.devices == ["GPU0", "GPU1"], a.error
        b = Kernel("auto", n=2, env=env, wait=False).wait_ready()  # --no-wait: the error, not the queue
        kernels.append(b)
        assert b.workdir is None and b.proc.returncode != 0
        assert "-n 2 needs 2 GPU(s), but only 1 of this host's 3 (2) are free" in b.error, b.error
        assert "GPU 0 by " in b.error and "GPU 1 by " in b.error
        assert f"kernel {a.proc.pid}" in b.error and "-n 1" in b.error
        c = Kernel("auto", n=None, env=env).wait_ready()  # a rank per free GPU
        kernels.append(c)
        assert c.devices == ["GPU2"], c.error

        a.close()  # the cluster stops with its kernel: GPUs 0 and 1 are free again
        d = Kernel("auto", n=2, env=env).wait_ready()
        kernels.append(d)
        assert d.devices == ["GPU0", "GPU1"], d.error

        os.kill(c.proc.pid, signal.SIGKILL)  # no clean-up code runs; the lease goes with the process
        c.proc.wait(10)
        os.environ["HVD_NOTEBOOK_LEASE_DIR"] = env["HVD_NOTEBOOK_LEASE_DIR"]
        try:
            lease = leases.acquire(["0", "1", "2"], None, "test")
            assert lease.gpus == ["2"]
            lease.release()
        finally:
            del os.environ["HVD_NOTEBOOK_LEASE_DIR"]
    finally:
        for kernel in kernels:
            kernel.close()
    assert_gone(set().union(*(k.pids for k in kernels)) - {c.proc.pid}, timeout=30)


def _listeners(pids: set[int]) -> dict[tuple[str, int], set[int]]:
    found: dict[tuple[str, int], set[int]] = {}
    for pid in pids:
        try:
            for conn in psutil.Process(pid).net_connections("inet"):
                if conn.status == psutil.CONN_LISTEN:
                    found.setdefault((conn.laddr.ip, conn.laddr.port), set()).add(pid)
        except psutil.Error:
            pass
    return found


def _forged_client(cluster, tmp_path, **changes):
    """A client built from the cluster's connection file with some fields changed
    (what a process without the real file could at best put together)."""
    import ipyparallel as ipp

    (client_file,) = (cluster.workdir / "profile" / "security").glob("ipcontroller-*-client.json")
    info = json.loads(client_file.read_text())
    info.update(changes)
    forged = tmp_path / "forged-client.json"
    forged.write_text(json.dumps(info))
    return ipp.Client(connection_info=str(forged), timeout=5)


def _eavesdrop(info: dict, channels: tuple[str, ...] = ("iopub", "notification")) -> tuple[Any, list, list]:
    """ZMQ SUB sockets subscribed to everything on the controller's ``channels`` (its PUB sockets on
    loopback), as any local user can connect them without the connection file's keys; and a monitor of
    each one's handshakes (``_handshakes``), made before it connects, so that none is missed."""
    import zmq

    context = zmq.Context()
    subs, monitors = [], []
    events = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
              | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
    for channel in channels:
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitors.append(sub.get_monitor_socket(events))
        sub.connect(f"{info['interface']}:{info[channel]}")
        subs.append(sub)
    return context, subs, monitors


def _heard(subs: list, seconds: float) -> list[bytes]:
    import zmq

    poller = zmq.Poller()
    for sub in subs:
        poller.register(sub, zmq.POLLIN)
    frames: list[bytes] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        for sub, _ in poller.poll(left * 1000):
            frames += sub.recv_multipart()
    return frames


def _handshakes(monitors: list, seconds: float = 20.0) -> list[str]:
    """How each SUB socket's first handshake with the publisher ended ("succeeded", or "failed" where the
    publisher wants keys it lacks), waited for on the sockets' ``monitors``: proof that the eavesdropper
    reached the ports. "none" for a socket that got no answer within ``seconds``."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    outcomes = []
    for monitor in monitors:
        outcome, deadline = "none", time.monotonic() + seconds
        while outcome == "none" and monitor.poll(max(0.0, deadline - time.monotonic()) * 1000):
            event = recv_monitor_message(monitor)["event"]
            outcome = "succeeded" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "failed"
        outcomes.append(outcome)
    return outcomes


def _overheard(cluster: Any) -> tuple[list[str], bool]:
    """An eavesdropper on ``cluster``'s IOPub and notification ports, without the connection file's
    keys, while a cell prints a secret on every rank: how its handshakes ended, and whether it heard it."""
    (client_file,) = (cluster.workdir / "profile" / "security").glob("ipcontroller-*-client.json")
    context, subs, monitors = _eavesdrop(json.loads(client_file.read_text()))
    try:
        handshakes = _handshakes(monitors)
        secret = f"secret-{os.getpid()}-{time.time_ns()}"
        # said five times over a second: a subscription that reached the publisher hears it (a control
        # cluster shows that it does)
        ar = cluster.channel.ipp_client[:].execute(f"import time\nfor _ in range(5):\n    print({secret!r}, "
                                                   "flush=True)\n    time.sleep(0.2)", block=False)
        ar.get(timeout=60)
        ar.wait_for_output(timeout=10)  # (a rank's output may come after its reply)
        assert all(secret in out for out in ar.stdout), ar.stdout  # the owner's client heard it: it was said
        heard = _heard(subs, 1.0)
    finally:
        context.destroy(linger=0)
    return handshakes, any(secret.encode() in frame for frame in heard)


def test_an_eavesdropper_hears_a_cluster_without_encryption(monkeypatch):
    """The control of the next test's eavesdropper: on the same set-up with CurveZMQ left out (as the
    benchmark's baseline does), the same listener hears a cell's output; so its silence there means
    something."""
    from hvd_notebook.cluster import ClusterOptions
    from hvd_notebook.cluster.launching import launch
    from hvd_notebook.cluster.launching.cluster import MPICluster

    monkeypatch.setattr(launch, "CONTROLLER_ARGS", [])
    cluster = MPICluster(ClusterOptions(n=2, gpus="none"))
    cluster.start()
    pids = cluster.pids()
    try:
        handshakes, heard = _overheard(cluster)
    finally:
        cluster.stop()
    assert handshakes == ["succeeded", "succeeded"] and heard, (handshakes, heard)
    assert_gone(pids)


def test_only_loopback_private_files_and_encrypted_messages(tmp_path):
    from hvd_notebook.cluster import ClusterOptions
    from hvd_notebook.cluster.launching.cluster import MPICluster

    cluster = MPICluster(ClusterOptions(n=2, gpus="none"))
    cluster.start()
    pids = cluster.pids()
    try:
        listening = _listeners(pids)
        assert listening, "no listening socket found: the check proves nothing"
        beyond = {addr: who for addr, who in listening.items() if addr[0] not in ("127.0.0.1", "::1")}
        assert beyond == {}, f"listening beyond loopback: {beyond}"
        assert cluster.workdir.stat().st_mode & 0o777 == 0o700
        files = [p for p in (cluster.workdir / "profile").rglob("*") if p.is_file()]
        assert any(p.name.endswith("-client.json") for p in files)
        assert {oct(p.stat().st_mode & 0o777) for p in files} == {"0o600"}, files
        (client_file,) = (cluster.workdir / "profile" / "security").glob("ipcontroller-*-client.json")
        info = json.loads(client_file.read_text())
        assert info.get("curve_serverkey"), "no CurveZMQ server key: a default cluster is not encrypted"

        # a local user without the connection file's keys reaches the ports, is refused at the handshake,
        # and hears nothing of a cell (the test before this one hears it where nothing is encrypted)
        handshakes, heard = _overheard(cluster)
        assert handshakes == ["failed", "failed"] and not heard, (handshakes, heard)

        # the right keys run code; without the server's key, or with another, nothing is answered or run
        marker = tmp_path / "ran"
        assert sorted(cluster.channel.ipp_client[:].apply_sync(os.getpid)) == sorted(r.pid for r in cluster.ranks)
        honest = _forged_client(cluster, tmp_path)  # the same file unchanged connects: the check can fail
        assert sorted(honest.ids) == sorted(cluster.channel.engine_ids())
        honest.close()
        import zmq

        for changes in ({"curve_serverkey": None}, {"curve_serverkey": zmq.curve_keypair()[0].decode()}):
            with pytest.raises(TimeoutError):
                client = _forged_client(cluster, tmp_path, **changes)
                client[:].apply_sync(open, str(marker), "w")
        assert holds_for(lambda: not marker.exists(), 1.0)  # (nothing ran: no file appears)
    finally:
        cluster.stop()
    assert_gone(pids)


def test_two_kernels_clusters_are_isolated_from_each_other_and_from_other_users(tmp_path):
    cell = ("import numpy as np, time, os\n"
            "for i in range(20):\n"
            "    total = hvd.allreduce(np.array([hvd.rank() + 1.0]), op=hvd.Sum)\n"
            "    time.sleep(0.05)\n"
            "print('SUM', total, os.environ.get('IPP_CLUSTER_ID', ''), flush=True)")
    a, b = Kernel(n=2, cell=cell), Kernel(n=2, cell=cell)  # both start and train at the same time
    try:
        a.wait_ready(), b.wait_ready()
        assert a.pids and b.pids, f"a kernel did not start its cluster: {a.error[-3000:]}{b.error[-3000:]}"
        outs = []
        for k in (a, b):
            lines = []
            while "CELL-DONE" not in (line := k.proc.stdout.readline()):
                assert line, k.proc.stderr.read()
                lines.append(line)
            outs.append("".join(lines))
        assert all("[0] SUM [3.]" in out for out in outs), outs  # each world has exactly its own 2 ranks
        assert a.workdir != b.workdir and not (a.pids & b.pids)

        def ports(kernel):
            (f,) = (kernel.workdir / "profile" / "security").glob("ipcontroller-*-client.json")
            info = json.loads(f.read_text())
            return {v for k, v in info.items() if isinstance(v, int) and k not in ("pack", "unpack")}

        assert ports(a) and not (ports(a) & ports(b))

        if os.geteuid() == 0:  # another user on the same host: no way in to the key or the directory
            probe = ("import sys, pathlib\n"
                     "d = pathlib.Path(sys.argv[1])\n"
                     "for action in (lambda: list(d.iterdir()), lambda: (d / 'owner').read_text()):\n"
                     "    try:\n        action(); print('READABLE')\n"
                     "    except PermissionError:\n        print('DENIED')\n")
            other = subprocess.run(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups",
                                    "/usr/bin/python3", "-c", probe, str(a.workdir)],
                                   capture_output=True, text=True, timeout=30)
            assert other.stdout.split() == ["DENIED", "DENIED"], other.stdout + other.stderr
    finally:
        a.close(), b.close()
    assert_gone(a.pids | b.pids, timeout=20)


def test_engines_exit_by_themselves_when_kernel_watchdog_and_controller_are_all_killed():
    """The worst case: nothing that could stop the cluster is left. Idle engines
    notice the lost controller (missed heartbeats) and exit within 30 s."""
    kernel = Kernel(n=2).wait_ready()
    try:
        assert kernel.pids, f"the kernel did not start its cluster: {kernel.error[-3000:]}"
        procs = {pid: psutil.Process(pid) for pid in kernel.pids if psutil.pid_exists(pid)}
        engines = {pid for pid, p in procs.items() if p.cmdline()[1:3] == ["-m", "ipyparallel.engine"]}
        assert len(engines) == 2, {pid: p.cmdline() for pid, p in procs.items()}
        for pid, p in procs.items():
            cmd = " ".join(p.cmdline())
            if (pid == kernel.proc.pid or "hvd_notebook.cluster.processes.reaper" in cmd
                    or "ipyparallel.controller" in cmd):
                p.kill()
        t0 = time.monotonic()
        assert_gone(engines, timeout=30)
        figure(f"engines exited {time.monotonic() - t0:.1f} s after their controller was killed")
    finally:
        kernel.close()
        for pid in kernel.pids:  # whatever else is left (the launcher)
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
    assert_gone(kernel.pids, timeout=10)


def test_a_running_worlds_shared_memory_is_kept_and_a_stopped_ones_removed(session, run):
    """The ranks' MPICH segments in /dev/shm: mapped while the world runs (removal leaves them, and the
    ranks go on talking through them); left by the killed ranks after a stop, then removed."""
    from hvd_notebook.cluster.node import shm

    # (--secure, accepted for compatibility, asks for nothing more: every cluster is encrypted, which
    # test_only_loopback_private_files_and_encrypted_messages proves of a cluster started without it)
    result, out = run("%hvd start -n 2 --secure")
    assert result.success, out
    (client_file,) = (session.cluster.workdir / "profile" / "security").glob("ipcontroller-*-client.json")
    assert json.loads(client_file.read_text()).get("curve_serverkey"), "no CurveZMQ server key: encryption is off"
    # (this world's segments are those its ranks map: a test beside this one may be starting a world of its own)
    world = {Path(path) for rank in session.cluster.ranks for _, path, _ in shm._maps_in(rank.pid)
             if Path(path).name.startswith(shm.PREFIX)}
    assert world, "the ranks made no segment in /dev/shm (is MPICH's shared-memory transport in use?)"
    assert not set(shm.remove_orphaned(min_age=0)) & world  # mapped by the live ranks
    result, out = run("%%hvd\nimport numpy as np\nprint('sum', int(hvd.allreduce(np.ones(1000), op=hvd.Sum)[0]))")
    assert result.success and "sum 2" in out, out
    run("%hvd stop")
    deadline = time.monotonic() + 15  # (a killed rank maps them until it has exited: slower beside another test)
    while any(p.exists() for p in world) and time.monotonic() < deadline:
        shm.remove_orphaned(min_age=0)  # (or a test beside this one removed them first: make test's -n 2)
        time.sleep(0.2)
    left = [p for p in world if p.exists()]
    assert not left, f"still in /dev/shm 15 s after the stop: {left}, mapped by {shm._mapped(set(map(str, left)))}"
