"""The node's queue for GPUs with real waiters: two GPUs named in ``HVD_NOTEBOOK_GPUS`` (none here; the ranks run
on the CPU while the GPUs are leased), a lease folder made by root as ``setup-node`` makes it.

- a real kernel (jupyter_client's) whose ``%hvd start --no-wait`` fails as before, whose ``%hvd start`` waits
  with its place shown in one line that updates in the cell, leaves the queue at once when interrupted, and is
  served when the GPUs are released;
- three real Unix users, each a stand-in kernel starting a real 1-rank cluster (``MPICluster``), queuing for the
  two GPUs and served in order: first come, first served, except that a user who holds GPUs waits behind one who
  holds none;
- a hostile user (real, as ``runuser`` makes them) who plants entries that fake an earlier time, claim another
  uid, flood the folder, are FIFOs, links and huge files, holds a GPU while her entries say nothing of it, and
  has entries that never take their turn: the victim is served in order all the same, and within one turn's
  time where her entries are first.
Needs root for the users (useradd, runuser)."""

from __future__ import annotations

import json
import os
import pwd
import queue as queues
import re
import select
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest
from conftest import (
    assert_gone,
    cluster_pids,
    comes_within,
    figure,
    let_others_traverse,
    put_modes_back,
    shell_reply,
    started_kernel,
)

from hvd_notebook.cluster.node import leases, queue
from hvd_notebook.private import user_name

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv" / "bin" / "python"
GPUS = ["0", "1"]
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="creates Unix users (useradd) and acts as them "
                               "(runuser): needs root; the suite's root run covers it")
USERS = ("hvdt-qa", "hvdt-qb", "hvdt-qc", "hvdt-qm")  # three users of the queue, and a hostile one


@pytest.fixture
def node(monkeypatch):
    """The node's lease folder for GPUs 0 and 1, root's, made as ``hvd-notebook setup-node`` makes it, in a
    folder every user can reach; this process's leases go through it."""
    top = Path(tempfile.mkdtemp(prefix="hvdt-queue-"))
    top.chmod(0o755)
    folder = top / "node"
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(folder))
    leases.setup_node(GPUS, folder)
    monkeypatch.setattr(queue, "_TURNS", queue.Turns())
    yield folder
    shutil.rmtree(top, ignore_errors=True)


def _waiting(folder: Path) -> list[queue.Entry]:
    return queue.look(GPUS).line


# ------------------------------------------------------------------ one user's kernel
def _iopub(kc, msg_id: str, into: list, stop: threading.Event) -> None:
    """Every IOPub message of request ``msg_id`` into ``into``, until its idle status."""
    while not stop.is_set():
        try:
            msg = kc.get_iopub_msg(timeout=0.5)
        except queues.Empty:
            continue
        except Exception:  # (the kernel's channels closed: the test has ended)
            return
        if msg["parent_header"].get("msg_id") == msg_id:
            into.append(msg)
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                return


def _run(kc, code: str) -> tuple[str, list, threading.Thread]:
    msgs: list = []
    msg_id = kc.execute(code)
    thread = threading.Thread(target=_iopub, args=(kc, msg_id, msgs, threading.Event()), daemon=True)
    thread.start()
    return msg_id, msgs, thread


