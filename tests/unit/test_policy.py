"""The node's fair-sharing rules (cluster.policy), the register's cards (cluster.registry) and the
release watch's clock (kernel.tenancy.due), on real files and real processes."""

from __future__ import annotations

import os
import time

import pytest

from hvd_notebook.cli import format_node
from hvd_notebook.cluster.node import leases, policy, registry
from hvd_notebook.kernel.tenancy import due


def test_the_tightest_rule_wins_so_a_user_cannot_loosen_the_admins(tmp_path):
    system = tmp_path / "policy.toml"
    system.write_text('max_gpus_per_user = 2\nidle_timeout = "30m"\nmax_lease_time = 28800\n')
    rules = policy.load({"HVD_NOTEBOOK_MAX_GPUS_PER_USER": "4", "HVD_NOTEBOOK_IDLE_TIMEOUT": "10m"}, system)
    assert rules.max_gpus_per_user == 2 and rules.source("max_gpus_per_user") == f"{system}: max_gpus_per_user"
    assert rules.idle_timeout == 600 and rules.source("idle_timeout") == "$HVD_NOTEBOOK_IDLE_TIMEOUT"
    assert rules.max_lease_time == 8 * 3600 and rules.max_cpu_ranks_per_user is None
    assert rules.idle_action == "suspend"  # (the default)
    assert rules.describe() == ("at most 2 GPU(s) per user, a cluster stops after 8 h or is suspended after 10 min "
                                "without a %%hvd cell")
    # of idle actions, stop is the tighter: the admin's stop holds against a user's suspend, not the reverse
    system.write_text('idle_timeout = "30m"\nidle_action = "stop"\nsuspended_ttl = "7d"\n')
    rules = policy.load({"HVD_NOTEBOOK_IDLE_ACTION": "suspend", "HVD_NOTEBOOK_SUSPENDED_TTL": "1d"}, system)
    assert (rules.idle_action, rules.source("idle_action")) == ("stop", f"{system}: idle_action")
    assert rules.suspended_ttl == 86400 and rules.source("suspended_ttl") == "$HVD_NOTEBOOK_SUSPENDED_TTL"
    assert rules.describe() == ("a cluster stops after 30 min without a %%hvd cell, a suspended cluster is kept "
                                "for 1 d")
    system.write_text('idle_action = "suspend"\n')
    assert policy.load({"HVD_NOTEBOOK_IDLE_ACTION": "stop"}, system).idle_action == "stop"
    system.write_text("keep_on_kernel_end = true\n")  # (any source that says true)
    assert policy.load({"HVD_NOTEBOOK_KEEP_ON_KERNEL_END": "false"}, system).keep_on_kernel_end is True
    assert policy.load({"HVD_NOTEBOOK_KEEP_ON_KERNEL_END": "1"}, tmp_path / "none.toml").keep_on_kernel_end is True
    assert policy.load({}, tmp_path / "none.toml").keep_on_kernel_end is False
    named = tmp_path / "kernel.toml"
    named.write_text("max_cpu_ranks_per_user = 4\n")
    assert policy.load({"HVD_NOTEBOOK_POLICY_FILE": str(named)}, system).max_cpu_ranks_per_user == 4
    assert policy.load({}, tmp_path / "absent.toml") == policy.Policy()


@pytest.mark.parametrize("text, complaint", [
    ("max_gpus = 2\n", "unknown rule(s) max_gpus; the rules are max_gpus_per_user"),
    ('idle_timeout = "soon"\n', "'soon' is not a duration"),
    ('idle_action = "pause"\n', "'pause' is not an idle action; write \"suspend\" or \"stop\""),
    ('keep_on_kernel_end = "maybe"\n', "'maybe' is not true or false"),
    ("max_gpus_per_user = -1\n", "-1 is not a whole number of 0 or more"),
    ("max_gpus_per_user = [\n", "is not TOML"),
])
def test_a_bad_policy_file_says_where_and_what_to_write(tmp_path, text, complaint):
    path = tmp_path / "policy.toml"
    path.write_text(text)
    with pytest.raises(policy.PolicyError, match="policy.toml") as caught:
        policy.load({}, path)
    assert complaint in str(caught.value)


