"""The node's queue for GPUs (cluster/node/queue.py): the order it serves in (first come, first served; a user
who holds GPUs behind one who holds none; strict at the head; a served waiter that does not take its turn loses
it), and what counts as an entry (the owner from the file, the time from its ctime, a live process, a cap per
uid; links, FIFOs, huge and bad files skipped), on real files and real processes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hvd_notebook.cluster.node import leases, queue
from hvd_notebook.cluster.node.queue import Entry, Turns, ranked
from hvd_notebook.private import user_name


def _entry(uid: int, since: float, gpus: int = 1, pid: int = 100) -> Entry:
    return Entry(uid=uid, pid=pid, gpus=gpus, since=since, path=f"/q/wait-{uid}-{pid}-{since}")


def test_first_come_first_served_but_holders_queue_behind_those_who_hold_none():
    alice, bob, carol = _entry(1001, 10.0), _entry(1002, 20.0), _entry(1003, 30.0)
    assert ranked([carol, alice, bob], holding=set()) == [alice, bob, carol]
    assert ranked([carol, alice, bob], holding={1001}) == [bob, carol, alice]  # alice holds GPUs: last
    assert ranked([carol, alice, bob], holding={1001, 1003}) == [bob, alice, carol]  # by time among holders


def test_the_head_is_served_strictly_so_small_requests_never_starve_a_big_one():
    big, small = _entry(1001, 10.0, gpus=2), _entry(1002, 20.0, gpus=1)
    turns = Turns()
    assert turns.head([big, small], free=1, total=2, now=100.0) is big  # one free: small must wait behind big
    assert turns.head([big, small], free=2, total=2, now=101.0) is big  # big's turn
    assert turns.head([small], free=1, total=2, now=102.0) is small
    too_big = _entry(1003, 5.0, gpus=3)  # wants more than the node has: never served, so passed over
    assert turns.head([too_big, small], free=1, total=2, now=103.0) is small


def test_a_served_waiter_that_does_not_take_its_turn_loses_its_place():
    stuck, next_one = _entry(1001, 10.0), _entry(1002, 20.0)
    turns = Turns()
    assert turns.head([stuck, next_one], free=1, total=2, now=100.0) is stuck
    assert turns.head([stuck, next_one], free=1, total=2, now=100.0 + queue.TURN_S - 1) is stuck
    assert turns.head([stuck, next_one], free=1, total=2, now=100.0 + queue.TURN_S + 1) is next_one
    assert turns.lost(stuck)
    assert turns.head([stuck, next_one], free=2, total=2, now=100.0 + queue.TURN_S + 2) is next_one  # lost for good
    # a turn counts only while the GPUs are free for it: a wait for GPUs is not a lost turn
    waits = Turns()
    assert waits.head([stuck], free=1, total=2, now=0.0) is stuck
    assert waits.head([stuck], free=0, total=2, now=queue.TURN_S + 5) is stuck
    assert waits.head([stuck], free=1, total=2, now=queue.TURN_S + 6) is stuck
    # a user's other entries made until then go with it: a flood of entries costs others one turn's time
    flood = [_entry(1001, 11.0 + i, pid=200 + i) for i in range(3)]
    turns = Turns()
    assert turns.head([stuck, *flood, next_one], free=1, total=2, now=0.0) is stuck
    assert turns.head([stuck, *flood, next_one], free=1, total=2, now=queue.TURN_S + 1) is next_one
    assert not turns.lost(_entry(1001, queue.TURN_S + 2))  # a later entry of theirs queues again, at the back
    # this process's own entry never loses its place in its own view
    assert Turns().head([stuck], free=1, total=2, now=0.0, me=stuck.key) is stuck


@pytest.mark.parametrize("data, why", [
    ([1, 2], "JSON object"), ({"pid": True, "pid_started": 1.0, "gpus": 1}, "pid"),
    ({"pid": 5, "pid_started": 1.0, "gpus": 0}, "gpus"), ({"pid": 5, "pid_started": 1.0, "gpus": 10**6}, "gpus"),
    ({"pid": 5, "pid_started": "x", "gpus": 1}, "pid_started"), ({"pid": 5, "gpus": 1}, "pid_started"),
    ({"pid": 2**40, "pid_started": 1.0, "gpus": 1}, "pid"),
])
def test_bad_entries_are_refused_saying_why(data, why):
    with pytest.raises(queue.BadEntry, match=why):
        queue.parse_entry(data, 1001, 5.0, "/q/x")


def test_an_entry_takes_its_owner_from_the_file_and_its_time_from_the_ctime():
    entry, started = queue.parse_entry({"pid": 5, "pid_started": 7.5, "gpus": 2, "uid": 0, "since": 0}, 1001, 9.0,
                                       "/q/x")
    assert (entry.uid, entry.since, entry.gpus, started) == (1001, 9.0, 2, 7.5)  # (the file's "uid", "since": not used)


def _write(folder: Path, pid: int, started: float, gpus: int = 1, uid: int | None = None, token: str = "") -> Path:
    uid = os.geteuid() if uid is None else uid
    path = folder / f"wait-{uid}-{pid}-{(token or os.urandom(8).hex()):0>16}.json"
    path.write_text(json.dumps({"pid": pid, "pid_started": started, "gpus": gpus}))
    return path


@pytest.fixture
def sleeper():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield psutil.Process(proc.pid)
    proc.kill()
    proc.wait()


def test_only_live_processes_entries_count_and_a_faked_earlier_time_does_not_jump(tmp_path, sleeper):
    me = psutil.Process()
    first = _write(tmp_path, me.pid, me.create_time())
    time.sleep(0.05)
    later = _write(tmp_path, sleeper.pid, sleeper.create_time())
    os.utime(later, (1.0, 1.0))  # an mtime of 1970 is no earlier place
    _write(tmp_path, sleeper.pid, sleeper.create_time() - 50)  # not that process: its pid was reused
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    _write(tmp_path, int(dead.stdout), time.time())  # a process that has ended
    _write(tmp_path, me.pid, me.create_time(), uid=os.geteuid() + 4242)  # a name claiming another uid
    entries = queue.read_entries(tmp_path)
    assert [e.path for e in ranked(entries, set())] == [str(first), str(later)]
    assert entries[1].since >= entries[0].since > time.time() - 60


def test_links_fifos_huge_and_bad_files_are_skipped_and_a_uid_counts_four(tmp_path):
    me = psutil.Process()
    target = _write(tmp_path, me.pid, me.create_time(), token="1")
    (tmp_path / f"wait-{os.geteuid()}-{me.pid}-{'2':0>16}.json").symlink_to(target)
    os.mkfifo(tmp_path / f"wait-{os.geteuid()}-{me.pid}-{'3':0>16}.json")
    huge = tmp_path / f"wait-{os.geteuid()}-{me.pid}-{'4':0>16}.json"
    with open(huge, "wb") as f:
        f.truncate(1 << 30)  # sparse: a gigabyte that is never read
    (tmp_path / f"wait-{os.geteuid()}-{me.pid}-{'5':0>16}.json").write_text("{not json")
    assert [e.path for e in queue.read_entries(tmp_path)] == [str(target)]
    for _ in range(10):
        _write(tmp_path, me.pid, me.create_time())
    assert len(queue.read_entries(tmp_path)) == queue.MAX_PER_UID
    assert str(target) in [e.path for e in queue.read_entries(tmp_path)]  # the oldest count


@pytest.fixture
def node(tmp_path, monkeypatch):
    folder = tmp_path / "leases"
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(folder))
    said = leases.setup_node(["0", "1"])
    assert f"made {folder / 'queue'} (the queue for GPUs, mode 1777)" in said
    assert (folder / "queue").stat().st_mode & 0o7777 == 0o1777
    monkeypatch.setattr(queue, "_TURNS", Turns())
    return folder


def test_enqueue_caps_a_user_and_clears_their_dead_entries(node, sleeper):
    folder = node / "queue"
    dead = _write(folder, 2**22 + 7, time.time())  # (no such pid)
    paths = [queue.enqueue(1) for _ in range(queue.MAX_PER_UID)]
    assert not dead.exists()
    with pytest.raises(queue.LeaseError, match="starts waiting for GPUs already"):
        queue.enqueue(1)
    assert not queue.someone_waits()  # this process's own entries are not someone else
    for path in paths:
        queue.leave(path)
    _write(folder, sleeper.pid, sleeper.create_time())
    assert queue.someone_waits()


def test_no_wait_fails_as_before_where_the_gpus_are_taken_and_a_free_start_is_served_at_once(node):
    held = leases.acquire(["0", "1"], 2, "test")
    try:
        with pytest.raises(queue.LeaseError, match="needs 1 GPU.*Held: GPU 0 by"):
            queue.acquire(["0", "1"], 1, "test", wait=False)
    finally:
        held.release()
    lease = queue.acquire(["0", "1"], 1, "test", wait=False)
    assert lease.gpus == ["0"] and not list((node / "queue").iterdir())
    lease.release()


def test_no_wait_does_not_jump_the_queue(node, sleeper):
    _write(node / "queue", sleeper.pid, sleeper.create_time())  # another start waits first
    with pytest.raises(queue.LeaseError, match="1 start.s. wait in the node's queue for GPUs before this one"):
        queue.acquire(["0", "1"], 1, "test", wait=False)


def test_preempt_idle_after_is_a_policy_rule_whose_tightest_source_wins(tmp_path):
    from hvd_notebook.cluster.node import policy

    system = tmp_path / "policy.toml"
    system.write_text('preempt_idle_after = "10m"\n')
    rules = policy.load({"HVD_NOTEBOOK_PREEMPT_IDLE_AFTER": "5m"}, system)
    assert (rules.preempt_idle_after, rules.source("preempt_idle_after")) == (300, "$HVD_NOTEBOOK_PREEMPT_IDLE_AFTER")
    assert rules.describe() == "an idle cluster gives its GPUs back after 5 min when another start waits for them"
    assert policy.load({"HVD_NOTEBOOK_PREEMPT_IDLE_AFTER": "1h"}, system).preempt_idle_after == 600
    system.write_text('preempt_idle_after = "later"\n')
    with pytest.raises(policy.PolicyError, match="'later' is not a duration"):
        policy.load({}, system)


def test_an_idle_cluster_is_due_early_when_someone_waits_for_gpus(node, sleeper):
    from hvd_notebook.cluster.node import registry
    from hvd_notebook.cluster.node.policy import Policy
    from hvd_notebook.kernel.tenancy import due

    rules = Policy(preempt_idle_after=60.0, idle_timeout=3600.0)
    card = registry.Card(cluster="hvd-1", workdir="", kernel=os.getpid(), kernel_started=0.0, ranks=1, gpus=["0"],
                         started=1000.0, last_cell=1000.0)
    assert due(rules, card, 1100.0) is None  # idle for 100 s, but nobody waits
    _write(node / "queue", sleeper.pid, sleeper.create_time())
    assert "another start waits for GPUs in the node's queue" in due(rules, card, 1100.0)
    assert due(rules, card, 1050.0) is None  # not idle long enough
    from dataclasses import replace

    assert due(rules, replace(card, busy=True), 1100.0) is None  # a cell runs
    assert due(rules, replace(card, gpus=[]), 1100.0) is None  # no GPUs to give back


@pytest.mark.skipif(os.geteuid() != 0, reason="runs a process as another uid (nobody): needs root; the suite's root "
                    "run covers it")
def test_entries_written_for_another_users_live_process_do_not_count(tmp_path):
    nobody = 65534
    proc = subprocess.Popen(["sleep", "60"], user=nobody, group=nobody, cwd="/")
    try:
        other = psutil.Process(proc.pid)
        comes = time.monotonic() + 10
        while other.uids().real != nobody and time.monotonic() < comes:
            time.sleep(0.05)
        for _ in range(queue.MAX_PER_UID + 1):  # root's files naming nobody's process: they would fill its cap
            _write(tmp_path, other.pid, other.create_time(), uid=nobody)
        assert queue.read_entries(tmp_path) == []
        os.chown(_write(tmp_path, other.pid, other.create_time(), uid=nobody), nobody, nobody)  # nobody's own
        assert [e.uid for e in queue.read_entries(tmp_path)] == [nobody]
    finally:
        proc.kill()
        proc.wait()


def test_list_all_shows_the_starts_waiting_for_gpus(node, sleeper, capsys):
    from hvd_notebook.cli import main

    assert main(["list", "--all"]) == 0
    assert "Waiting for GPUs" not in capsys.readouterr().out
    _write(node / "queue", sleeper.pid, sleeper.create_time(), gpus=2)
    assert main(["list", "--all"]) == 0
    out = capsys.readouterr().out
    me = re.escape(user_name())
    assert re.search(rf"\nWaiting for GPUs: 1\. {me} \(kernel {sleeper.pid}\) wants 2 since \d\d:\d\d:\d\d\n", out), out


def test_a_served_start_is_held_to_the_users_cap_as_it_is_then(node, sleeper):
    import threading

    from hvd_notebook.cluster.launching.placements.one_host import OneHost
    from hvd_notebook.cluster.node import policy, registry
    from hvd_notebook.config import ClusterOptions

    rules = policy.Policy(max_gpus_per_user=1)
    holder = leases.acquire(["0", "1"], 2, "another user's stand-in")
    ended: list = []
    start = threading.Thread(target=lambda: ended.append(_outcome(OneHost(ClusterOptions(n=1)), rules)))
    start.start()
    try:
        deadline = time.monotonic() + 30
        while not list((node / "queue").glob("wait-*.json")) and time.monotonic() < deadline:
            time.sleep(0.1)
        # meanwhile another notebook of this user started a cluster on GPU 1: the cap is reached
        registry.write(registry.Card(cluster=f"hvd-{sleeper.pid}-1", workdir="/nowhere", kernel=sleeper.pid,
                                     kernel_started=sleeper.create_time(), ranks=1, gpus=["1"]))
        holder.drop(["0"])
        start.join(30)
    finally:
        holder.release()
    assert isinstance(ended[0], policy.PolicyError) and "this node allows 1 GPU(s) per user" in str(ended[0])
    assert not leases.held_pids()[1]  # the GPU it was served is free again


def _outcome(placement, rules):
    try:
        return placement.take_gpus(["0", "1"], 1, "test", rules)
    except Exception as exc:
        return exc


def test_a_start_for_every_free_gpu_leaves_those_the_starts_behind_it_want(node, sleeper):
    import threading

    holder = leases.acquire(["0", "1"], 2, "another user's stand-in")
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(queue.acquire(["0", "1"], None, "one rank per free GPU")))
    waiter.start()
    deadline = time.monotonic() + 30
    while not list((node / "queue").glob("wait-*.json")) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.05)
    _write(node / "queue", sleeper.pid, sleeper.create_time())  # another start, behind it, wants one
    holder.release()
    waiter.join(30)
    assert got and got[0].gpus == ["0"], got  # not both: GPU 1 is for the start behind
    got[0].release()
