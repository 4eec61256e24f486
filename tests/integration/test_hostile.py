"""Hostile neighbours: a victim and an attacker, two real Unix users made for the test, and every attack of
issue 27 mounted AS THE ATTACKER (``runuser -u hvdt-mallory``, a clean environment) against the victim's real
cluster (real mpiexec, real ipyparallel engines), the node's register, the GPU leases and root's
``hvd-notebook clean``. Each test shows that the attack fails AND that the victim's work goes on (a cell, with
an MPI allreduce, still runs on the victim's cluster afterwards, or the victim's lease still works). The tests
collect every way an attack worked before failing, so that one failure says all that went wrong.

The victim's cluster is one ``MPICluster(ClusterOptions(n=2))`` per module, started by a small driver run as
the victim (``DRIVER``) with their home and ``TMPDIR=/tmp``, so that the attacks on ``/tmp`` apply; the
attacker's moves are the subcommands of ``TOOL``, run as them. ``HVD_HOSTILE_SOURCE=/path/to/old/tree`` runs
the users' and root's commands on another copy of the package (``PYTHONPATH`` comes before the editable
install): the way to show which attacks work on older code. Needs root (useradd, runuser, the sysctls)."""

from __future__ import annotations

import json
import os
import pwd
import queue
import secrets
import shutil
import stat
import subprocess
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import assert_gone, holds_for, let_others_traverse, put_modes_back

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv" / "bin" / "python"
MPIEXEC = ROOT / ".venv" / "bin" / "mpiexec"
SOURCE = Path(os.environ.get("HVD_HOSTILE_SOURCE") or ROOT)  # the package the users' and root's commands run
VICTIM, MALLORY = "hvdt-victim", "hvdt-mallory"
FRAMEWORK = "torch"  # imports less than TensorFlow on the victim's ranks
START_TIMEOUT = 90  # seconds: the victim's start either works or fails within it
QUICK = 10.0  # seconds: "at once" for a refusal, a register reader, a clean
SYSCTLS = ("/proc/sys/fs/protected_regular", "/proc/sys/fs/protected_symlinks")
HARDENED = (2, 1)  # their highest values (protected_symlinks has no 2); systemd hosts have (1 or 2, 1)
ALLREDUCE = "from mpi4py import MPI\nprint('allreduce', MPI.COMM_WORLD.allreduce(hvd.rank() + 1))"

pytestmark = [
    pytest.mark.alone,  # (its attacks would hit the worlds of tests running beside it: make test runs it after them)
    pytest.mark.skipif(os.geteuid() != 0, reason="creates Unix users (useradd) and acts as them (runuser): needs "
                       "root; the suite's root run covers it"),
    pytest.mark.skipif(not all(map(shutil.which, ("useradd", "runuser", "pkill", "pgrep"))),
                       reason="useradd, runuser, pkill or pgrep is missing"),
]

