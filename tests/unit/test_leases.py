"""GPU leases (cluster.leases) and the node's register of clusters (cluster.registry) among strangers, on
real flocks, real files and, where the run is root's, a real second Unix user: the lease folder is the one
``hvd-notebook setup-node`` makes; a folder someone else owns or others may write is refused; a lock file
that is a link is not followed; bad cards (a FIFO, wrong types, a huge sparse file, one whose owner is not
the uid of its name) are skipped with one warning each while the good ones are read; and leasing between
two users works with ``fs.protected_regular`` and ``fs.protected_symlinks`` at 0, 1 and 2.

The second user's side runs in a child forked from this process that drops to that user's uid and gid
(``setresuid``: the kernel then treats it as that user in every check): this suite's interpreter may lie
under /root (0700), which a process started afresh as another user (``runuser``) cannot reach without
changing /root's mode while other test runs use it."""

from __future__ import annotations

import json
import logging
import os
import pwd
import stat
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from hvd_notebook.cli import format_node, main
from hvd_notebook.cluster.node import leases, policy, registry
from hvd_notebook.private import user_name

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates a second Unix user (useradd) and "
                               "acts as it; the suite's root run covers it")
SYSCTLS = ("protected_regular", "protected_symlinks")


@pytest.fixture
def shared_tmp():
    """A folder every user can reach (pytest's own tmp_path is its user's only), removed afterwards."""
    path = Path(tempfile.mkdtemp(prefix="hvd-leases-"))
    path.chmod(0o755)
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


@pytest.fixture
def node(shared_tmp, monkeypatch):
    """The node's lease folder for GPUs 0, 1 and 2, made as ``hvd-notebook setup-node`` makes it."""
    folder = shared_tmp / "leases"
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(folder))
    said = leases.setup_node(["0", "1", "2"])
    assert f"made {folder / 'gpu0.lock'} (mode 0644)" in said and f"made {folder / 'register'}" in said[-1]
    return folder


