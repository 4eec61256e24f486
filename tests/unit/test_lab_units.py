"""What bounds the panel's work on a node shared with strangers, on real files, real flocks and real processes:
the register read at most ``MAX_CARDS_PER_USER`` cards per owner and ``MAX_CARDS`` in all; a card alive only where
its kernel runs as the card's owner; a rank's process only where it is the one recorded, and this user's; a
lease lock matched by device and inode; ``/proc/locks`` searched, not parsed whole, and its kept lines capped;
bad cards warned about for a bounded number of files; the policy file read like every shared file; one reading
in flight per server. (The same as a real second user, through a real Jupyter server:
integration/test_lab_hostile.py.)"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import subprocess
import threading
import time
from pathlib import Path

import psutil
import pytest

from hvd_notebook.cluster.node import leases, policy, registry
from hvd_notebook.lab import handlers
from hvd_notebook.lab.readings import Readings

ROOT = os.geteuid() == 0


@pytest.fixture
def node(tmp_path, monkeypatch):
    """The node's lease folder for GPU 0, made as ``hvd-notebook setup-node`` makes it (this user's here)."""
    folder = tmp_path / "leases"
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(folder))
    leases.setup_node(["0"])
    return folder


def _card(register: Path, uid: int, kernel: int, size: int = 0, owner: int | None = None) -> Path:
    """A valid card file of ``uid`` for ``kernel`` (padded to about ``size`` bytes), given to ``owner``."""
    path = register / f"cluster-{uid}-{kernel}.json"
    data = {"cluster": f"hvd-{kernel}-1", "workdir": "", "kernel": kernel, "kernel_started": 1.0e9, "ranks": 2,
            "gpus": [], "started": 1.0e9 + kernel, "last_cell": 1.0e9, "busy": False}
    text = json.dumps(data)
    if size > len(text):
        data["workdir"] = "x" * min(4000, size - len(text))
        data["gpus"] = ["g" * 60] * max(0, (size - len(text) - 4000) // 64)
        text = json.dumps(data)
    path.write_text(text)
    if owner is not None:
        os.chown(path, owner, owner)
    return path


@pytest.fixture
def stranger_process():
    """A real process of another uid: ``sleep`` as nobody (65534) where this run is root's, else init (pid 1,
    root's)."""
    if not ROOT:
        yield psutil.Process(1)
        return
    proc = subprocess.Popen(["sleep", "60"], preexec_fn=lambda: (os.setgid(65534), os.setuid(65534)))
    yield psutil.Process(proc.pid)
    proc.kill()
    proc.wait()


# ------------------------------------------------------------------ the register's caps
def test_the_register_reads_at_most_its_cap_of_cards_per_owner(node):
    register = node / "register"
    me = os.geteuid()
    for kernel in range(1000, 1040):
        _card(register, me, kernel)
    cards = registry.read_all()
    assert len(cards) == registry.MAX_CARDS_PER_USER == 16
    assert sorted(c.kernel for c in cards) == list(range(1000, 1016))  # (the first by kernel pid: the same each time)


def test_the_register_reads_at_most_its_total_cap(node, monkeypatch):
    register = node / "register"
    me = os.geteuid()
    for kernel in range(1000, 1012):
        _card(register, me, kernel)
    monkeypatch.setattr(registry, "MAX_CARDS", 5)
    assert len(registry.read_all()) == 5


@pytest.mark.skipif(not ROOT, reason="gives cards to other uids (chown): needs root; the suite's root run covers it")
def test_many_owners_read_their_cap_each_and_the_readers_own_first(node):
    register = node / "register"
    register.chmod(0o1777)
    me = os.geteuid()
    for kernel in range(5000, 5003):
        _card(register, me, kernel)
    owners = range(200000, 200020)  # 20 uids of 20 cards: more than MAX_CARDS in all
    for uid in owners:
        for kernel in range(1000, 1020):
            _card(register, uid, kernel, owner=uid)
    cards = registry.read_all()
    assert len(cards) == registry.MAX_CARDS == 256
    assert sum(c.uid == me for c in cards) == 3  # (the reader's own, whatever the others planted)
    per_owner = {uid: sum(c.uid == uid for c in cards) for uid in owners}
    assert max(per_owner.values()) == registry.MAX_CARDS_PER_USER, per_owner