# The attacker's (and the victim's) moves, one subcommand each: `python tool.py COMMAND ARGS...`; the answer is
# one JSON line starting with "@@".
TOOL = r'''
import json, os, socket, sys, time


def out(**answer):
    print("@@" + json.dumps(answer), flush=True)


def started(pid):
    import psutil
    return psutil.Process(pid).create_time()  # (from /proc/PID/stat: readable by anyone)


def dead_pid():
    import psutil
    pid = int(open("/proc/sys/kernel/pid_max").read()) - 1
    while psutil.pid_exists(pid):
        pid -= 1
    return pid


def next_pids(count):
    """The pids the system gives next (it counts up from ns_last_pid, wrapping to 300)."""
    last = int(open("/proc/sys/kernel/ns_last_pid").read())
    top = int(open("/proc/sys/kernel/pid_max").read())
    return [p if p < top else 300 + p - top for p in range(last + 1, last + 1 + count)]


def age(path):
    """atime well before mtime: with relatime, any later read of the file shows in its atime."""
    st = os.stat(path, follow_symlinks=False)
    os.utime(path, (st.st_mtime - 1000, st.st_mtime), follow_symlinks=False)


def put(path, data, mode=0o666):
    with open(path, "wb") as f:
        f.write(data)
    os.chmod(path, mode)


def cmd_put(path, text, mode):
    put(path, text.encode(), int(mode, 8))
    out(ok=True)


def cmd_plant_folder(folder, mode, victim_pid, marker):
    """The victim's per-user folder made first, holding what the victim's code would act on: an orphaned
    cluster whose pids name the victim's process, a stack file naming it, a pickled commit that makes
    `marker` when unpickled, claims of the rank watchers of the victim's next jobs."""
    mode, pid = int(mode, 8), int(victim_pid)
    os.mkdir(folder)
    os.chmod(folder, mode)
    files = {"hvd-1-1/owner": f"{dead_pid()} {time.time() - 100}".encode(),
             "hvd-1-1/pids": f"{pid} {started(pid)}\n".encode(),
             f"stacks/{pid}.who": f"rank 0 of 2\n{started(pid)}".encode(),
             f"stacks/{pid}.txt": b"",
             "elastic-1-x/commit.pkl": poisoned_commit(marker),
             "elastic-1-x/commit.txt": b"x=1, committed at 10:00:00"}
    for rel, data in files.items():
        path = os.path.join(folder, rel)
        if not os.path.isdir(os.path.dirname(path)):
            os.mkdir(os.path.dirname(path))
            os.chmod(os.path.dirname(path), mode)
        put(path, data)
    watched = [os.path.join(folder, rel) for rel in files]
    for path in watched:
        age(path)
    out(files=watched)


def poisoned_commit(marker):
    """An hvd.elastic commit whose unpickling runs a command (touch `marker`) as whoever loads it."""
    import pickle

    class Marker:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    return pickle.dumps({"variables": [], "values": {"epoch": Marker()}, "time": time.time()})


def cmd_swap_elastic(folder, marker, seconds):
    """Wait for the victim's next hvd.elastic folder (elastic-PID-*) in `folder` (the victim's /tmp folder,
    made by the attacker: they may rename what is in it) and put one of theirs in its place, holding a
    poisoned commit; then answer where."""
    import select
    seen = set(os.listdir(folder))
    out(ready=True)
    deadline = time.monotonic() + float(seconds)
    while time.monotonic() < deadline and not select.select([sys.stdin], [], [], 0)[0]:  # (until stdin closes)
        try:
            names = os.listdir(folder)
        except OSError:
            names = []
        for name in names:
            path = os.path.join(folder, name)
            if not name.startswith("elastic-") or name in seen:
                continue
            seen.add(name)
            try:
                if os.stat(path).st_uid == os.getuid():
                    continue
                os.rename(path, path + ".taken")
                os.mkdir(path)
                os.chmod(path, 0o777)
                put(os.path.join(path, "commit.pkl"), poisoned_commit(marker))
                put(os.path.join(path, "commit.txt"), b"epoch=1, committed at 10:00:00")
            except OSError as exc:
                out(swapped=None, failed=str(exc))
                return
            out(swapped=path)
            return
        time.sleep(0.002)
    out(swapped=None)


def fnv1a(text):
    h = 0x811C9DC5
    for b in text.encode():
        h = ((h ^ b) * 0x01000193) & 0xFFFFFFFF
    return h


def cmd_plant_shm(mode, pid_count, seconds, listing):
    """MPICH's shared-memory segments of the victim's next worlds, made first: /dev/shm/mpich_shm_%x_0 (and
    mpich_vci_) of the FNV-1a of the PMI kvsname, which gforker makes "kvs_<its pid>_0" and hydra
    "kvs_<its pid>_0_<rand() seeded by time(NULL)>_<host>", for the next pids (and seconds)."""
    import ctypes
    libc = ctypes.CDLL("libc.so.6")
    now, host, mode = int(time.time()), socket.gethostname(), int(mode, 8)
    rands = []
    for t in range(now, now + int(seconds)):
        libc.srand(ctypes.c_uint(t))
        rands.append(libc.rand())
    pids = next_pids(int(pid_count))
    made = []
    for pid in pids:
        gforker = [f"/dev/shm/mpich_{kind}_%x_0" % fnv1a(f"kvs_{pid}_0") for kind in ("shm", "vci")]
        hydra = ["/dev/shm/mpich_shm_%x_0" % fnv1a(f"kvs_{pid}_0_{r}_{host}") for r in rands]
        for name in gforker + hydra:
            try:
                fd = os.open(name, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_NOFOLLOW, mode)
            except FileExistsError:
                continue
            os.fchmod(fd, mode)
            os.close(fd)
            made.append(name)
    with open(listing, "w") as f:
        f.write("\n".join(made))
    out(made=len(made), pids=[pids[0], pids[-1]], times=[now, now + int(seconds) - 1])


def cmd_remove_listed(listing):
    removed = 0
    for name in open(listing).read().split():
        try:
            os.unlink(name)
            removed += 1
        except OSError:
            pass
    out(removed=removed)


def cmd_bind_claims(count, folder):
    """The rank watchers' claim of the victim's next jobs, taken first: the abstract socket names
    "hvd_notebook-rank-ended-<host>-<rank 0 pid>", held until stdin closes, and claim files
    "rankwatch/ended-<host>-<pid>" in `folder` (the victim's /tmp folder, made by the attacker)."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    host, held = socket.gethostname(), []
    pids = next_pids(int(count))
    for pid in pids:
        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind(f"\0hvd_notebook-rank-ended-{host}-{pid}")
            held.append(s)
        except OSError:
            s.close()
    files = 0
    if os.access(folder, os.W_OK):
        os.makedirs(os.path.join(folder, "rankwatch"), exist_ok=True)
        for pid in pids:
            put(os.path.join(folder, "rankwatch", f"ended-{host}-{pid}"), b"")
            files += 1
    out(bound=len(held), files=files, pids=[pids[0], pids[-1]])
    sys.stdin.readline()


def _listening(uid):
    """(address, port) of every TCP socket of `uid` that listens (/proc/net/tcp*: readable by anyone)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or int(f[7]) != uid:
                continue
            address, port = f[1].rsplit(":", 1)
            if len(address) == 8:
                host = socket.inet_ntop(socket.AF_INET, bytes.fromhex(address)[::-1])
                host = "127.0.0.1" if host == "0.0.0.0" else host
            else:
                raw = b"".join(bytes.fromhex(address[i:i + 8])[::-1] for i in range(0, 32, 8))
                host = socket.inet_ntop(socket.AF_INET6, raw)
                host = "::1" if host == "::" else host
            found.add((host, int(port, 16)))
    return sorted(found)


def _greets_as_zmq(host, port):
    """A ZMQ server sends its ZMTP greeting (0xff, 8 bytes, 0x7f) at once; anything else is left alone
    (connected to and closed, nothing sent)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family) as s:
            s.settimeout(1.0)
            s.connect((host, port))
            got = b""
            while len(got) < 10:
                chunk = s.recv(10 - len(got))
                if not chunk:
                    break
                got += chunk
    except OSError:
        return False
    return len(got) == 10 and got[0] == 0xFF and got[9] == 0x7F


def cmd_probe_zmq(victim_uid, listen_s):
    """Every port the victim listens on; a SUB (everything subscribed) and a DEALER on each ZMQ one; once each
    SUB's handshake ended (or 10 s passed), how each ended, then all they receive in `listen_s` seconds."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message
    ports = _listening(int(victim_uid))
    endpoints = [(h, p) for h, p in ports if _greets_as_zmq(h, p)]
    ctx = zmq.Context()
    sockets, monitors = [], []
    for host, port in endpoints:
        url = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        for kind in (zmq.SUB, zmq.DEALER):
            s = ctx.socket(kind)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IPV6, 1)
            if kind == zmq.SUB:
                s.setsockopt(zmq.SUBSCRIBE, b"")
                monitors.append(s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL))
            s.connect(url)
            sockets.append(s)
    handshakes, deadline = [], time.monotonic() + 10.0
    for monitor in monitors:  # (a subscription counts from its handshake on: then the test's cell runs)
        outcome = "none"
        if monitor.poll(max(0.0, deadline - time.monotonic()) * 1000):
            event = recv_monitor_message(monitor)["event"]
            outcome = "succeeded" if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else "failed"
        handshakes.append(outcome)
    out(ready=True, ports=ports, zmq=endpoints, handshakes=handshakes)
    poller = zmq.Poller()
    for s in sockets:
        poller.register(s, zmq.POLLIN)
    got, deadline = [], time.monotonic() + float(listen_s)
    while time.monotonic() < deadline:
        for s, _ in poller.poll(100):
            while True:
                try:
                    got.append(b"|".join(s.recv_multipart(zmq.NOBLOCK)))
                except zmq.Again:
                    break
    text = b"\n".join(got).decode("latin-1")
    out(done=True, messages=len(got), text=text[-500000:])


def cmd_lease(gpus, n):
    """Lease `n` of `gpus` (as the kernel does at %hvd start) and hold it until stdin closes."""
    t0 = time.monotonic()
    try:
        from hvd_notebook.cluster.node import leases
    except ImportError:  # (the flat cluster/ of older trees)
        from hvd_notebook.cluster import leases
    try:
        lease = leases.acquire(gpus.split(","), int(n), "the hostile test")
    except Exception as exc:
        out(refused=f"{type(exc).__name__}: {exc}", seconds=round(time.monotonic() - t0, 2))
        return
    out(held=lease.gpus, seconds=round(time.monotonic() - t0, 2))
    sys.stdin.readline()
    lease.release()


def cmd_register_folder():
    try:
        from hvd_notebook.cluster.node import registry
    except ImportError:  # (the flat cluster/ of older trees)
        from hvd_notebook.cluster import registry
    out(folder=str(registry.card_path(1).parent))


def cmd_plant_cards(folder, victim_uid, victim_pid, tag):
    """Cards to jam the register: a FIFO named like one, one with fields of the wrong type, a 100 MiB
    sparse one, and one named with the victim's uid but of the attacker's."""
    me, tag, pid = os.getuid(), int(tag), int(victim_pid)
    fifo = os.path.join(folder, f"cluster-{me}-{tag + 1}.json")
    os.mkfifo(fifo, 0o644)
    os.chmod(fifo, 0o644)
    types = os.path.join(folder, f"cluster-{me}-{tag + 2}.json")
    put(types, json.dumps({"cluster": "hvd-types", "workdir": "", "kernel": 1, "kernel_started": started(1),
                           "ranks": "two", "gpus": 5, "started": "x", "last_cell": "y", "busy": "maybe"}).encode(),
        0o644)
    huge = os.path.join(folder, f"cluster-{me}-{tag + 3}.json")
    put(huge, b'{"cluster": "hvd-huge", "workdir": "', 0o644)
    os.truncate(huge, 100 * 2**20)
    forged = os.path.join(folder, f"cluster-{victim_uid}-{pid}.json")
    now = time.time()
    put(forged, json.dumps({"cluster": "hvd-forged", "workdir": "/nonexistent/hvd-forged", "kernel": pid,
                            "kernel_started": started(pid), "ranks": 8, "gpus": ["0", "1"], "started": now,
                            "last_cell": now, "busy": False}).encode(), 0o644)
    out(fifo=fifo, types=types, huge=huge, forged=forged)


def cmd_write_card(path, workdir):
    """A card of the attacker's whose workdir names `workdir` (for root's clean --user to follow)."""
    pid = int(os.path.basename(path).split("-")[2].split(".")[0])
    put(path, json.dumps({"cluster": os.path.basename(workdir), "workdir": workdir, "kernel": pid,
                          "kernel_started": time.time() - 100, "ranks": 2, "gpus": [], "started": time.time(),
                          "last_cell": time.time(), "busy": False}).encode(), 0o644)
    out(ok=True)


def cmd_read_register():
    import logging
    logging.basicConfig(level=logging.WARNING, format="WARNING %(message)s")
    t0 = time.monotonic()
    try:
        from hvd_notebook.cluster.node import registry
    except ImportError:  # (the flat cluster/ of older trees)
        from hvd_notebook.cluster import registry
    cards = registry.read_all()
    out(cards=[{"user": c.user, "cluster": c.cluster, "path": c.path} for c in cards],
        seconds=round(time.monotonic() - t0, 2))


def cmd_dead_pid():
    out(pid=dead_pid())


if __name__ == "__main__":
    globals()["cmd_" + sys.argv[1].replace("-", "_")](*sys.argv[2:])
'''