@pytest.fixture(scope="module")
def stranger():
    """A second Unix user (a system account, no home), removed afterwards: (uid, gid, name)."""
    name = f"hvdt-lease{os.getpid() % 100000}"
    subprocess.run(["userdel", name], capture_output=True)  # (a run killed before its clean-up)
    subprocess.run(["useradd", "-r", "-M", "-U", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True)
    try:
        entry = pwd.getpwnam(name)
        yield entry.pw_uid, entry.pw_gid, name
    finally:
        subprocess.run(["userdel", name], capture_output=True)


@contextmanager
def as_user(user, job, hold: bool = False):
    """Run ``job()`` in a child forked from this process that becomes ``user`` (uid, gid, name); yields
    what it returned (a JSON value; an exception's text as {"error": ...}). With ``hold`` the child waits,
    with what ``job`` made still held (a lease), until the block ends."""
    uid, gid, _ = user
    out_r, out_w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 1
        try:
            os.close(out_r)
            os.close(go_w)
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            try:
                result = job()
                kept, result = (result if isinstance(result, tuple) else (None, result))
            except Exception as exc:  # noqa: BLE001 (reported to the parent)
                kept, result = None, {"error": f"{type(exc).__name__}: {exc}"}
            os.write(out_w, json.dumps(result).encode() + b"\n")
            if hold:
                os.read(go_r, 1)
            code = 0
            del kept  # (held until here)
        finally:
            os._exit(code)
    os.close(out_w)
    os.close(go_r)
    try:
        with os.fdopen(out_r, "rb") as f:
            line = f.readline()
        assert line, "the child acting as the other user died"
        yield json.loads(line)
    finally:
        os.close(go_w)
        os.waitpid(pid, 0)


def _lease(gpus, n):
    """A job for ``as_user``: lease ``n`` of ``gpus``; the lease (kept) and its GPUs."""
    lease = leases.acquire(gpus, n, "test")
    return lease, lease.gpus


def _lease_once(gpus, n) -> list[str]:
    """The GPUs a lease of ``n`` of ``gpus`` gets, released at once."""
    lease = leases.acquire(gpus, n, "test")
    lease.release()
    return lease.gpus


# ------------------------------------------------------------------ leases
def test_acquire_release_and_holders_over_real_flocks(node, sleeper):
    lease = leases.acquire(["0", "1", "2"], 2, "kernel 1, hvd-1-1")
    me = user_name()
    try:
        assert lease.gpus == ["0", "1"]
        assert {g: pid for g, (pid, _) in leases.holders().items()} == {"0": os.getpid(), "1": os.getpid()}
        assert leases.holders()["0"][1] == f"{me} (pid {os.getpid()})"  # who: the holder's process, not a file
        _write_card(psutil.Process(), gpus=["0", "1"])  # with the holder's card: which cluster, since when
        assert leases.holders()["1"][1].startswith(f"{me} (kernel {os.getpid()}, hvd-{os.getpid()}-1, since ")
        registry.remove()
        with pytest.raises(leases.LeaseError) as caught:
            leases.acquire(["0", "1", "2"], 2, "another")
        assert "-n 2 needs 2 GPU(s), but only 1 of this host's 3 (2) are free" in str(caught.value)
        assert f"GPU 0 by {me} (pid {os.getpid()}); GPU 1 by {me}" in str(caught.value)
        assert leases.holders().keys() == {"0", "1"}  # a refused lease holds nothing
        assert _lease_once(["0", "1", "2"], None) == ["2"]  # one rank per free GPU
    finally:
        lease.release()
    assert leases.holders() == {}
    assert all(p.stat().st_size == 0 and stat.S_IMODE(p.stat().st_mode) == 0o644 for p in node.glob("gpu*.lock"))


def test_a_lease_ends_with_its_process(node):
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from hvd_notebook.cluster.node import leases; "
                               "l = leases.acquire(['0'], 1, 'x'); print(l.gpus, flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "['0']"
        assert leases.holders()["0"][0] == holder.pid
    finally:
        holder.kill()
        holder.wait()
    assert _lease_once(["0"], 1) == ["0"]


def test_a_folder_others_may_write_or_a_link_is_refused(shared_tmp, monkeypatch):
    open_folder = shared_tmp / "open"
    open_folder.mkdir()
    open_folder.chmod(0o1777)  # today's layout: anyone may plant lock files
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(open_folder))
    with pytest.raises(leases.LeaseDirError) as caught:
        leases.acquire(["0"], 1, "test")
    assert str(open_folder) in str(caught.value) and "mode 1777" in str(caught.value)
    assert "`sudo hvd-notebook setup-node`" in str(caught.value)
    assert list(open_folder.iterdir()) == []  # nothing was made in it
    link = shared_tmp / "link"
    link.symlink_to(open_folder)
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(link))
    with pytest.raises(leases.LeaseDirError, match="a symbolic link"):
        leases.acquire(["0"], 1, "test")
    with pytest.raises(leases.LeaseDirError):
        registry.read_all(strict=True)  # the register in it is not read either: the caps say so
    with pytest.raises(leases.LeaseError, match="a symbolic link"):
        policy.Policy(max_cpu_ranks_per_user=2).room(gpus=False, asked=1)
    assert registry.read_all() == []  # (clean goes on, with a warning)
    assert main(["list", "--all"]) == 2  # an error, not a traceback


def test_a_machine_with_one_user_gets_its_folder_made(shared_tmp, monkeypatch):
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(shared_tmp / "mine"))
    assert leases.holders() == {} and registry.read_all() == [] and not (shared_tmp / "mine").exists()
    lease = leases.acquire(["0", "1"], 2, "test")  # the first lease makes the folder, and its lock files
    lease.release()
    st = (shared_tmp / "mine").stat()
    assert st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) == 0o755
    assert sorted(p.name for p in (shared_tmp / "mine").iterdir()) == ["gpu0.lock", "gpu1.lock"]