def _text(msgs: list) -> str:
    out = []
    for msg in msgs:
        content = msg["content"]
        if msg["msg_type"] == "stream":
            out.append(content["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(content["traceback"]))
        elif msg["msg_type"] in ("display_data", "update_display_data"):
            out.append(content["data"].get("text/plain", "") + "\n")
    return "".join(out)


def test_a_start_waits_in_the_queue_shows_its_place_and_an_interrupt_leaves_at_once(node):
    env = {"HVD_NOTEBOOK_GPUS": ",".join(GPUS), "HVD_NOTEBOOK_LEASE_DIR": str(node), "HVD_NOTEBOOK_STANDBY": "off"}
    start = "%hvd start -n 1 --framework torch --timeout 170"
    held = leases.acquire(GPUS, 2, "the test's stand-in for another user's cluster")
    with started_kernel(env) as (km, kc):
        msg_id, msgs, thread = _run(kc, "%load_ext hvd_notebook\nfrom hvd_notebook.kernel.session import Session\n"
                                   f"{start} --no-wait")
        reply, _ = shell_reply(kc, msg_id), thread.join(30)
        out = _text(msgs)
        assert reply["content"]["status"] == "error", out
        assert "needs 1 GPU(s), but only 0 of this host's 2 (none) are free" in out, out
        assert f"Held: GPU 0 by {user_name()}" in out, out
        assert not list((node / "queue").iterdir())  # --no-wait never queued
        # waiting: an entry, the place shown; the stop button leaves the queue at once
        msg_id, msgs, thread = _run(kc, start)
        assert comes_within(lambda: len(_waiting(node)) == 1, 60), "the start did not queue"
        assert comes_within(lambda: "place 1 of 1" in _text(msgs), 10), _text(msgs)
        t0 = time.monotonic()
        km.interrupt_kernel()
        reply = shell_reply(kc, msg_id)
        left = time.monotonic() - t0
        thread.join(30)
        assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt", reply
        assert not list((node / "queue").iterdir()) and left < 5, f"the entry was still there {left:.1f} s after"
        assert "left the node's queue for GPUs" in _text(msgs)
        # waiting again, served when the GPUs are released; the line updated in place (one display id)
        msg_id, msgs, thread = _run(kc, start)
        assert comes_within(lambda: "place 1 of 1" in _text(msgs), 60), _text(msgs)
        held.release()
        reply = shell_reply(kc, msg_id)
        thread.join(30)
        out = _text(msgs)
        assert reply["content"]["status"] == "ok", out
        figure(f"A start that waited in the queue for GPUs, as its cell showed it:\n{out.strip()}")
        assert "Served by the node's queue for GPUs: GPU(s) 0." in out and "Started 1 MPI ranks" in out, out
        ids = {m["content"]["transient"]["display_id"] for m in msgs
               if m["msg_type"] in ("display_data", "update_display_data")}
        assert len(ids) == 1 and any(m["msg_type"] == "update_display_data" for m in msgs), msgs
        pids = cluster_pids(kc)
        msg_id, msgs, thread = _run(kc, "%hvd stop")
        shell_reply(kc, msg_id)
        thread.join(30)
    assert_gone(pids)
    assert not list((node / "queue").iterdir())


WAITER = """
import sys, time
from hvd_notebook.cluster.node import queue
lease = queue.acquire([sys.argv[1]], 1, "a waiter")
print("served", lease.gpus, time.time(), flush=True)
sys.stdin.read()
"""


def _waiter(node: Path, gpu: str) -> subprocess.Popen:
    env = {**os.environ, "HVD_NOTEBOOK_LEASE_DIR": str(node)}
    return subprocess.Popen([str(PYTHON), "-c", WAITER, gpu], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_an_idle_cluster_gives_its_gpu_back_to_a_waiting_start_and_a_dead_waiter_blocks_no_one(node):
    env = {"HVD_NOTEBOOK_GPUS": "0", "HVD_NOTEBOOK_LEASE_DIR": str(node), "HVD_NOTEBOOK_STANDBY": "off",
           "HVD_NOTEBOOK_PREEMPT_IDLE_AFTER": "3s"}
    with started_kernel(env) as (_, kc):
        msg_id, msgs, thread = _run(kc, "%load_ext hvd_notebook\nfrom hvd_notebook.kernel.session import Session\n"
                                        "%hvd start -n 1 --framework torch --timeout 170")
        assert shell_reply(kc, msg_id)["content"]["status"] == "ok", _text(msgs)
        thread.join(30)
        assert "an idle cluster gives its GPUs back after 3 s when another start waits for them" in _text(msgs)
        pids = cluster_pids(kc)
        msg_id, msgs, thread = _run(kc, "%%hvd\nx = 41 + hvd.size()")
        assert shell_reply(kc, msg_id)["content"]["status"] == "ok", _text(msgs)
        thread.join(30)
        # a waiter whose process dies: its entry stays on disk, and counts for no one
        dead = _waiter(node, "0")
        assert comes_within(lambda: len(list((node / "queue").glob("wait-*.json"))) == 1, 30)
        dead.kill()
        dead.wait()
        time.sleep(5)  # (idle for longer than preempt_idle_after: only a live waiter takes the GPU back)
        assert all(psutil.pid_exists(p) for p in pids) and not queue.someone_waits()
        # a live one: the idle cluster gives GPU 0 back
        waiter = _waiter(node, "0")
        t0 = time.monotonic()
        try:
            ready, _, _ = select.select([waiter.stdout], [], [], 120)
            served = waiter.stdout.readline() if ready else "not served within 120 s\n"
            waited = time.monotonic() - t0
            assert served.startswith("served ['0']"), served
            assert_gone(pids)
            figure(f"An idle cluster (preempt_idle_after 3 s) gave its GPU to a waiting start in {waited:.1f} s")
        finally:
            waiter.kill()
            waiter.wait()
        msg_id, msgs, thread = _run(kc, "%%hvd\nprint('x is', x)")
        reply = shell_reply(kc, msg_id)
        thread.join(30)
        out = _text(msgs)
        figure(f"The next cell after the GPU was taken back:\n{out.strip()}")
        assert "another start waits for GPUs in the node's queue ($HVD_NOTEBOOK_PREEMPT_IDLE_AFTER)" in out, out
        assert reply["content"]["status"] == "ok" and "x is 42" in out, out
        pids = cluster_pids(kc)
        msg_id, msgs, thread = _run(kc, "%hvd stop")
        shell_reply(kc, msg_id)
        thread.join(30)
    assert_gone(pids)


# ------------------------------------------------------------------ real users
DRIVER = r'''
import json, sys, time
from hvd_notebook.config import ClusterOptions
from hvd_notebook.cluster.launching.cluster import MPICluster


def say(**answer):
    print("@@" + json.dumps(answer), flush=True)


cluster = MPICluster(ClusterOptions(n=1, framework="torch", start_timeout=170))
try:
    cluster.start()
except BaseException as exc:
    say(event="failed", error=f"{type(exc).__name__}: {exc}")
    raise SystemExit(1)
say(event="started", gpus=cluster.gpus, t=time.time(), pids=sorted(cluster.pids()))
for line in sys.stdin:
    if line.strip() == "stop":
        break
cluster.stop()
say(event="stopped", t=time.time())
'''

# A waiting stand-in kernel reduced to its lease (the hostile test's victim): served, it holds the GPUs until told.
LEASER = r'''
import json, sys, time
from hvd_notebook.cluster.node import queue
lease = queue.acquire(["0", "1"], 1, "victim")
print("@@" + json.dumps({"event": "started", "gpus": lease.gpus, "t": time.time()}), flush=True)
sys.stdin.read()
'''

# The hostile user's moves: entries planted before the victim queues, a GPU held, then let go.
MALLORY = r'''
import fcntl, json, os, sys, time
folder, victim_uid = sys.argv[1], int(sys.argv[2])
me, uid = os.getpid(), os.getuid()
started = __import__("psutil").Process().create_time()


def put(name, data):
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        f.write(json.dumps(data))
    os.utime(path, (1.0, 1.0))  # (an mtime of 1970: no earlier place)
    return path


entry = {"pid": me, "pid_started": started, "gpus": 1, "since": 0, "holds_gpus": False, "uid": victim_uid}
put(f"wait-{victim_uid}-{me}-{'a' * 16}.json", entry)  # a name claiming the victim's uid
for i in range(200):  # a flood
    put(f"wait-{uid}-{me}-{i:016x}.json", entry)
os.mkfifo(os.path.join(folder, f"wait-{uid}-{me}-{'f' * 16}.json"))
os.symlink("/etc/shadow", os.path.join(folder, f"wait-{uid}-{me}-{'e' * 16}.json"))
with open(os.path.join(folder, f"wait-{uid}-{me}-{'d' * 16}.json"), "wb") as f:
    f.truncate(1 << 30)
lock = os.open(os.path.join(os.path.dirname(folder), "gpu1.lock"), os.O_RDONLY)
fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # (a lock file is readable by all: she holds GPU 1)
print("@@" + json.dumps({"event": "ready", "pid": me}), flush=True)
for line in sys.stdin:
    command, _, argument = line.strip().partition(" ")
    if command == "release":
        os.close(lock)
        print("@@" + json.dumps({"event": "released"}), flush=True)
    elif command == "remove":
        try:
            os.rename(argument, argument + ".gone")
            answer = "removed"
        except OSError as exc:
            answer = exc.strerror
        print("@@" + json.dumps({"event": "remove", "answer": answer}), flush=True)
'''


class Process:
    """A script run as a user (``runuser``, a clean environment): its ``@@`` answers, read as they come."""

    def __init__(self, user: str, script: str, env: dict[str, str], *args: str) -> None:
        entry = pwd.getpwnam(user)
        self.user, self.uid = user, entry.pw_uid
        tmp = Path(env["HVD_NOTEBOOK_LEASE_DIR"]).parent / f"tmp-{user}"
        tmp.mkdir(mode=0o700, exist_ok=True)
        os.chown(tmp, entry.pw_uid, entry.pw_gid)
        clean = {"HOME": entry.pw_dir, "USER": user, "LOGNAME": user, "PATH": "/usr/local/bin:/usr/bin:/bin",
                 "TMPDIR": str(tmp), "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1",
                 **env}
        self.proc = subprocess.Popen(["runuser", "-u", user, "--", "env", "-i",
                                      *(f"{k}={v}" for k, v in clean.items()), str(PYTHON), "-c", script, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd="/")
        self.answers: queues.Queue = queues.Queue()
        self.stderr: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("@@"):
                self.answers.put(json.loads(line[2:]))

    def next(self, timeout: float) -> dict:
        try:
            return self.answers.get(timeout=timeout)
        except queues.Empty:
            pytest.fail(f"{self.user}: no answer within {timeout} s:\n{''.join(self.stderr)[-3000:]}")

    def has_answered(self) -> bool:
        return not self.answers.empty()

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def end(self) -> None:
        """Stdin closed, then SIGKILL of what is left of it (runuser's child too)."""
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            for p in psutil.Process(self.proc.pid).children(recursive=True):
                p.kill()
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def users():
    """The test's Unix users (made, or reused where they exist), able to run the suite's Python; at the end every
    process of theirs is killed and shown gone, the modes put back."""
    for name in USERS:
        if subprocess.run(["id", "-u", name], capture_output=True).returncode != 0:
            subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", name], check=True)
    base = subprocess.run([str(PYTHON), "-c", "import sys; print(sys.base_prefix)"], capture_output=True, text=True,
                          check=True).stdout.strip()
    changed = let_others_traverse([ROOT / ".venv" / "bin", Path(os.path.realpath(PYTHON)), Path(base) / "lib" / "x",
                                   ROOT / "hvd_notebook"])
    try:
        yield USERS
    finally:
        for name in USERS:
            subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
        put_modes_back(changed)
        assert comes_within(lambda: not any(subprocess.run(["pgrep", "-u", n], capture_output=True).stdout
                                            for n in USERS), 10), "processes of the test's users still ran"


def _env(node: Path) -> dict[str, str]:
    return {"HVD_NOTEBOOK_GPUS": ",".join(GPUS), "HVD_NOTEBOOK_LEASE_DIR": str(node), "HVD_NOTEBOOK_STANDBY": "off"}


def _queued(node: Path, users: list[str]) -> bool:
    return [e.user for e in _waiting(node)] == users


@ROOT_ONLY
@pytest.mark.timeout(600)  # (four 1-rank clusters started one after the other, as the queue serves them: ~2 min)
def test_three_users_queuing_for_two_gpus_are_served_in_order(node, users):
    a, b, c = users[:3]
    holder = leases.acquire(GPUS, 2, "root's stand-in holding both GPUs")
    started: list[Process] = []
    try:
        a1 = Process(a, DRIVER, _env(node))
        started.append(a1)
        assert comes_within(lambda: _queued(node, [a]), 60), [e.user for e in _waiting(node)]
        b1 = Process(b, DRIVER, _env(node))
        started.append(b1)
        assert comes_within(lambda: _queued(node, [a, b]), 60), [e.user for e in _waiting(node)]
        holder.drop(["0"])  # one GPU free: the first to come is served
        first = a1.next(180)
        assert first["event"] == "started" and first["gpus"] == ["0"], first
        assert _queued(node, [b]) and not b1.has_answered()
        # a, who holds a GPU now, starts a second cluster, then c, who holds none: c queues before a
        a2 = Process(a, DRIVER, _env(node))
        started.append(a2)
        assert comes_within(lambda: _queued(node, [b, a]), 60), [e.user for e in _waiting(node)]
        c1 = Process(c, DRIVER, _env(node))
        started.append(c1)
        assert comes_within(lambda: _queued(node, [b, c, a]), 60), [e.user for e in _waiting(node)]
        holder.release()
        second = b1.next(180)
        assert second["gpus"] == ["1"] and _queued(node, [c, a]), second
        b1.send("stop")  # GPU 1 back: c's turn, not a's (a holds GPU 0)
        assert b1.next(60)["event"] == "stopped"
        third = c1.next(180)
        assert third["gpus"] == ["1"] and not a2.has_answered(), third
        a1.send("stop")
        assert a1.next(60)["event"] == "stopped"
        fourth = a2.next(180)
        assert fourth["gpus"] == ["0"] and not _waiting(node), fourth
        order = sorted([(first["t"], "a"), (second["t"], "b"), (third["t"], "c"), (fourth["t"], "a's second")])
        figure("Three users for two GPUs, served in order: " + ", ".join(who for _, who in order) + "\n"
               + "a's second start, as it waited:\n" + "".join(a2.stderr).strip())
        assert [who for _, who in order] == ["a", "b", "c", "a's second"]
        assert "you hold GPUs, so you queue behind those who hold none" in "".join(a2.stderr)
        for proc, answer in ((c1, third), (a2, fourth)):
            proc.send("stop")
            assert proc.next(60)["event"] == "stopped"
            assert_gone(answer["pids"])
    finally:
        holder.release()
        for proc in started:
            proc.end()


@ROOT_ONLY
def test_a_hostile_user_can_neither_jump_nor_jam_the_queue(node, users):
    victim, mallory_name = users[0], users[3]
    folder = node / "queue"
    holder = leases.acquire(["0"], 1, "root's stand-in holding GPU 0")
    mallory = Process(mallory_name, MALLORY, _env(node), str(folder), str(pwd.getpwnam(victim).pw_uid))
    started = [mallory]
    try:
        assert mallory.next(60)["event"] == "ready"
        time.sleep(1.1)  # (her entries are older by more than a ctime's grain)
        v1 = Process(victim, LEASER, _env(node))
        started.append(v1)
        assert comes_within(lambda: victim in [e.user for e in _waiting(node)], 60)
        line = _waiting(node)
        counted = [e.user for e in line]
        # her fake times and her word "holds no GPUs" are not taken: she holds GPU 1, so the victim comes first
        assert counted[0] == victim and counted.count(victim) == 1, counted
        assert counted.count(mallory_name) == queue.MAX_PER_UID, counted  # 200 entries, 4 count; no link, FIFO, huge
        entry = Path(line[0].path)
        mallory.send(f"remove {entry}")
        assert mallory.next(30)["answer"] == "Operation not permitted"
        assert entry.exists()  # the sticky folder: nobody removes another's entry
        holder.release()  # GPU 0 free: the victim is served at once, though her entries are older
        served = v1.next(30)
        assert served["gpus"] == ["0"], served
        # she lets GPU 1 go: her entries come first now, and never take their turn
        v1.end()
        holder = leases.acquire(["0"], 1, "root's stand-in holding GPU 0")
        mallory.send("release")
        assert mallory.next(30)["event"] == "released"
        t0 = time.time()
        v2 = Process(victim, LEASER, _env(node))
        started.append(v2)
        served = v2.next(queue.TURN_S + 60)
        waited = served["t"] - t0
        figure(f"The victim behind {queue.MAX_PER_UID} counted entries that never take their turn (of 200 planted) "
               f"was served after {waited:.1f} s (a turn is {queue.TURN_S:g} s)")
        assert served["gpus"] == ["1"] and waited < queue.TURN_S + 30, served
    finally:
        holder.release()
        for proc in started:
            proc.end()


# ------------------------------------------------------------------ the panel
@ROOT_ONLY
def test_the_panel_shows_the_queue_in_order(node, tmp_path):
    """JupyterLab's panel in a real browser: a section with each waiting start's place, user, GPUs wanted and
    since when, the user's own marked (nobody's entry: a process of uid 65534; root's: this test's process)."""
    import secrets
    import signal

    from conftest import artifacts_dir, browser_page, jupyter_lab
    from playwright.sync_api import sync_playwright

    built = ROOT / "hvd_notebook" / "lab" / "labextension" / "package.json"
    assert built.exists(), f"the JupyterLab extension is not built ({built} is missing): make install builds it"
    nobody = 65534
    waiter = subprocess.Popen(["sleep", "300"], user=nobody, group=nobody, start_new_session=True)
    try:
        for uid, pid, gpus in ((nobody, waiter.pid, 2), (os.geteuid(), os.getpid(), 1)):
            path = node / "queue" / f"wait-{uid}-{pid}-{secrets.token_hex(8)}.json"
            path.write_text(json.dumps({"pid": pid, "pid_started": psutil.Process(pid).create_time(), "gpus": gpus}))
            os.chown(path, uid, uid)
            time.sleep(0.05)
        with jupyter_lab(tmp_path, {}, {"HVD_NOTEBOOK_LEASE_DIR": str(node)}) as lab, sync_playwright() as pw:
            browser, page = browser_page(pw, 1200, 800)
            try:
                page.goto(f"{lab['url']}/lab?token={lab['token']}")
                page.wait_for_function("() => !!window.jupyterapp?.commands.hasCommand('hvd-notebook:open-panel')",
                                       timeout=90_000)
                page.evaluate("() => window.jupyterapp.restored.then(() => null)")
                page.evaluate("() => window.jupyterapp.commands.execute('hvd-notebook:open-panel')")
                page.wait_for_selector("#hvd-notebook-panel .hvd-queue-entry", timeout=60_000)
                lines = page.locator("#hvd-notebook-panel .hvd-queue-entry").all_inner_texts()
                mine = page.locator("#hvd-notebook-panel .hvd-queue-mine").all_inner_texts()
                page.screenshot(path=str(artifacts_dir() / "jupyterlab-panel-queue.png"))
            finally:
                browser.close()
    finally:
        os.killpg(waiter.pid, signal.SIGKILL)
        waiter.wait()
    figure("The panel's queue for GPUs:\n" + "\n".join(lines))
    assert len(lines) == 2 and re.fullmatch(r"1\. nobody: 2 GPUs, waiting since \d\d:\d\d", lines[0]), lines
    assert re.fullmatch(r"2\. root \(you\): 1 GPU, waiting since \d\d:\d\d", lines[1]) and mine == lines[1:], lines