# The victim's notebook, reduced to its cluster: commands on stdin, one JSON answer line ("@@...") each.
DRIVER = r'''
import json, logging, os, sys, time
logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
import psutil
try:
    from hvd_notebook.cluster.launching.cluster import MPICluster
except ImportError:  # (an older package, under HVD_HOSTILE_SOURCE: cluster/ flat, or one module)
    try:
        from hvd_notebook.cluster.cluster import MPICluster
    except ImportError:
        from hvd_notebook.cluster import MPICluster
from hvd_notebook.config import ClusterOptions

options = ClusterOptions(n=2, framework=sys.argv[1], start_timeout=float(sys.argv[2]))
cluster = None
if sys.argv[3:] == ["plain"]:  # (the control of the eavesdropping test: a cluster without CurveZMQ)
    import importlib
    for name in ("hvd_notebook.cluster.launching.launch", "hvd_notebook.cluster.launch"):
        try:
            importlib.import_module(name).CONTROLLER_ARGS = []
        except ImportError:
            pass


def reply(**answer):
    print("@@" + json.dumps(answer), flush=True)


def info():
    world = getattr(cluster, "world", None)
    if world is not None:
        launcher = world.launcher_pid
    else:  # (the package before cluster/world.py, under HVD_HOSTILE_SOURCE)
        launcher = getattr(getattr(cluster, "_world", None), "pid", None)
    return dict(workdir=str(cluster.workdir), pids=sorted(cluster.pids()), ranks=[r.pid for r in cluster.ranks],
                mpiexec=launcher)


def write_card():
    """The card the kernel would write (kernel.tenancy): this process's cluster, in the node's register."""
    try:
        try:
            from hvd_notebook.cluster.node import registry
        except ImportError:  # (the flat cluster/ of older trees)
            from hvd_notebook.cluster import registry
        me = psutil.Process()
        registry.write(registry.Card(cluster=cluster.workdir.name, workdir=str(cluster.workdir), kernel=me.pid,
                                     kernel_started=me.create_time(), ranks=cluster.n, gpus=[]))
        return str(registry.card_path())
    except Exception as exc:
        return f"error: {type(exc).__name__}: {exc}"


def start():
    global cluster
    cluster = MPICluster(options)
    cluster.start()
    return dict(info(), card=write_card())


def stop():
    """The cluster stopped and its card removed (as the kernel's session does)."""
    if cluster is not None:
        cluster.stop()
    try:
        try:
            from hvd_notebook.cluster.node import registry
        except ImportError:  # (the flat cluster/ of older trees)
            from hvd_notebook.cluster import registry
        registry.remove()
    except Exception:
        pass


def run(code):
    client = cluster.channel.ipp_client if hasattr(type(cluster), "channel") else cluster.client  # (older ones)
    ar = client[:].execute(code, block=False)
    ar.get(timeout=90)
    ar.wait_for_output(timeout=10)  # (a rank's output may come after its reply)
    return dict(stdout=ar.stdout)


for line in sys.stdin:
    command, _, argument = line.strip().partition(" ")
    t0 = time.monotonic()
    try:
        if command == "start":
            answer = start()
        elif command == "restart":
            cluster.restart()
            answer = info()
        elif command == "exec":
            answer = run(json.loads(argument))
        elif command == "info":
            answer = info()
        elif command == "stop":
            stop()
            answer = {}
        else:
            raise ValueError(f"no command {command!r}")
        reply(ok=True, seconds=round(time.monotonic() - t0, 2), **answer)
    except BaseException as exc:
        reply(ok=False, seconds=round(time.monotonic() - t0, 2), error=f"{type(exc).__name__}: {exc}")
stop()
'''


# ------------------------------------------------------------------ users and what they run
class User:
    """A Unix user of the test, and how to run things as them: runuser with a clean environment (their home,
    TMPDIR=/tmp, a plain PATH, the package from SOURCE)."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        entry = pwd.getpwnam(name)
        self.name, self.uid, self.gid, self.home = name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir)
        self.env = env

    def argv(self, args: list[str], **extra: str) -> list[str]:
        env = {"HOME": str(self.home), "USER": self.name, "LOGNAME": self.name, "PATH": "/usr/local/bin:/usr/bin:/bin",
               "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONPATH": str(SOURCE), "PYTHONDONTWRITEBYTECODE": "1",
               **self.env, **extra}
        return ["runuser", "-u", self.name, "--", "env", "-i", *(f"{k}={v}" for k, v in env.items()), *args]

    def run(self, args: list[str], timeout: float = 60, input: str | None = None,
            **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(args, **extra), capture_output=True, text=True, timeout=timeout, input=input,
                              cwd=self.home)

    def popen(self, args: list[str], **extra: str) -> subprocess.Popen:
        return subprocess.Popen(self.argv(args, **extra), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=self.home)

    def tool(self, *args: str, timeout: float = 60, **extra: str) -> dict:
        """A subcommand of TOOL as this user; its answer (``pytest.fail`` where it gave none)."""
        done = self.run([str(PYTHON), str(Workspace.tool), *args], timeout=timeout, **extra)
        answer = _answer(done.stdout)
        if answer is None:
            pytest.fail(f"{self.name}'s `tool {' '.join(args)}` gave no answer (exit {done.returncode}):\n"
                        f"{done.stdout[-2000:]}{done.stderr[-3000:]}")
        return answer

    def cli(self, *args: str, timeout: float = 60, **extra: str) -> subprocess.CompletedProcess:
        return self.run([str(PYTHON), "-m", "hvd_notebook.cli", *args], timeout=timeout, **extra)

    def sh(self, command: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return self.run(["sh", "-c", command], timeout=timeout)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a command run as a user and what it started (runuser's child outlives runuser)."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        children = []
    for p in [*children]:
        try:
            p.kill()
        except psutil.Error:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def _answer(stdout: str) -> dict | None:
    lines = [line for line in stdout.splitlines() if line.startswith("@@")]
    return json.loads(lines[-1][2:]) if lines else None


class Workspace:
    """Root's folder of the test (sticky and world-writable, as /tmp: the attacker may make folders in it),
    with the scripts the users run."""

    tool: Path
    driver: Path

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix="hvdt-hostile-"))
        self.path.chmod(0o1777)
        scripts = self.path / "scripts"
        scripts.mkdir(mode=0o755)
        Workspace.tool, Workspace.driver = scripts / "tool.py", scripts / "driver.py"
        self.tool.write_text(TOOL)
        self.driver.write_text(DRIVER)
        for script in (self.tool, self.driver):
            script.chmod(0o644)
        self.node = self.path / "node"  # the node's lease folder (HVD_NOTEBOOK_LEASE_DIR) of the module


def root_env(**extra: str) -> dict[str, str]:
    """Root's environment for its commands: the package from SOURCE, /tmp, the module's node folder."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "HOME": "/root", "TMPDIR": "/tmp",
            "LANG": "C.UTF-8", "PYTHONPATH": str(SOURCE), "PYTHONDONTWRITEBYTECODE": "1", "HVD_NOTEBOOK_GPUS": "",
            **extra}