def test_a_lock_file_that_is_a_link_or_a_fifo_is_not_used(shared_tmp, monkeypatch):
    folder = shared_tmp / "mine"
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(folder))
    leases.setup_node(["0"])
    target = shared_tmp / "precious"
    target.write_text("keep me\n")
    target.chmod(0o600)
    (folder / "gpu1.lock").symlink_to(target)
    os.mkfifo(folder / "gpu2.lock")
    t0 = time.monotonic()
    with pytest.raises(leases.LeaseError, match="gpu1.lock is not a lock file .*not followed"):
        leases.acquire(["1"], 1, "test")
    with pytest.raises(leases.LeaseError, match="gpu2.lock is a FIFO"):
        leases.acquire(["2"], 1, "test")
    assert time.monotonic() - t0 < 15  # the FIFO did not hang the lease (for ever: not a speed, the load varies)
    assert target.read_text() == "keep me\n" and stat.S_IMODE(target.stat().st_mode) == 0o600  # untouched
    said = leases.setup_node(["0", "1", "2"])  # setup-node replaces both
    assert any(line.startswith(f"removed {folder / 'gpu1.lock'}: it was a symbolic link") for line in said), said
    assert _lease_once(["1", "2"], 2) == ["1", "2"]
    assert target.read_text() == "keep me\n"


def test_setup_node_moves_aside_a_folder_it_cannot_trust(shared_tmp, monkeypatch):
    folder = shared_tmp / "leases"
    folder.mkdir()
    folder.chmod(0o1777)
    (folder / "gpu0.lock").symlink_to(shared_tmp / "elsewhere")
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(folder))
    said = leases.setup_node(["0"])
    assert said[0].startswith(f"moved {folder} aside to {folder}.moved-") and "mode 1777" in said[0], said
    aside = Path(said[0].split(" aside to ")[1].split(":")[0])
    assert (aside / "gpu0.lock").is_symlink() and not (shared_tmp / "elsewhere").exists()
    st = folder.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o755)
    assert stat.S_IMODE((folder / "register").stat().st_mode) == 0o1777
    assert _lease_once(["0"], 1) == ["0"]


def test_setup_node_command_is_roots(node, capsys, monkeypatch):
    if os.geteuid() != 0:
        assert main(["setup-node", "--gpus", "0"]) == 2
        assert "only root makes the node's lease folder" in capsys.readouterr().err
        return
    assert main(["setup-node", "--gpus", "0,1,2,3"]) == 0
    out = capsys.readouterr().out
    assert f"made {node / 'gpu3.lock'} (mode 0644)" in out and f"{node / 'gpu0.lock'}: kept" in out
    assert f"is ready for GPU(s) 0,1,2,3. Give every kernel HVD_NOTEBOOK_LEASE_DIR={node}" in out