def test_the_shipped_example_policy_reads():
    from pathlib import Path

    shipped = Path(__file__).resolve().parents[2] / "deploy" / "jupyterhub" / "policy.toml"
    rules = policy.load({}, shipped)
    assert (rules.max_gpus_per_user, rules.max_cpu_ranks_per_user) == (2, 8)
    assert (rules.max_lease_time, rules.idle_timeout) == (8 * 3600, 30 * 60)


def test_a_named_policy_file_that_is_missing_is_an_error(tmp_path):
    with pytest.raises(policy.PolicyError, match="cannot be read"):
        policy.load({"HVD_NOTEBOOK_POLICY_FILE": str(tmp_path / "none.toml")}, tmp_path / "absent.toml")


@pytest.mark.parametrize("text, seconds", [("90", 90), ("90s", 90), ("1.5m", 90), ("2h", 7200), ("1d", 86400)])
def test_durations(text, seconds):
    assert policy.parse_duration(text, "x") == seconds


@pytest.fixture
def node(tmp_path, monkeypatch):
    """A node directory of this test's own."""
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(tmp_path / "node"))
    return tmp_path / "node"


@pytest.fixture
def other_kernel(sleeper):
    """A real process standing in for another notebook kernel of this user."""
    return sleeper


def _card(proc, **fields):
    import psutil

    return registry.Card(cluster=f"hvd-{proc.pid}-1", workdir="/nowhere", kernel=proc.pid,
                         kernel_started=psutil.Process(proc.pid).create_time(), **fields)


def test_the_caps_count_the_users_other_running_clusters(node, other_kernel, monkeypatch):
    monkeypatch.setattr(os, "getpid", lambda: other_kernel.pid)  # the other kernel writes its card
    registry.write(_card(other_kernel, ranks=2, gpus=["0", "1"]))
    monkeypatch.undo()
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(node))
    rules = policy.Policy(max_gpus_per_user=3, max_cpu_ranks_per_user=2)
    assert rules.room(gpus=True, asked=None) == 1  # one rank per free GPU: at most one more
    assert rules.room(gpus=False, asked=2) == 2  # GPU clusters do not count against CPU ranks
    with pytest.raises(policy.PolicyError) as caught:
        rules.room(gpus=True, asked=2)
    assert f"hvd-{other_kernel.pid}-1 (kernel {other_kernel.pid}): GPU 0,1" in str(caught.value)
    assert "Start fewer ranks (-n 1)" in str(caught.value)
    other_kernel.kill()
    other_kernel.wait()
    assert rules.room(gpus=True, asked=3) == 3  # a card whose kernel is gone holds nothing


def test_list_all_shows_cards_and_held_leases(node, other_kernel, monkeypatch):
    lease = leases.acquire(["0", "1", "2"], 1, "kernel 1, hvd-1-1")
    try:
        monkeypatch.setattr(os, "getpid", lambda: other_kernel.pid)
        registry.write(_card(other_kernel, ranks=1, gpus=["0"], started=time.time() - 3700,
                             last_cell=time.time() - 125))
        monkeypatch.undo()
        monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(node))
        text = format_node(registry.read_all(), leases.holders(), time.time())
    finally:
        lease.release()
    user = registry.read_all()[0].user
    assert text.splitlines()[0].split() == ["user", "cluster", "kernel", "ranks", "GPUs", "since", "idle"]
    assert f"{user}  hvd-{other_kernel.pid}-1  {other_kernel.pid} (running)  1      0" in text
    assert text.splitlines()[1].endswith("2 min")
    assert f"GPU 0: {user} (pid {os.getpid()})" in text  # who: the lock's holder, this process (it has no card)
    assert "GPU 1" not in text


def test_due_idle_and_lease_time():
    rules = policy.Policy(idle_timeout=60, max_lease_time=3600, sources=(("idle_timeout", "policy.toml"),))
    card = registry.Card(cluster="c", workdir="", kernel=1, kernel_started=0, ranks=2, started=0, last_cell=0)
    assert due(rules, card, 59) is None
    assert due(rules, card, 60) == "it had run no %%hvd cell for 1 min (policy.toml)"
    busy = registry.Card(**{**card.__dict__, "busy": True})
    assert due(rules, busy, 600) is None  # a running cell is not idle
    assert "it had run for 1 h, the longest this node allows" in due(rules, busy, 3600)