def root_cli(*args: str, timeout: float = 60, **extra: str) -> tuple[subprocess.CompletedProcess, float]:
    """``hvd-notebook ARGS`` as root; with how long it took."""
    t0 = time.monotonic()
    done = subprocess.run([str(PYTHON), "-m", "hvd_notebook.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=root_env(**extra), cwd="/")  # (not the clone: sys.path[0] is the cwd)
    return done, time.monotonic() - t0


def setup_node(folder: Path, problems: list[str]) -> None:
    """The node's lease folder made by root as the admin would: ``hvd-notebook setup-node --gpus 0,1``; where
    that command is missing (older code), a sticky 1777 folder as the first lease used to make, and a problem."""
    try:
        done, _ = root_cli("setup-node", "--gpus", "0,1", HVD_NOTEBOOK_LEASE_DIR=str(folder))
    except subprocess.TimeoutExpired:
        done = None
    if done is not None and done.returncode == 0:
        return
    problems.append(f"root's `hvd-notebook setup-node --gpus 0,1` failed: "
                    f"{(done.stderr.strip().splitlines() or ['?'])[-1] if done else 'timed out'}")
    folder.mkdir(exist_ok=True)
    folder.chmod(0o1777)


def _kill_all_of(users: list[str]) -> list[str]:
    """SIGKILL every process of ``users``; what was still running after 10 s (nothing, normally)."""
    for name in users:
        subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
    deadline = time.monotonic() + 10
    while True:
        left = [subprocess.run(["pgrep", "-a", "-u", name], capture_output=True, text=True).stdout.strip()
                for name in users]
        left = [line for line in left if line]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _remove_what_they_left(uids: set[int], homes: list[Path]) -> None:
    """Whatever the users left in /tmp and /dev/shm (folders, links, segments), and the package's folders in
    their homes."""
    for base in (Path("/tmp"), Path("/dev/shm")):
        for entry in os.scandir(base):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid in uids or entry.name.startswith(("hvd_notebook-hvdt-", "hvdt-aside-", "hvdt-mallory-own-")):
                path = Path(entry.path)
                if stat.S_ISDIR(st.st_mode):
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
    for home in homes:
        for name in (".cache/hvd_notebook", "work", "precious.txt", ".ipython", ".local/share/jupyter"):
            path = home / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists() or path.is_symlink():
                path.unlink()


@pytest.fixture(scope="module")
def workspace():
    ws = Workspace()
    yield ws
    shutil.rmtree(ws.path, ignore_errors=True)


@pytest.fixture(scope="module")
def people(workspace):
    """The victim and the attacker (made, or reused where they exist), able to run the suite's Python; at the
    end every process of theirs is killed (and proven gone), what they left removed, the modes put back."""
    for name in (VICTIM, MALLORY):
        if subprocess.run(["id", "-u", name], capture_output=True).returncode != 0:
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True)
    env = {"HVD_NOTEBOOK_GPUS": "", "HVD_NOTEBOOK_STANDBY": "off", "HVD_NOTEBOOK_LEASE_DIR": str(workspace.node)}
    victim, mallory = User(VICTIM, env), User(MALLORY, env)
    uids, homes = {victim.uid, mallory.uid}, [victim.home, mallory.home]
    _kill_all_of([VICTIM, MALLORY])  # (a run killed before its clean-up)
    _remove_what_they_left(uids, homes)
    base = subprocess.run([str(PYTHON), "-c", "import sys; print(sys.base_prefix)"], capture_output=True,
                          text=True, check=True).stdout.strip()
    changed = let_others_traverse([ROOT / ".venv" / "bin", Path(os.path.realpath(PYTHON)), Path(base) / "lib" / "x",
                                  SOURCE / "hvd_notebook"])
    try:
        for user in (victim, mallory):
            done = user.run([str(PYTHON), "-c", "import hvd_notebook, zmq, psutil; print(hvd_notebook.__file__)"])
            assert done.returncode == 0 and done.stdout.startswith(str(SOURCE)), (
                f"{user.name} cannot run {PYTHON} with the package from {SOURCE}: {done.stdout}{done.stderr[-2000:]}")
        yield victim, mallory
    finally:
        left = _kill_all_of([VICTIM, MALLORY])
        _remove_what_they_left(uids, homes)
        put_modes_back(changed)
        assert not left, f"processes of the test's users still ran after SIGKILL:\n{left}"


class Sleepers:
    """Real processes that do nothing (stand-ins for a user's other work: their Jupyter server), one per owner,
    started again where an attack killed one."""

    def __init__(self, victim: User, mallory: User) -> None:
        self.users = {VICTIM: victim, MALLORY: mallory}
        self.procs: dict[str, psutil.Process] = {}
        self.launchers: list[subprocess.Popen] = []

    def get(self, owner: str) -> psutil.Process:
        proc = self.procs.get(owner)
        if proc is not None and alive(proc):
            return proc
        if owner == "root":
            launcher = subprocess.Popen(["sleep", "900"])
            self.launchers.append(launcher)
            proc = psutil.Process(launcher.pid)
        else:
            launcher = subprocess.Popen(self.users[owner].argv(["sleep", "900"]), cwd="/")
            self.launchers.append(launcher)
            proc = _the_sleep(launcher.pid)
        self.procs[owner] = proc
        return proc

    def stop(self) -> None:
        for proc in self.procs.values():
            try:
                proc.kill()
            except psutil.Error:
                pass
        for launcher in self.launchers:
            launcher.kill()
            launcher.wait()


def _the_sleep(pid: int) -> psutil.Process:
    """The ``sleep`` itself, where runuser ran it as its child."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        proc = psutil.Process(pid)
        for candidate in [proc, *proc.children(recursive=True)]:
            try:
                if candidate.name() == "sleep":
                    return candidate
            except psutil.Error:
                continue
        time.sleep(0.05)
    pytest.fail("a user's sleep process did not start")


def alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture(scope="module")
def sleepers(people):
    s = Sleepers(*people)
    yield s
    s.stop()


class VictimCluster:
    """The victim's cluster, driven by DRIVER as the victim: start, exec, restart, info, stop."""

    def __init__(self, victim: User, log: Path, plain: bool = False) -> None:
        self.log = log
        self._log_file = open(log, "w")
        argv = [str(PYTHON), str(Workspace.driver), FRAMEWORK, str(START_TIMEOUT)] + (["plain"] if plain else [])
        self.proc = subprocess.Popen(victim.argv(argv),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log_file, text=True,
                                     cwd=victim.home)
        self._lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info: dict = {}

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self._lines.put(line)

    def ask(self, command: str, timeout: float = 120) -> dict:
        """The driver's answer to ``command`` ({"ok": False, "error": ...} where it gave none in time)."""
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
            return json.loads(self._lines.get(timeout=timeout)[2:])
        except (queue.Empty, OSError):
            return {"ok": False, "error": f"no answer to {command.split()[0]!r} within {timeout} s "
                    f"(driver {'running' if self.proc.poll() is None else 'exited'}); its log:\n{self.stderr()}"}

    def start(self) -> dict:
        answer = self.ask("start", START_TIMEOUT + 60)
        if answer["ok"]:
            self.info = answer
        return answer

    def restart(self) -> dict:
        answer = self.ask("restart", START_TIMEOUT * 2 + 60)
        if answer["ok"]:
            self.info = {**self.info, **answer}
        return answer

    def exec(self, code: str) -> dict:
        return self.ask("exec " + json.dumps(code), 120)

    def works(self) -> str | None:
        """None where a cell with an MPI allreduce runs on both ranks; else what went wrong."""
        answer = self.exec(ALLREDUCE)
        if not answer["ok"]:
            return f"the victim's cell failed: {answer['error'][-1500:]}"
        if answer["stdout"] != ["allreduce 3\n"] * 2:
            return f"the victim's cell printed {answer['stdout']!r}, not the allreduce's 3 on both ranks"
        return None

    def stderr(self) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")[-4000:]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.ask("stop", 30)
            try:
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                kill_tree(self.proc)
        self._log_file.close()


def start_victim(victim: User, workspace: Workspace, name: str) -> tuple[VictimCluster, dict]:
    cluster = VictimCluster(victim, workspace.path / f"{name}.log")
    return cluster, cluster.start()


def planted_folder(mallory: User, folder: str, mode: str, victim_pid: int, marker: Path) -> dict:
    return mallory.tool("plant-folder", folder, mode, str(victim_pid), str(marker))


@pytest.fixture(scope="module")
def planted(people, sleepers, workspace):
    """Attack 1, made before the victim's first start: the victim's /tmp/hvd_notebook-hvdt-victim made by the
    attacker, 0777, with planted files (an orphaned cluster listing the victim's sleeper, a stack file naming
    it, a pickled commit that makes a marker file when loaded)."""
    victim, mallory = people
    marker = workspace.path / "unpickled-by-the-victim"
    folder = f"/tmp/hvd_notebook-{VICTIM}"
    answer = planted_folder(mallory, folder, "777", sleepers.get(VICTIM).pid, marker)
    return {"folder": Path(folder), "files": answer["files"], "marker": marker,
            "atimes": {f: os.stat(f).st_atime for f in answer["files"]}, "sleeper": sleepers.get(VICTIM)}


@pytest.fixture(scope="module")
def victim_cluster(people, workspace, planted):
    """The victim's running 2-rank cluster of the module (the register card of the node's folder written)."""
    victim, _ = people
    problems: list[str] = []
    setup_node(workspace.node, problems)  # (a problem here is the lease tests' to report)
    cluster, answer = start_victim(victim, workspace, "victim")
    try:
        if not answer["ok"]:
            pytest.fail(f"the victim's cluster did not start (the attacker made {planted['folder']} first): "
                        f"{answer['error'][-3000:]}\nthe driver's log:\n{cluster.stderr()}")
        yield cluster
    finally:
        cluster.close()


def fail_if(problems: list[str], what: str) -> None:
    if problems:
        pytest.fail(f"{what}:\n- " + "\n- ".join(problems), pytrace=False)


def inside(path: Path, folder: Path) -> bool:
    """Is ``path`` inside ``folder``, or inside where ``folder`` leads (a symbolic link)?"""
    for base in {folder, Path(os.path.realpath(folder))}:
        if Path(os.path.realpath(path)).is_relative_to(base) or path.is_relative_to(base):
            return True
    return False


def _check_folder_attack(victim: User, cluster: VictimCluster, answer: dict, attacker_folder: Path,
                         files: dict, marker: Path, sleeper: psutil.Process, problems: list[str]) -> None:
    """Attack 1's outcome: the victim's cluster runs outside the attacker's folder, in a private folder of
    theirs; their own clean, list and stacks leave the sleeper alive and read none of the planted files."""
    if not answer["ok"]:
        problems.append(f"the victim's cluster did not start: {answer['error'][-1500:]}")
        return
    workdir = Path(answer["workdir"])
    if inside(workdir, attacker_folder):
        problems.append(f"the victim's cluster directory {workdir} is inside the attacker's {attacker_folder}")
    elif not workdir.is_relative_to(victim.home):
        problems.append(f"the victim's cluster directory {workdir} is not in their home (the fallback of a "
                        f"{attacker_folder} made by someone else: ~/.cache/hvd_notebook/run-HOST)")
    st = os.lstat(workdir) if workdir.exists() else None
    if st is None or st.st_uid != victim.uid or st.st_mode & 0o077 or not stat.S_ISDIR(st.st_mode):
        problems.append(f"the victim's cluster directory {workdir} is not a private folder of theirs: "
                        f"{oct(st.st_mode) if st else 'missing'}")
    if str(attacker_folder) not in cluster.stderr():
        problems.append(f"no warning named {attacker_folder} in the victim's log")
    for args in (("clean",), ("list",), ("stacks", "--timeout", "1")):
        done = victim.cli(*args)
        if done.returncode not in (0, 1) or "Traceback" in done.stderr:
            problems.append(f"the victim's `hvd-notebook {' '.join(args)}` failed ({done.returncode}): "
                            f"{done.stderr[-800:]}")
    if not holds_for(lambda: alive(sleeper), 0.5):
        problems.append(f"the victim's own process {sleeper.pid} (named in the attacker's planted files) was killed "
                        "by the victim's own hvd-notebook clean/stacks")
    read = [f for f, atime in files.items() if not os.path.exists(f) or os.stat(f).st_atime != atime]
    if read:
        problems.append(f"the victim's code read or removed the attacker's planted files: {read}")
    if marker.exists():
        problems.append("the attacker's pickled commit was unpickled by the victim (its marker file exists)")
    broken = cluster.works()
    if broken:
        problems.append(broken)


# ------------------------------------------------------------------ 1. the per-user folder made first
def test_a_tmp_folder_the_attacker_made_first_is_not_used(people, victim_cluster, planted):
    victim, _ = people
    problems: list[str] = []
    _check_folder_attack(victim, victim_cluster, victim_cluster.info, planted["folder"], planted["atimes"],
                         planted["marker"], planted["sleeper"], problems)
    fail_if(problems, f"the attacker's {planted['folder']} (0777, made first, with planted files) was used")


@pytest.mark.parametrize("kind", ["attacker-0700", "symlink"])
def test_a_tmp_folder_made_first_in_another_shape_is_not_used(people, workspace, sleepers, victim_cluster, planted,
                                                              kind):
    """The same, where the attacker's folder is theirs with no access for others (the victim cannot even
    enter it: a start must not fail for that), or a symbolic link to a folder of theirs."""
    victim, mallory = people
    folder = planted["folder"]
    aside = Path(f"/tmp/hvdt-aside-{secrets.token_hex(4)}")
    marker = workspace.path / f"unpickled-{kind}"
    sleeper = sleepers.get(VICTIM)
    assert mallory.run(["mv", str(folder), str(aside)]).returncode == 0
    own = Path(f"/tmp/hvdt-mallory-own-{secrets.token_hex(4)}") if kind == "symlink" else folder
    problems: list[str] = []
    cluster = None
    try:
        plant = planted_folder(mallory, str(own), "777" if kind == "symlink" else "700", sleeper.pid, marker)
        if kind == "symlink":
            assert mallory.run(["ln", "-s", str(own), str(folder)]).returncode == 0
        atimes = {f: os.stat(f).st_atime for f in plant["files"]}
        cluster, answer = start_victim(victim, workspace, f"victim-{kind}")
        _check_folder_attack(victim, cluster, answer, folder, atimes, marker, sleeper, problems)
    finally:
        if cluster is not None:
            cluster.close()
        mallory.run(["rm", "-rf", str(folder), str(own)])
        mallory.run(["mv", str(aside), str(folder)])
    broken = victim_cluster.works()
    if broken:
        problems.append(f"(the module's cluster) {broken}")
    fail_if(problems, f"the attacker's {folder} ({kind}) was used")


ELASTIC_JOB = textwrap.dedent("""\
    import hvd_notebook.runtime as hvd
    hvd.init()
    state = hvd.elastic.ObjectState(epoch=0)

    @hvd.elastic.run
    def train(state):
        state.epoch += 1
        state.commit()
        return state.epoch

    print("rank", hvd.rank(), "epochs", train(state), flush=True)
""")


def test_a_commit_the_attacker_planted_is_never_unpickled(people, workspace, planted):
    """The attacker watches the /tmp folder they made for the victim's next hvd.elastic folder (that of an
    ``hvd-notebook run`` job) and swaps in one of theirs holding a poisoned commit, which rank 0 would
    unpickle at the job's ``hvd.elastic.run``; the victim's job runs as if nothing was there."""
    victim, mallory = people
    marker = workspace.path / "unpickled-commit"
    script = workspace.path / "scripts" / "elastic.py"
    script.write_text(ELASTIC_JOB)
    script.chmod(0o644)
    swapper = mallory.popen([str(PYTHON), str(Workspace.tool), "swap-elastic", str(planted["folder"]), str(marker),
                             "90"])
    problems: list[str] = []
    try:
        line = _readline(swapper, 30)
        assert line.startswith("@@"), f"the attacker's watch did not start: {line}"
        done = victim.cli("run", "-np", "2", str(PYTHON), str(script), timeout=120)
        swapper.stdin.close()  # (the watch ends)
        try:
            swapper.wait(10)
        except subprocess.TimeoutExpired:
            kill_tree(swapper)
        swapped = _answer(swapper.stdout.read()) or {}
        print(f"the attacker swapped in {swapped.get('swapped')}; the job ended with {done.returncode}")
        if marker.exists():
            problems.append(f"the victim's rank 0 unpickled the attacker's commit in {swapped.get('swapped')} "
                            "(its command ran as the victim)")
        if done.returncode != 0 or sorted(done.stdout.splitlines()) != ["rank 0 epochs 1", "rank 1 epochs 1"]:
            problems.append(f"the victim's job did not run as it should ({done.returncode}): "
                            f"{done.stdout[-600:]}{done.stderr[-1200:]}")
    finally:
        kill_tree(swapper)
    fail_if(problems, "the attacker's commit reached the victim's hvd.elastic.run")


# ------------------------------------------------------------------ 2. root's clean acting on what a user wrote
def _attacker_folder(mallory: User) -> Path:
    folder = Path(f"/tmp/hvd_notebook-{MALLORY}")
    mallory.run(["rm", "-rf", str(folder)])
    return folder


def test_root_clean_of_the_attacker_kills_only_the_attackers_processes(people, sleepers, victim_cluster):
    """The attacker's own folder lists, as an orphaned cluster's, a root process and a victim's process with
    their real start times (readable by anyone), besides one of their own."""
    victim, mallory = people
    folder = _attacker_folder(mallory)
    procs = {owner: sleepers.get(owner) for owner in ("root", VICTIM, MALLORY)}
    dead = mallory.tool("dead-pid")["pid"]
    pids = "\n".join(f"{p.pid} {p.create_time()}" for p in procs.values())
    assert mallory.sh(f"umask 077 && mkdir -p {folder}/hvd-1-1 && printf '%s' '{dead} {time.time() - 100}' > "
                      f"{folder}/hvd-1-1/owner && printf '%s\\n' '{pids}' > {folder}/hvd-1-1/pids").returncode == 0
    problems: list[str] = []
    try:
        done, seconds = root_cli("clean", "--user", MALLORY)
        if done.returncode != 0:
            problems.append(f"root's clean --user {MALLORY} failed ({done.returncode}): {done.stderr[-1000:]}")
        holds_for(lambda: all(alive(procs[owner]) for owner in ("root", VICTIM)), 0.5)
        for owner in ("root", VICTIM):
            if not alive(procs[owner]):
                problems.append(f"root's `hvd-notebook clean --user {MALLORY}` killed {owner}'s process "
                                f"{procs[owner].pid} (the attacker had written its pid and start time); it said: "
                                f"{done.stdout.strip()[-500:]}")
        if alive(procs[MALLORY]):
            problems.append(f"root's clean --user {MALLORY} left the attacker's own orphaned cluster's process "
                            f"running (it no longer stops a user's orphaned clusters): {done.stdout.strip()[-500:]}")
        broken = victim_cluster.works()
        if broken:
            problems.append(broken)
    finally:
        mallory.run(["rm", "-rf", str(folder)])
    fail_if(problems, "root's clean acted on what the attacker wrote")


def test_root_clean_of_the_attacker_leaves_the_victims_folders_alone(people, workspace, victim_cluster):
    """The attacker's folder is a symbolic link to the victim's private base folder, and two cards of theirs in
    the node's register name folders of the victim's (their cluster directory; one beside an ``hvd-*`` folder
    of the victim's results)."""
    victim, mallory = people
    workdir = Path(victim_cluster.info["workdir"])
    results = victim.home / "work" / "hvd-results"
    assert victim.sh(f"mkdir -p {results} && echo 'a month of results' > {results}/data.txt").returncode == 0
    folder = _attacker_folder(mallory)
    assert mallory.run(["ln", "-s", str(workdir.parent), str(folder)]).returncode == 0
    register = Path(mallory.tool("register-folder")["folder"])
    dead = [mallory.tool("dead-pid")["pid"] - k for k in (0, 1)]
    cards = [register / f"cluster-{mallory.uid}-{pid}.json" for pid in dead]
    problems: list[str] = []
    try:
        if register.is_dir():
            mallory.tool("write-card", str(cards[0]), str(workdir))
            mallory.tool("write-card", str(cards[1]), str(victim.home / "work" / "hvd-anything"))
        else:
            problems.append(f"the register folder {register} (registry.card_path's) does not exist")
        done, _ = root_cli("clean", "--user", MALLORY, HVD_NOTEBOOK_LEASE_DIR=str(workspace.node))
        if done.returncode != 0:
            problems.append(f"root's clean --user {MALLORY} failed ({done.returncode}): {done.stderr[-1000:]}")
        if not workdir.is_dir():
            problems.append(f"root's clean --user {MALLORY} removed the victim's cluster directory {workdir}")
        if not (results / "data.txt").exists():
            problems.append(f"root's clean --user {MALLORY} removed the victim's {results}: "
                            f"{done.stdout.strip()[-500:]}")
        gone = [pid for pid in victim_cluster.info["pids"] if not psutil.pid_exists(pid)]
        if gone:
            problems.append(f"processes of the victim's cluster are gone: {gone}")
        broken = victim_cluster.works()
        if broken:
            problems.append(broken)
    finally:
        mallory.run(["rm", "-rf", str(folder), *map(str, cards)])
        victim.run(["rm", "-rf", str(victim.home / "work")])
    fail_if(problems, "root's clean followed the attacker into the victim's folders")


# ------------------------------------------------------------------ 3. reading the victim's cells
def _eavesdrop(mallory: User, victim: User, cluster: VictimCluster) -> tuple[dict, dict | None, dict, str]:
    """The attacker's probe on every ZMQ port of the victim's while ``cluster`` prints a secret twice, a second
    apart: what it found when ready (ports, ZMQ ones, how its subscriptions' handshakes ended), what it heard
    (None where it gave nothing), the victim's own answer, and the secret."""
    secret = f"hvdt-secret-{secrets.token_hex(8)}"
    spy = mallory.popen([str(PYTHON), str(Workspace.tool), "probe-zmq", str(victim.uid), "8"])
    try:
        line = _readline(spy, 40)
        assert line.startswith("@@"), f"the attacker's probe did not start: {line}"
        ready = json.loads(line[2:])
        answer = cluster.exec(f"print({secret!r})\nimport time\ntime.sleep(1.0)\nprint({secret!r})")
        try:
            out, err = spy.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            kill_tree(spy)
            out, err = spy.communicate()
    finally:
        kill_tree(spy)
    done = _answer(out)
    print(f"the attacker found {len(ready['ports'])} listening port(s) of the victim's, {len(ready['zmq'])} "
          f"greeting as ZMQ (handshakes {ready['handshakes']}), and received {done and done['messages']} message(s)")
    if done is None:
        done = {"error": err[-2000:]}
    return ready, done, answer, secret


def test_the_attackers_probe_hears_a_victim_cluster_without_encryption(people, workspace, victim_cluster):
    """The control of the next test, on the same set-up: the victim's second cluster, with CurveZMQ left out,
    is heard by the same probe (its subscriptions' handshakes succeed and it reads the cell's output); so the
    probe's silence on the victim's encrypted cluster means something."""
    victim, mallory = people
    plain = VictimCluster(victim, workspace.path / "plain.log", plain=True)
    try:
        started = plain.start()
        assert started["ok"], f"the victim's unencrypted cluster did not start: {started}\n{plain.stderr()}"
        ready, done, answer, secret = _eavesdrop(mallory, victim, plain)
    finally:
        plain.close()
    assert answer["ok"] and answer["stdout"] == [f"{secret}\n{secret}\n"] * 2, answer
    assert "succeeded" in ready["handshakes"], ready
    assert secret in done.get("text", ""), f"the probe did not hear an unencrypted cluster: {done}"
    assert_gone(started["pids"])


def test_nobody_else_reads_the_victims_cells(people, workspace, victim_cluster):
    victim, mallory = people
    problems: list[str] = []
    ready, done, answer, secret = _eavesdrop(mallory, victim, victim_cluster)
    if not ready["zmq"]:  # (a probe that found nothing to listen to proves nothing)
        problems.append(f"the attacker's probe found no ZMQ port of the victim's among {ready['ports']}: "
                        "this run proved nothing")
    if "succeeded" in ready["handshakes"] or "failed" not in ready["handshakes"]:
        problems.append(f"the attacker's subscriptions did not all end refused at the handshake: "
                        f"{ready['handshakes']}")
    if "error" in done:
        problems.append(f"the attacker's probe gave no result: {done['error']}")
    elif secret in done["text"]:
        problems.append(f"the attacker read the victim's cell (source or output) on {len(ready['zmq'])} ZMQ "
                        f"port(s) of the victim's {len(ready['ports'])} listening one(s): {done['messages']} "
                        f"message(s), e.g. ...{done['text'][max(0, done['text'].find(secret) - 300):][:600]}")
    if not answer["ok"] or answer["stdout"] != [f"{secret}\n{secret}\n"] * 2:
        problems.append(f"the victim's own cell did not give its output: {answer}")
    broken = victim_cluster.works()
    if broken:
        problems.append(broken)
    fail_if(problems, "another user read the victim's cells")


# ------------------------------------------------------------------ 4. MPICH's shared memory
def _foreign_mappings(pids: list[int], uid: int) -> list[str]:
    """Every file in /dev/shm that one of ``pids`` maps and that ``uid`` does not own (root reads the maps
    and the mapped files themselves, through /proc/PID/map_files: a removed file counts too)."""
    foreign = []
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            parts = line.split(None, 5)
            if len(parts) < 6 or not parts[5].startswith("/dev/shm/"):
                continue
            try:
                owner = os.stat(f"/proc/{pid}/map_files/{parts[0]}").st_uid
            except OSError:
                continue
            if owner != uid:
                foreign.append(f"rank pid {pid} maps {parts[5]} of uid {owner}")
    return sorted(set(foreign))


@pytest.mark.parametrize("mode", ["666", "600"])
def test_mpich_segments_the_attacker_made_first_are_never_used(people, workspace, victim_cluster, mode):
    """The attacker makes, mode 0666 (to read and change what the ranks exchange) or 0600 (to block their
    start), MPICH's segment names of the victim's next worlds; the victim's cluster restarts (a new mpiexec)."""
    victim, mallory = people
    listing = workspace.path / f"shm-{mode}.txt"
    problems: list[str] = []
    try:
        plant = mallory.tool("plant-shm", mode, "300", "50", str(listing))
        t0 = time.monotonic()
        answer = victim_cluster.restart()
        seconds = time.monotonic() - t0
        print(f"planted {plant['made']} names (pids {plant['pids']}, seconds {plant['times']}); the restart "
              f"{'worked' if answer['ok'] else 'failed'} in {seconds:.1f} s: {answer.get('error', '')[-600:]}")
        if answer["ok"]:
            info = victim_cluster.info
            foreign = _foreign_mappings(info["ranks"], victim.uid)
            if foreign:
                problems.append("the victim's ranks silently attached to the attacker's segments: "
                                + "; ".join(foreign))
            mpiexec = info["mpiexec"]
            lo, hi = plant["pids"]
            if not (lo <= mpiexec <= hi if lo <= hi else mpiexec >= lo or mpiexec <= hi):
                problems.append(f"the victim's new world (mpiexec pid {mpiexec}) fell outside the planted pids "
                                f"{lo}..{hi}: this run proved nothing, run it again")
        else:
            error = answer["error"]
            if seconds > START_TIMEOUT + 20:
                problems.append(f"the victim's restart took {seconds:.0f} s to fail (a hang, start timeout "
                                f"{START_TIMEOUT} s)")
            if "mpich_shm_" not in error or MALLORY not in error:
                problems.append(f"the victim's restart failed after {seconds:.0f} s without naming the attacker's "
                                f"segment and its owner: {error[-1500:]}")
            mallory.tool("remove-listed", str(listing))
            again = victim_cluster.start()
            if not again["ok"]:
                problems.append(f"the victim's cluster did not start again once the segments were gone: "
                                f"{again['error'][-1500:]}")
        broken = victim_cluster.works()
        if broken:
            problems.append(broken)
    finally:
        if listing.exists():
            mallory.tool("remove-listed", str(listing))
        for path in Path("/dev/shm").glob("mpich_shm_*"):  # (whatever of the attacker's is left)
            try:
                if path.lstat().st_uid == mallory.uid:
                    path.unlink()
            except OSError:
                pass
    fail_if(problems, f"MPICH segments the attacker made first (mode {mode}) were used")


# ------------------------------------------------------------------ 5. leases (and 6. the register): sysctls 0 and 2
@pytest.fixture(params=[(0, 0), HARDENED], ids=["protected-0", "protected-2-1"])
def protected(request):
    """fs.protected_regular and fs.protected_symlinks at 0 (this machine's default) or at 2 and 1 (their
    highest: systemd hosts have 1 or 2, and 1); always put back. The test's id: "0" or "2-1"."""
    old = {path: Path(path).read_text().strip() for path in SYSCTLS}
    try:
        for path, value in zip(SYSCTLS, request.param):
            try:
                Path(path).write_text(str(value))
            except OSError as exc:
                pytest.skip(f"{path} cannot be set to {value} here ({exc.strerror})")
        yield "-".join(map(str, sorted(set(request.param), reverse=True)))
    finally:
        for path, value in old.items():
            try:
                Path(path).write_text(value)
            except OSError:
                pass


class Holder:
    """A user's lease (TOOL's ``lease``), held while this lives."""

    def __init__(self, user: User, folder: Path, gpus: str) -> None:
        self.proc = user.popen([str(PYTHON), str(Workspace.tool), "lease", gpus, "1"],
                               HVD_NOTEBOOK_LEASE_DIR=str(folder), HVD_NOTEBOOK_GPUS="0,1")
        line = _readline(self.proc, QUICK * 3)
        self.answer = json.loads(line[2:]) if line.startswith("@@") else {
            "refused": f"no answer (exit {self.proc.poll()}): {line}{self._stderr()}"}

    def _stderr(self) -> str:
        if self.proc.poll() is None:
            return ""
        return self.proc.stderr.read()[-2000:]

    @property
    def held(self) -> bool:
        return "held" in self.answer

    def release(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(15)
        except (OSError, subprocess.TimeoutExpired):
            kill_tree(self.proc)


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(proc.stdout.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout)
    except queue.Empty:
        kill_tree(proc)
        return f"(nothing within {timeout} s)"


def _lease_outcome(holder: Holder, names: list[str], problems: list[str], what: str) -> None:
    """A lease that was refused must have been refused at once, naming what it names here."""
    if holder.held:
        return
    refused = holder.answer["refused"]
    if holder.answer.get("seconds", 99) > QUICK:
        problems.append(f"{what}: refused only after {holder.answer.get('seconds')} s")
    missing = [n for n in names if n not in refused]
    if missing:
        problems.append(f"{what}: refused without naming {missing}: {refused[-800:]}")


def _lease_folder(workspace: Workspace, name: str, protected: str) -> Path:
    folder = workspace.path / f"leases-{name}-{protected}"
    shutil.rmtree(folder, ignore_errors=True)
    return folder


def test_a_lease_folder_the_attacker_made_first_is_refused(people, workspace, protected):
    victim, mallory = people
    folder = _lease_folder(workspace, "made-first", protected)
    assert mallory.sh(f"mkdir -m 1777 {folder}").returncode == 0  # (as the first lease used to make it)
    problems: list[str] = []
    lease = Holder(victim, folder, "0")
    try:
        if lease.held:
            problems.append(f"the victim leased GPU 0 in {folder}, a folder the attacker owns")
            mallory.run(["rm", "-f", str(folder / "gpu0.lock")])  # (the folder's owner removes any file in it)
            stolen = Holder(mallory, folder, "0")
            if stolen.held:
                problems.append("the attacker then leased GPU 0 too, while the victim held it")
            stolen.release()
        else:
            _lease_outcome(lease, [str(folder), MALLORY, "setup-node"], problems, "the victim's lease")
    finally:
        lease.release()
    # what the refusal says to do: the admin makes the folder anew; the victim's lease then works
    done, _ = root_cli("setup-node", "--gpus", "0,1", HVD_NOTEBOOK_LEASE_DIR=str(folder))
    if done.returncode != 0:
        problems.append(f"root's setup-node failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    again = Holder(victim, folder, "0")
    if not again.held:
        problems.append(f"after the admin's setup-node the victim's lease was refused: {again.answer['refused']}")
    again.release()
    shutil.rmtree(folder, ignore_errors=True)
    fail_if(problems, f"a lease folder the attacker made first was used (protected_* = {protected})")


@pytest.mark.parametrize("plant", ["symlink", "attacker-0600"])
def test_a_lock_file_the_attacker_planted_is_not_followed_nor_blocks(people, workspace, protected, plant):
    """In the root-made lease folder, the attacker makes ``gpu0.lock`` first: a symbolic link to a file of the
    victim's (which a lease must not truncate or chmod), or a file of theirs, 0600."""
    victim, mallory = people
    folder = _lease_folder(workspace, plant, protected)
    problems: list[str] = []
    setup_node(folder, problems)
    precious = victim.home / "precious.txt"
    assert victim.sh(f"umask 077 && echo 'the victim data' > {precious}").returncode == 0
    before = (precious.read_text(), stat.S_IMODE(precious.stat().st_mode))
    lock = folder / "gpu0.lock"
    made = (mallory.run(["ln", "-s", str(precious), str(lock)]) if plant == "symlink"
            else mallory.sh(f"umask 077 && : > {lock}"))
    lease = Holder(victim, folder, "0")
    try:
        if lease.held:
            rival = Holder(mallory, folder, "0")
            if rival.held:
                problems.append("the victim's lease of GPU 0 holds nothing: the attacker leased GPU 0 too")
            rival.release()
        else:
            names = [str(lock), MALLORY] if made.returncode == 0 else [str(lock)]
            _lease_outcome(lease, names, problems, f"the victim's lease (the attacker's plant "
                           f"{'was made' if made.returncode == 0 else 'failed: ' + made.stderr.strip()})")
            if made.returncode != 0:
                problems.append(f"the attacker could plant nothing, yet the victim's lease was refused: "
                                f"{lease.answer['refused']}")
    finally:
        lease.release()
    after = (precious.read_text(), stat.S_IMODE(precious.stat().st_mode))
    if after != before:
        problems.append(f"the victim's lease wrote through the attacker's symbolic link: {precious} was {before}, "
                        f"is {after}")
    precious.unlink()
    shutil.rmtree(folder, ignore_errors=True)
    fail_if(problems, f"the attacker's gpu0.lock ({plant}, protected_* = {protected}) was used")


def test_two_users_share_the_root_made_lease_folder(people, workspace, protected):
    """Both users lease different GPUs; the second lease of one GPU is refused naming its holder; a GPU one
    user leased once is leased by the other afterwards (``fs.protected_regular`` must not lose it)."""
    victim, mallory = people
    folder = _lease_folder(workspace, "shared", protected)
    problems: list[str] = []
    setup_node(folder, problems)
    first = Holder(victim, folder, "0")
    try:
        if not first.held:
            problems.append(f"the victim's lease of GPU 0 was refused: {first.answer['refused'][-800:]}")
        second = Holder(mallory, folder, "0")
        if second.held:
            problems.append("the attacker leased GPU 0 while the victim held it")
        elif VICTIM not in second.answer["refused"]:
            problems.append(f"the second lease of GPU 0 was refused without naming its holder ({VICTIM}): "
                            f"{second.answer['refused'][-800:]}")
        second.release()
        other = Holder(mallory, folder, "1")
        if not other.held:
            problems.append(f"the attacker's lease of the free GPU 1 was refused: {other.answer['refused'][-800:]}")
        other.release()
    finally:
        first.release()
    for user, gpu in ((mallory, "0"), (victim, "1")):
        swapped = Holder(user, folder, gpu)
        if not swapped.held:
            problems.append(f"{user.name}'s lease of GPU {gpu}, which the other user leased before, was refused: "
                            f"{swapped.answer['refused'][-800:]}")
        swapped.release()
    shutil.rmtree(folder, ignore_errors=True)
    fail_if(problems, f"two users could not share the node's GPUs (protected_* = {protected})")


# ------------------------------------------------------------------ 6. the register jammed
def test_a_jammed_register_hangs_and_misleads_no_reader(people, workspace, sleepers, victim_cluster, protected):
    victim, mallory = people
    register = Path(mallory.tool("register-folder")["folder"])
    assert register.is_dir(), f"the register folder {register} (registry.card_path's) does not exist"
    bad = mallory.tool("plant-cards", str(register), str(victim.uid), str(sleepers.get(VICTIM).pid),
                       "10" if protected == "0" else "20")
    problems: list[str] = []
    mine = Path(victim_cluster.info["workdir"]).name
    try:
        t0 = time.monotonic()
        try:
            done = victim.run([str(PYTHON), str(Workspace.tool), "read-register"], timeout=20)
            answer = _answer(done.stdout)
        except subprocess.TimeoutExpired:
            done, answer = None, None
            problems.append("the victim's registry.read_all() hung (killed after 20 s)")
        seconds = time.monotonic() - t0
        if done is not None and answer is None:
            problems.append(f"the victim's registry.read_all() crashed: {done.stderr[-1200:]}")
        if answer is not None:
            if seconds > QUICK:
                problems.append(f"the victim's registry.read_all() took {seconds:.1f} s")
            theirs = [c["cluster"] for c in answer["cards"] if c["user"] == VICTIM]
            if theirs != [mine]:
                problems.append(f"the register gave the victim's cards as {theirs}, not their one cluster {mine}")
            taken = [c["path"] for c in answer["cards"] if c["path"] in bad.values()]
            if taken:
                problems.append(f"bad cards were read as cards: {taken}")
            for kind, path in bad.items():
                said = [line for line in done.stderr.splitlines() if Path(path).name in line]
                if len(said) != 1:
                    problems.append(f"the {kind} card {Path(path).name}: {len(said)} warning(s), not one")
        for who, args in ((victim, ("list", "--all")), ("root", ("clean", "--user", VICTIM))):
            t0 = time.monotonic()
            try:
                if who == "root":
                    done, _ = root_cli(*args, HVD_NOTEBOOK_LEASE_DIR=str(workspace.node), timeout=20)
                else:
                    done = who.cli(*args, timeout=20)
            except subprocess.TimeoutExpired:
                problems.append(f"{'root' if who == 'root' else VICTIM}'s `hvd-notebook {' '.join(args)}` hung "
                                "(killed after 20 s)")
                continue
            seconds = time.monotonic() - t0
            if done.returncode != 0 or "Traceback" in done.stderr:
                problems.append(f"`hvd-notebook {' '.join(args)}` failed ({done.returncode}): {done.stderr[-1000:]}")
            elif seconds > QUICK:
                problems.append(f"`hvd-notebook {' '.join(args)}` took {seconds:.1f} s")
            if args[0] == "list":
                rows = [line for line in done.stdout.splitlines() if VICTIM in line]
                if not any(mine in row for row in rows) or any("hvd-forged" in row for row in rows):
                    problems.append(f"`hvd-notebook list --all` shows the victim's clusters as: {rows}")
        broken = victim_cluster.works()
        if broken:
            problems.append(broken)
    finally:
        mallory.run(["rm", "-f", *bad.values()])
    fail_if(problems, f"the attacker's cards jammed or misled the register's readers (protected_* = {protected})")


# ------------------------------------------------------------------ 7. the dead-rank report's claim
RANK_DIES = textwrap.dedent("""\
    import os, time
    import hvd_notebook.runtime as hvd
    hvd.init()
    print("rank", hvd.rank(), "pid", os.getpid(), flush=True)
    if hvd.rank() == 1:
        time.sleep(1.0)  # (rank 0's watcher is up)
        os._exit(3)
    time.sleep(60)
""")


def test_a_dead_rank_is_named_though_the_attacker_took_the_claim_first(people, planted):
    """The attacker takes first the claim of the rank watchers of the victim's next jobs (abstract socket
    names, held; and claim files in the attacker-made /tmp folder); a rank of the victim's plain mpiexec job
    that ends by os._exit is still named."""
    victim, mallory = people
    holder = mallory.popen([str(PYTHON), str(Workspace.tool), "bind-claims", "1000", str(planted["folder"])])
    problems: list[str] = []
    try:
        line = _readline(holder, 30)
        assert line.startswith("@@"), f"the attacker's claims were not made: {line}"
        claims = json.loads(line[2:])
        done = victim.run([str(MPIEXEC), "-n", "2", str(PYTHON), "-c", RANK_DIES], timeout=120)
        if done.returncode == 0:
            problems.append(f"the victim's job did not fail: {done.stdout[-500:]}")
        named = [line for line in done.stderr.splitlines() if "ended without a word" in line]
        if not any(line.startswith("[hvd_notebook] rank 1 of 2 (pid ") for line in named):
            problems.append(f"the rank that died was not named (the attacker holds {claims['bound']} claims): "
                            f"{done.stderr[-1500:]}")
        rank0 = [int(w.split()[3]) for w in done.stdout.splitlines() if w.startswith("rank 0 pid")]
        lo, hi = claims["pids"]
        if not rank0 or not (lo <= rank0[0] <= hi if lo <= hi else rank0[0] >= lo or rank0[0] <= hi):
            problems.append(f"rank 0's pid {rank0} fell outside the claimed pids {lo}..{hi}: this run proved "
                            "nothing, run it again")
    finally:
        kill_tree(holder)
    fail_if(problems, "the attacker silenced the victim's dead-rank report")