@ROOT_ONLY
def test_a_folder_of_another_user_is_refused_and_a_stranger_leases_in_roots(shared_tmp, monkeypatch, stranger):
    shared_tmp.chmod(0o1777)  # as /tmp: anyone may make the lease folder first
    folder = shared_tmp / "leases"
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(folder))
    with as_user(stranger, lambda: (None, leases.acquire(["0"], 1, "x").gpus)) as made:  # made first, by them
        assert made == ["0"]
    assert folder.stat().st_uid == stranger[0]
    with pytest.raises(leases.LeaseDirError) as caught:
        leases.acquire(["0"], 1, "test")
    assert f"{folder} is a directory owned by {stranger[2]} (uid {stranger[0]})" in str(caught.value)
    assert "`sudo hvd-notebook setup-node`" in str(caught.value)
    said = leases.setup_node(["0", "1"])
    assert said[0].startswith(f"moved {folder} aside") and stranger[2] in said[0], said
    # in root's folder the stranger leases (opening root's lock files read-only) but makes none
    with as_user(stranger, lambda: _lease(["0", "1", "2"], None)) as got:
        assert got == {"error": f"LeaseError: GPU 2 has no lock file ({folder / 'gpu2.lock'}) in the node's lease "
                                "folder, which is root's: the admin runs `sudo hvd-notebook setup-node --gpus ...` "
                                "naming every GPU of the node."}
    with as_user(stranger, lambda: _lease(["0", "1"], 1), hold=True) as got:
        assert got == ["0"]
        (pid, who), = leases.holders().values()
        assert who == f"{stranger[2]} (pid {pid})"
        me = psutil.Process()
        card = registry.Card(cluster="hvd-root-claims-it", workdir="", kernel=pid, kernel_started=me.create_time(),
                             ranks=1, gpus=["0"])
        (folder / "register" / f"cluster-0-{pid}.json").write_text(json.dumps(card.__dict__ | {"user": "", "path": ""}))
        assert leases.holders()["0"][1] == f"{stranger[2]} (pid {pid})"  # root's card does not claim their lease
        with pytest.raises(leases.LeaseError, match=f"GPU 0 by {stranger[2]}"):
            leases.acquire(["0"], 1, "test")
        assert _lease_once(["0", "1"], 1) == ["1"]
    assert _lease_once(["0"], 1) == ["0"]
    assert all(p.stat().st_uid == 0 for p in folder.glob("gpu*.lock"))


@ROOT_ONLY
@pytest.mark.parametrize("levels", [(0, 0), (1, 1), (2, 1)], ids=["0", "1", "2"])  # (protected_symlinks: 0 or 1)
def test_leasing_between_users_with_the_protected_sysctls(node, stranger, levels):
    """Before, the lock file was made by the first user to lease it in a sticky folder and opened with
    O_CREAT by the others, which fs.protected_regular >= 1 refuses: a GPU leased once was lost to the rest."""
    paths = [Path("/proc/sys/fs") / name for name in SYSCTLS]
    if not all(os.access(p, os.W_OK) for p in paths):
        pytest.skip("/proc/sys/fs/protected_regular and protected_symlinks cannot be set here")
    original = [p.read_text().strip() for p in paths]
    me = psutil.Process()

    def lease_and_card():
        lease = leases.acquire(["0", "1", "2"], 1, "x")
        registry.write(registry.Card(cluster="theirs", workdir="", kernel=os.getpid(),
                                     kernel_started=psutil.Process().create_time(), ranks=1, gpus=lease.gpus))
        return lease, lease.gpus

    try:
        for p, level in zip(paths, levels):
            p.write_text(str(level))
        with as_user(stranger, lease_and_card) as got:  # theirs first: the lock file of GPU 0 is used by them
            assert got == ["0"]
        assert _lease_once(["0"], 1) == ["0"]  # then root's, on the same file
        registry.write(registry.Card(cluster="roots", workdir="", kernel=me.pid, kernel_started=me.create_time(),
                                     ranks=1))
        registry.write(registry.Card(cluster="roots", workdir="", kernel=me.pid, kernel_started=me.create_time(),
                                     ranks=2))  # replaced in the sticky register
        with as_user(stranger, lambda: (None, sorted(c.cluster for c in registry.read_all()))) as seen:
            assert seen == ["roots", "theirs"]
        with as_user(stranger, lambda: _lease(["0"], 1)) as got:
            assert got == ["0"]
    finally:
        for p, value in zip(paths, original):
            p.write_text(value)
    assert [c.ranks for c in registry.read_all() if c.cluster == "roots"] == [2]


# ------------------------------------------------------------------ the register
def _write_card(proc, **fields) -> None:
    registry.write(registry.Card(cluster=f"hvd-{proc.pid}-1", workdir="", kernel=proc.pid,
                                 kernel_started=psutil.Process(proc.pid).create_time(), ranks=1, **fields))