def test_a_card_is_alive_only_where_its_kernel_runs_as_the_cards_owner(node, stranger_process, sleeper):
    register = node / "register"
    me = os.geteuid()
    theirs = stranger_process
    card = _card(register, me, theirs.pid)  # a card of mine that names another uid's process
    card.write_text(card.read_text().replace("1000000000.0, \"ranks\"", f"{theirs.create_time()}, \"ranks\""))
    mine = _card(register, me, sleeper.pid)
    mine.write_text(mine.read_text().replace("1000000000.0, \"ranks\"",
                                             f"{psutil.Process(sleeper.pid).create_time()}, \"ranks\""))
    alive = {c.kernel: c.kernel_alive for c in registry.read_all()}
    assert alive == {theirs.pid: False, sleeper.pid: True}, alive


# ------------------------------------------------------------------ rank rows
def test_a_rank_row_reads_only_the_recorded_process_of_this_user(sleeper, stranger_process):
    readings = Readings()
    mine = psutil.Process(sleeper.pid)
    first, again = readings._process(mine.pid, mine.create_time()), readings._process(mine.pid, mine.create_time())
    assert first[0] is not None and first[1] and again == (first[0], False)  # (kept: its CPU share counts from then)
    assert readings._process(mine.pid, mine.create_time() - 5)[0] is None  # a reused pid: no one's rank
    assert readings._process(mine.pid, None)[0] is None  # never recorded
    theirs = stranger_process
    assert readings._process(theirs.pid, theirs.create_time())[0] is None  # another user's: shown as nothing


# ------------------------------------------------------------------ leases: the lock table
def _held(path: Path) -> tuple[int, tuple[int, int]]:
    """A real exclusive flock on ``path`` (made): its descriptor and the file's (device, inode)."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    st = os.fstat(fd)
    return fd, (st.st_dev, st.st_ino)


def test_a_lock_counts_only_on_the_files_device_and_inode(tmp_path):
    fd, (dev, ino) = _held(tmp_path / "gpu0.lock")
    try:
        assert leases.lock_holders({(dev, ino)}) == {(dev, ino): os.getpid()}  # the real table
        other = os.makedev(0, 99) if dev != os.makedev(0, 99) else os.makedev(0, 98)
        table = tmp_path / "locks"
        table.write_text(f"1: FLOCK  ADVISORY  WRITE 4242 {os.major(other):02x}:{os.minor(other):02x}:{ino} 0 EOF\n"
                         f"2: FLOCK  ADVISORY  WRITE 4243 {os.major(dev):02x}:{os.minor(dev):02x}:{ino + 1} 0 EOF\n")
        assert leases.lock_holders({(dev, ino)}, str(table)) == {}  # the same inode on another device: not ours
        table.write_text(table.read_text() + f"3: FLOCK  ADVISORY  WRITE 4244 {os.major(dev):02x}:"
                                             f"{os.minor(dev):02x}:{ino} 0 EOF\n")
        assert leases.lock_holders({(dev, ino)}, str(table)) == {(dev, ino): 4244}
    finally:
        os.close(fd)
    assert leases.lock_holders({(dev, ino)}) == {}


def test_the_lock_table_is_searched_in_chunks_and_its_kept_lines_capped(tmp_path, monkeypatch):
    dev, ino = os.makedev(254, 0), 777
    ours = f"FLOCK  ADVISORY  WRITE 4242 fe:00:{ino} 0 EOF"
    noise = "".join(f"{i}: FLOCK  ADVISORY  WRITE {i} fe:00:{100000 + i} 0 EOF\n" for i in range(200000))
    table = tmp_path / "locks"
    table.write_text(noise + f"1: {ours}\n")  # (about 9 MB of others' locks before ours)
    monkeypatch.setattr(leases, "LOCKS_CHUNK", 4093)  # (lines cut at a chunk's end, all along)
    t0 = time.monotonic()
    assert leases.lock_holders({(dev, ino)}, str(table)) == {(dev, ino): 4242}
    assert time.monotonic() - t0 < 10  # (for ever would be a hang; not a speed: the load varies)
    monkeypatch.setattr(leases, "LOCKS_CHUNK", len(noise) + 20)  # (a chunk's end in the middle of our line)
    assert leases.lock_holders({(dev, ino)}, str(table)) == {(dev, ino): 4242}
    flood = table.read_text() + "".join(f"{i}: -> {ours}\n" for i in range(3 * leases.MAX_LOCK_LINES))
    table.write_text(flood)
    kept = leases._lines_naming(str(table), [b" fe:00:%d " % ino])
    assert len(kept) == leases.MAX_LOCK_LINES and kept[0] == f"1: {ours}".encode()


# ------------------------------------------------------------------ warnings
def test_bad_cards_are_warned_about_for_a_bounded_number_of_files(node, monkeypatch, caplog):
    monkeypatch.setattr(registry, "_warned", set())
    monkeypatch.setattr(registry, "MAX_WARNED", 5)
    for kernel in range(1000, 1020):
        (node / "register" / f"cluster-{os.geteuid()}-{kernel}.json").write_text("not a card")
    caplog.set_level(logging.WARNING, logger="hvd_notebook.cluster.node.registry")
    assert registry.read_all() == []
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 6 and "more than 5 bad files" in warned[-1], warned
    assert len(registry._warned) == 6
    caplog.clear()
    assert registry.read_all() == [] and caplog.records == []  # (and never again)


# ------------------------------------------------------------------ the policy file
def test_the_policy_file_is_read_as_every_shared_file(tmp_path):
    good = tmp_path / "policy.toml"
    good.write_text("max_gpus_per_user = 2\n")
    assert policy.load({"HVD_NOTEBOOK_POLICY_FILE": str(good)}, tmp_path / "absent").max_gpus_per_user == 2
    link = tmp_path / "link.toml"
    link.symlink_to(good)
    with pytest.raises(policy.PolicyError, match="is a symbolic link; it was not followed"):
        policy.load({}, link)
    huge = tmp_path / "huge.toml"
    with open(huge, "wb") as f:
        f.truncate(policy.MAX_FILE_BYTES + 1)
    with pytest.raises(policy.PolicyError, match="bytes long"):
        policy.load({}, huge)
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    caught: list[BaseException] = []
    reader = threading.Thread(target=lambda: caught.append(pytest.raises(policy.PolicyError, policy.load, {}, fifo)),
                              daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():
        with open(fifo, "w"):  # (lets the hung reader go)
            pass
        pytest.fail("the policy file's reader hung on a FIFO")
    assert "is not a regular file" in str(caught[0].value)
    if ROOT:  # (another user's file: only root can make one)
        os.chown(good, 65534, 65534)
        with pytest.raises(policy.PolicyError, match="belongs to .* not to root or you"):
            policy.load({}, good)


# ------------------------------------------------------------------ one reading in flight
class _Counted(Readings):
    """The real readings, slowed, counting the readings made."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds, self.made = seconds, 0

    def snapshot(self, kernels):
        self.made += 1
        time.sleep(self.seconds)
        return super().snapshot(kernels)


