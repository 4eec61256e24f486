"""A flood of the node's register costs the victim's JupyterLab panel nothing: two real Unix users (test_hostile's
victim and attacker, made with useradd, acting through runuser), the victim's own Jupyter server with the
extension (run AS THE VICTIM), and the attacker's flood: ``FLOOD`` long-lived processes, a valid card of
``CARD_BYTES`` for each in the register, and a card claiming GPUs 0 and 1 that no lease lock of theirs holds.
The victim's ``GET hvd-notebook/clusters`` stays within a few KiB of its size before the flood and within noise
of its time, and names no GPU as the attacker's. Needs root (useradd, runuser)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import statistics
import subprocess
import time
import urllib.request

import psutil
import pytest
from conftest import assert_gone, figure, free_port, wait_for_server
from test_hostile import MALLORY, PYTHON, kill_tree, people, setup_node, workspace  # noqa: F401 (fixtures)

from hvd_notebook.cluster.node import registry

pytestmark = [
    pytest.mark.alone,  # (its users are test_hostile's, whose teardown kills all their processes; and it times)
    pytest.mark.skipif(os.geteuid() != 0, reason="creates Unix users (useradd) and acts as them (runuser): needs "
                       "root; the suite's root run covers it"),
    pytest.mark.skipif(not all(map(shutil.which, ("useradd", "runuser", "pkill", "pgrep"))),
                       reason="useradd, runuser, pkill or pgrep is missing"),
]

FLOOD = 300  # the attacker's processes, each with a valid card
CARD_BYTES = 60 * 1024
SAMPLES = 9  # requests timed before and after the flood (their median compared)

# The attacker: forks FLOOD children that wait, writes a valid card of CARD_BYTES for each (the first claiming
# GPUs 0 and 1, which no lock of theirs holds), answers their pids, and waits to be killed.
FLOODER = r'''
import json, os, signal, sys, time
import psutil

count, size, register = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
children = []
for _ in range(count):
    pid = os.fork()
    if pid == 0:
        while True:
            signal.pause()
    children.append(pid)
for i, pid in enumerate(children):
    card = {"cluster": f"hvd-{pid}-1", "workdir": "w" * 4000, "kernel": pid,
            "kernel_started": psutil.Process(pid).create_time(), "ranks": 8, "gpus": ["0", "1"] if i == 0 else [],
            "started": time.time(), "last_cell": time.time(), "busy": True}
    pad = (size - len(json.dumps(card))) // 64
    card["gpus"] += [f"{j:060d}" for j in range(pad)]  # (claims: the panel shows no GPU no lease holds)
    path = os.path.join(register, f"cluster-{os.getuid()}-{pid}.json")
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps(card))
    os.chmod(path + ".tmp", 0o644)
    os.rename(path + ".tmp", path)
print("@@" + json.dumps({"pids": children}), flush=True)
signal.pause()
'''


def _get(url: str, token: str) -> tuple[bytes, float]:
    request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
    t0 = time.monotonic()
    with urllib.request.urlopen(request, timeout=60) as answer:
        body = answer.read()
    return body, time.monotonic() - t0


def _timed(url: str, token: str) -> tuple[bytes, float]:
    """The answer (the last) and the median time of ``SAMPLES`` requests."""
    answers = [_get(url, token) for _ in range(SAMPLES)]
    return answers[-1][0], statistics.median(t for _, t in answers)


@pytest.fixture
def victims_server(people, workspace):  # noqa: F811 (test_hostile's fixtures)
    """The victim's Jupyter server with the extension, run as the victim on the module's node: its clusters URL
    and token."""
    victim, _ = people
    problems: list[str] = []
    setup_node(workspace.node, problems)
    assert not problems, problems
    port, token = free_port(), secrets.token_hex(16)
    log_path = workspace.path / "victim-server.log"
    log = open(log_path, "w")
    argv = victim.argv([str(PYTHON), "-m", "jupyter_server", "--no-browser", f"--port={port}",
                        "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
                        f"--ServerApp.root_dir={victim.home}"])
    server = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=victim.home)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_server(f"{url}/api/status?token={token}", server, log_path, "the victim's Jupyter server", 90)
        try:
            _get(f"{url}/hvd-notebook/clusters", token)
        except OSError as exc:
            pytest.fail(f"the victim's server does not answer the panel ({exc}); its log:\n"
                        + log_path.read_text()[-4000:])
        yield f"{url}/hvd-notebook/clusters", token
    finally:
        kill_tree(server)
        log.close()


@pytest.fixture
def flood(people, workspace):  # noqa: F811 (test_hostile's fixtures)
    """The attacker's flood (started by the test): their processes' pids; every one of them killed after."""
    _, mallory = people
    script = workspace.path / "scripts" / "flooder.py"
    script.write_text(FLOODER)
    script.chmod(0o644)
    procs: list[subprocess.Popen] = []

    def start() -> list[int]:
        proc = subprocess.Popen(mallory.argv([str(PYTHON), str(script), str(FLOOD), str(CARD_BYTES),
                                              str(workspace.node / "register")]),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        procs.append(proc)
        line = proc.stdout.readline()
        if not line.startswith("@@"):
            kill_tree(proc)
            pytest.fail(f"the attacker's flood did not start: {line}{proc.stderr.read()[-2000:]}")
        return json.loads(line[2:])["pids"]

    pids: list[int] = []
    try:
        yield lambda: pids.extend(start()) or pids
    finally:
        for proc in procs:
            for pid in pids:
                try:
                    psutil.Process(pid).kill()
                except psutil.Error:
                    pass
            kill_tree(proc)
        assert_gone(pids)
        for card in (workspace.node / "register").glob(f"cluster-{mallory.uid}-*.json"):
            card.unlink()


def test_a_flood_of_valid_cards_costs_the_victims_panel_nothing(people, victims_server, flood):  # noqa: F811
    _, mallory = people
    url, token = victims_server
    _timed(url, token)  # (warm: the first readings start NVML and psutil's caches)
    before, before_s = _timed(url, token)
    pids = flood()
    after, after_s = _timed(url, token)
    answer = json.loads(after)
    figure(f"the victim's GET hvd-notebook/clusters: {len(before)} B in {before_s * 1000:.0f} ms (median of "
           f"{SAMPLES}) before {len(pids)} valid {CARD_BYTES // 1024} KiB cards of another user, {len(after)} B in "
           f"{after_s * 1000:.0f} ms after")
    assert len(pids) == FLOOD and all(psutil.pid_exists(p) for p in pids[:10])
    assert len(after) <= len(before) + 4096, (len(before), len(after))
    assert after_s < 2 * before_s + 0.05, (before_s, after_s)
    theirs = [line for line in answer["others"] if line["user"] == MALLORY]
    assert len(answer["others"]) == 1 and theirs, answer["others"]  # one line, whatever they planted
    assert theirs[0]["gpus"] == [], theirs  # (their cards claim GPUs 0 and 1 and hundreds more: no lock holds them)
    assert theirs[0]["ranks"] == 8 * registry.MAX_CARDS_PER_USER, theirs
    assert not any(g.get("holder") == MALLORY for g in answer["gpus"] or []), answer["gpus"]