def test_bad_cards_are_skipped_with_one_warning_and_readers_go_on(node, sleeper, caplog):
    _write_card(sleeper, gpus=["0"])
    register = node / "register"
    uid = os.geteuid()
    os.mkfifo(register / f"cluster-{uid}-1.json")  # would hang a reader that opens it plainly
    (register / f"cluster-{uid}-2.json").write_text(json.dumps(
        {"cluster": "c", "workdir": "", "kernel": 2, "kernel_started": 0, "ranks": "2", "started": "soon"}))
    (register / f"cluster-{uid}-3.json").write_text(json.dumps(
        {"cluster": "c", "workdir": "", "kernel": 3, "kernel_started": 0, "ranks": 1, "started": 1e308}))
    with open(register / f"cluster-{uid}-4.json", "wb") as f:  # 100 MiB, sparse: takes no disk, would fill memory
        f.truncate(100 << 20)
    other_uid = 0 if uid != 0 else 65534
    (register / f"cluster-{other_uid}-5.json").write_text(  # claims another user's name, but the file is ours
        (register / f"cluster-{uid}-{sleeper.pid}.json").read_text().replace(str(sleeper.pid), "5"))
    (register / f"cluster-{uid}-6.json").write_text("[" * 50000)  # nesting that overflows a recursive parser
    (register / f"cluster-{uid}-7.json").symlink_to(register / f"cluster-{uid}-{sleeper.pid}.json")
    (register / f"cluster-{uid}-8.json").write_text(  # another kernel's number than its name's
        (register / f"cluster-{uid}-{sleeper.pid}.json").read_text())
    bad = {f"cluster-{uid}-{i}.json" for i in (1, 2, 3, 4, 6, 7, 8)} | {f"cluster-{other_uid}-5.json"}
    caplog.set_level(logging.WARNING, logger="hvd_notebook.cluster.node.registry")
    t0 = time.monotonic()
    cards = registry.read_all()
    assert time.monotonic() - t0 < 15  # no reader hung on the FIFO (not a speed: the load varies)
    assert [(c.kernel, c.gpus) for c in cards] == [(sleeper.pid, ["0"])]
    warned = [r.getMessage() for r in caplog.records]
    assert sorted(m.split(" in the node's register")[0].rsplit("/", 1)[1] for m in warned) == sorted(bad)
    why = {m.split(" in the node's register")[0].rsplit("/", 1)[1]: m for m in warned}
    assert "is not a regular file" in why[f"cluster-{uid}-1.json"]
    assert "its ranks is '2', not a count" in why[f"cluster-{uid}-2.json"]
    assert "its started is '1e+308', not a time" in why[f"cluster-{uid}-3.json"]
    assert "104857600 bytes long" in why[f"cluster-{uid}-4.json"]
    assert "belongs to" in why[f"cluster-{other_uid}-5.json"]
    assert "is a symbolic link" in why[f"cluster-{uid}-7.json"]
    caplog.clear()
    t0 = time.monotonic()
    # every reader goes on: the caps, list --all, and a lease's message
    assert policy.Policy(max_gpus_per_user=2).room(gpus=True, asked=1) == 1  # the good card holds one
    lease = leases.acquire(["0"], 1, "test")
    try:
        text = format_node(registry.read_all(), leases.holders(), time.time())
    finally:
        lease.release()
    assert f"hvd-{sleeper.pid}-1" in text and "GPU 0: " in text
    assert time.monotonic() - t0 < 15  # none hung
    assert caplog.records == []  # one warning per card and process


def test_a_card_is_written_whole_and_never_through_a_link(node, sleeper, shared_tmp):
    target = shared_tmp / "precious"
    target.write_text("keep me\n")
    name = f"cluster-{os.geteuid()}-{sleeper.pid}.json"
    (node / "register" / name).symlink_to(target)
    _write_card(sleeper)
    assert target.read_text() == "keep me\n"
    path = node / "register" / name
    assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert [c.kernel for c in registry.read_all()] == [sleeper.pid]
    registry.remove(sleeper.pid)
    assert registry.read_all() == []