def test_one_reading_is_in_flight_and_a_request_that_gives_up_leaves_none_behind(node, monkeypatch):
    async def scenario() -> tuple[int, int, int]:
        readings = _Counted(1.0)
        snapshots = handlers.Snapshots(readings)
        answers = await asyncio.gather(*(snapshots.latest({}) for _ in range(8)))
        together = readings.made
        monkeypatch.setattr(handlers, "SNAPSHOT_WITHIN_S", 0.2)
        for _ in range(3):  # (each gives up, as a browser that went away; the next awaits the same reading)
            with pytest.raises(TimeoutError):
                await snapshots.latest({})
        given_up = readings.made
        monkeypatch.setattr(handlers, "SNAPSHOT_WITHIN_S", 20.0)
        await snapshots.latest({})
        assert all(a is answers[0] for a in answers)
        return together, given_up, readings.made

    together, given_up, after = asyncio.run(scenario())
    assert (together, given_up) == (1, 2), (together, given_up)
    assert after in (2, 3)  # (the abandoned one, then perhaps a fresh one: never one per request)


def test_a_server_warns_once_of_rules_it_cannot_read(node, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("HVD_NOTEBOOK_POLICY_FILE", str(tmp_path / "missing.toml"))
    caplog.set_level(logging.WARNING, logger="hvd_notebook.lab.readings")
    readings = Readings()
    for _ in range(3):  # (a poll every 1.5 s: the log says it once)
        assert readings.snapshot({})["caps"]["max_gpus_per_user"] is None
    assert [r.getMessage() for r in caplog.records if "rules could not be read" in r.getMessage()] == [
        f"hvd_notebook: the node's rules could not be read: The policy file {tmp_path / 'missing.toml'} cannot be "
        "read (No such file or directory); ask the node's admin."]
