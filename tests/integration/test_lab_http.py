"""The JupyterLab panel's HTTP surface (``hvd_notebook.lab.handlers``) in a real Jupyter Server, over one real
2-rank cluster of a real kernel: no token, no XSRF header, a wrong method, a cluster id that is not the user's,
two tabs polling at once, and a server whose authorizer lets a viewer read but not act. After each refusal the
cluster still runs. Needs no root (another user's cluster is planted as root only, else skipped)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import requests
from conftest import assert_gone, cluster_pids, execute, free_port, started_kernel, wait_for_server

from hvd_notebook import private
from hvd_notebook.cluster.node import nodedir

NOTEBOOK = "experiments/lab-http.ipynb"  # (the user's other clusters, of tests beside this one, have other names)
NOBODY = 65534
READ_ONLY = '''"""A server's authorizer for read-only sharing: every read allowed, nothing written."""
from jupyter_server.auth.authorizer import Authorizer


class ReadOnly(Authorizer):
    def is_authorized(self, handler, user, action, resource):
        return action == "read"
'''


@contextlib.contextmanager
def _jupyter_server(tmp: Path, name: str, env: dict[str, str], *args: str) -> Iterator[dict]:
    """A real Jupyter Server on a free loopback port with a token, its state under ``tmp/name``; its url,
    token and process id. Terminated at the end (it started no kernel)."""
    home = tmp / name
    (home / "config").mkdir(parents=True)
    (home / "config" / "jupyter_server_config.json").write_text(  # (enabled here whatever the install says)
        json.dumps({"ServerApp": {"jpserver_extensions": {"hvd_notebook.lab": True}}}))
    port, token = free_port(), secrets.token_hex(16)
    server_env = {**env, "HOME": str(home), "JUPYTER_CONFIG_DIR": str(home / "config"),
                  "JUPYTER_DATA_DIR": str(home / "data"), "JUPYTER_RUNTIME_DIR": str(home / "rt")}
    cmd = [sys.executable, "-m", "jupyter", "server", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={home}",
           "--ServerApp.port_retries=0", *args]  # (a port taken meanwhile: a failed start, not another port)
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log_path = home / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, env=server_env, stdout=log, stderr=subprocess.STDOUT, cwd=home)
    url = f"http://127.0.0.1:{port}"
    try:
        yield {"url": url, "token": token, "pid": proc.pid, "proc": proc, "log": log_path,
               "ready": lambda: wait_for_server(f"{url}/api/status?token={token}", proc, log_path, name, 90)}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _auth(server: dict) -> dict[str, str]:
    return {"Authorization": f"token {server['token']}"}


def _clusters(server: dict) -> requests.Response:
    return requests.get(f"{server['url']}/hvd-notebook/clusters", headers=_auth(server), timeout=60)


def _mine(server: dict) -> dict | None:
    """This module's cluster as the server lists it (None where it is not listed)."""
    answer = _clusters(server)
    assert answer.status_code == 200, answer.text
    found = [c for c in answer.json()["clusters"] if c["notebook"] == NOTEBOOK]
    return found[0] if found else None


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """Two servers (one as a deployment runs it, one whose authorizer allows reads only) and the cluster of a
    real kernel, as the panel of either sees it. At the end: the cluster, the kernel and the servers gone."""
    tmp = tmp_path_factory.mktemp("lab-http")
    (tmp / "tmp").mkdir()
    (tmp / "py").mkdir()
    (tmp / "py" / "read_only_authorizer.py").write_text(READ_ONLY)
    env = {**os.environ, "HVD_NOTEBOOK_GPUS": "", "HVD_NOTEBOOK_LEASE_DIR": str(tmp / "node"),
           "TMPDIR": str(tmp / "tmp")}  # (the kernel's and the servers': the same private folder, the same node)
    env.pop("HVD_NOTEBOOK_PROGRESS", None)
    read_only_env = {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp / "py"), env.get("PYTHONPATH")]))}
    kernel_env = {"JPY_SESSION_NAME": NOTEBOOK, "HVD_NOTEBOOK_LEASE_DIR": env["HVD_NOTEBOOK_LEASE_DIR"],
                  "TMPDIR": env["TMPDIR"]}
    with _jupyter_server(tmp, "server", env) as server, \
            _jupyter_server(tmp, "read-only", read_only_env,
                            "--ServerApp.authorizer_class=read_only_authorizer.ReadOnly") as read_only, \
            pytest.MonkeyPatch.context() as mp, started_kernel(kernel_env) as (km, kc):
        mp.setenv("HVD_NOTEBOOK_LEASE_DIR", env["HVD_NOTEBOOK_LEASE_DIR"])  # (for the card planted as root)
        reply, out = execute(kc, "%load_ext hvd_notebook\nfrom hvd_notebook.kernel.session import Session\n"
                                 "%hvd start -n 2")
        assert reply["content"]["status"] == "ok", out
        pids = cluster_pids(kc)
        server["ready"]()
        read_only["ready"]()
        cluster = _mine(server)
        assert cluster and cluster["state"] == "idle" and cluster["n"] == 2, _clusters(server).text
        yield {"server": server, "read_only": read_only, "id": cluster["id"], "pids": pids, "tmp": tmp}
        reply, out = execute(kc, "%hvd stop")
        assert reply["content"]["status"] == "ok", out
        kernel_pid = km.provisioner.pid
    assert_gone(pids | {server["pid"], read_only["pid"], kernel_pid}, timeout=30)


def _still_runs(lab: dict) -> None:
    """The module's cluster is as it was: listed, idle, every process alive."""
    cluster = _mine(lab["server"])
    assert cluster and cluster["id"] == lab["id"] and cluster["state"] == "idle", cluster
    assert all(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in lab["pids"])


def test_without_a_token_every_route_is_refused_and_says_nothing(lab):
    server, url = lab["server"], lab["server"]["url"]
    listed = _clusters(server).text
    rank_pid = str(_mine(server)["ranks"][0]["pid"])
    secrets_of_mine = [lab["id"], f'"{private.user_name()}"', NOTEBOOK, rank_pid]
    assert all(s in listed for s in secrets_of_mine), listed  # (what a refusal must not tell)
    routes = [("GET", "clusters"), *(("POST", f"clusters/{lab['id']}/{a}") for a in ("stop", "stacks", "restart"))]
    for headers in ({}, {"Authorization": "token " + secrets.token_hex(16)}):
        for method, route in routes:
            answer = requests.request(method, f"{url}/hvd-notebook/{route}", headers=headers, timeout=60,
                                      allow_redirects=False)
            assert answer.status_code in (302, 403), (method, route, answer.status_code, answer.text)
            assert not [s for s in secrets_of_mine if s in answer.text], (method, route, answer.text)
    _still_runs(lab)


def test_a_post_without_the_xsrf_header_is_refused_and_nothing_done(lab):
    """A browser's session (the login cookie, as a page of another site would send it) without the XSRF header."""
    url = lab["server"]["url"]
    browser = requests.Session()
    browser.get(f"{url}/login", timeout=60)
    logged_in = browser.post(f"{url}/login", data={"password": lab["server"]["token"],
                                                   "_xsrf": browser.cookies["_xsrf"]}, allow_redirects=False,
                             timeout=60)
    assert logged_in.status_code == 302, logged_in.text
    action = f"{url}/hvd-notebook/clusters/{lab['id']}"
    refused = browser.post(f"{action}/stop", timeout=60)
    assert refused.status_code == 403 and "_xsrf" in refused.text, (refused.status_code, refused.text)
    _still_runs(lab)
    with_header = browser.post(f"{action}/stacks", headers={"X-XSRFToken": browser.cookies["_xsrf"]}, timeout=60)
    assert with_header.status_code == 200 and "rank 0 of 2" in with_header.json()["text"], with_header.text


def test_a_wrong_method_is_405(lab):
    url, headers = lab["server"]["url"], _auth(lab["server"])
    wrong = [("PUT", "clusters"), ("DELETE", "clusters"), ("PATCH", "clusters"), ("POST", "clusters"),
             ("GET", f"clusters/{lab['id']}/stop"), ("DELETE", f"clusters/{lab['id']}/stop"),
             ("PUT", f"clusters/{lab['id']}/restart")]
    for method, route in wrong:
        answer = requests.request(method, f"{url}/hvd-notebook/{route}", headers=headers, timeout=60)
        assert answer.status_code == 405, (method, route, answer.status_code, answer.text)
    _still_runs(lab)


def test_a_made_up_cluster_id_is_404(lab):
    url, headers = lab["server"]["url"], _auth(lab["server"])
    for cluster in ("hvd-999999999-1", "hvd-1-1", "not-a-cluster", f"{lab['id']}0"):
        for action in ("stop", "stacks"):
            answer = requests.post(f"{url}/hvd-notebook/clusters/{cluster}/{action}", headers=headers, timeout=60)
            assert answer.status_code == 404 and answer.json()["message"], (cluster, action, answer.text)
    unknown = requests.post(f"{url}/hvd-notebook/clusters/{lab['id']}/explode", headers=headers, timeout=60)
    assert unknown.status_code == 404 and "stop" in unknown.json()["message"], unknown.text
    _still_runs(lab)


def _plant_nobodys_cluster(tmp: Path) -> tuple[str, subprocess.Popen]:
    """A cluster directory of user nobody (uid 65534), its kernel a live process of nobody's, named by nobody's
    card in the node's register, where nobody's own panel would find it (``$XDG_RUNTIME_DIR/hvd_notebook``)."""
    kernel = subprocess.Popen(["sleep", "120"], user=NOBODY, group=NOBODY)
    record = f"{kernel.pid} {psutil.Process(kernel.pid).create_time()}"
    base = tmp / f"run-{NOBODY}" / "hvd_notebook"
    cluster = base / f"hvd-{kernel.pid}-1"
    cluster.mkdir(mode=0o700, parents=True)
    (cluster / "owner").write_text(record)
    (cluster / "pids").write_text(record)
    card = nodedir.register_dir(create=True) / f"cluster-{NOBODY}-{kernel.pid}.json"
    card.write_text(json.dumps({"cluster": cluster.name, "workdir": str(cluster), "kernel": kernel.pid,
                                "kernel_started": psutil.Process(kernel.pid).create_time(), "ranks": 2, "gpus": [],
                                "started": time.time() - 60, "last_cell": time.time(), "busy": False}))
    for path in (base.parent, base, cluster, cluster / "owner", cluster / "pids", card):
        os.chown(path, NOBODY, NOBODY)
    return cluster.name, kernel


def test_another_users_cluster_id_is_404_and_nothing_done(lab):
    if os.geteuid() != 0:
        pytest.skip("plants a cluster of another uid (chown, a process as nobody): needs root, as make test runs it")
    cluster, kernel = _plant_nobodys_cluster(lab["tmp"])
    try:
        url, headers = lab["server"]["url"], _auth(lab["server"])
        for action in ("stacks", "stop", "interrupt"):
            answer = requests.post(f"{url}/hvd-notebook/clusters/{cluster}/{action}", headers=headers, timeout=60)
            assert answer.status_code == 404, (action, answer.status_code, answer.text)
        listed = _clusters(lab["server"]).json()
        assert cluster not in {c["id"] for c in listed["clusters"]}, listed["clusters"]
        assert "nobody" in {o.get("user") for o in listed["others"]}, listed["others"]  # (the card was read)
        assert kernel.poll() is None and not (lab["tmp"] / f"run-{NOBODY}" / "hvd_notebook" / "requests").exists()
    finally:
        kernel.kill()
        kernel.wait()
        shutil.rmtree(lab["tmp"] / f"run-{NOBODY}")
    _still_runs(lab)


def test_the_queue_for_gpus_is_listed_in_order_with_its_caps(lab):
    if os.geteuid() != 0:
        pytest.skip("plants a queue entry of another uid (chown, a process as nobody): needs root, as make test "
                    "runs it")
    from hvd_notebook.cluster.node import queue

    folder = nodedir.sticky_dir(nodedir.QUEUE, create=True)
    waiter = subprocess.Popen(["sleep", "120"], user=NOBODY, group=NOBODY)
    planted = []
    try:
        def put(uid: int, pid: int, gpus: int) -> None:
            path = folder / f"wait-{uid}-{pid}-{secrets.token_hex(8)}.json"
            path.write_text(json.dumps({"pid": pid, "pid_started": psutil.Process(pid).create_time(), "gpus": gpus}))
            os.chown(path, uid, uid)
            planted.append(path)
            time.sleep(0.02)  # (one entry after the other: their ctimes say the order)

        put(NOBODY, waiter.pid, 2)
        for _ in range(queue.MAX_PER_UID + 3):  # this user's entries beyond the cap are not counted
            put(os.geteuid(), os.getpid(), 1)
        listed = _clusters(lab["server"]).json()["queue"]
        assert [(e["place"], e["user"], e["gpus"], e["mine"]) for e in listed] == [
            (1, "nobody", 2, False), *[(p, "root", 1, True) for p in range(2, queue.MAX_PER_UID + 2)]], listed
        assert listed[0]["since"] <= listed[1]["since"] <= time.time()
    finally:
        waiter.kill()
        waiter.wait()
        for path in planted:
            path.unlink(missing_ok=True)
    assert _clusters(lab["server"]).json()["queue"] == []


def test_two_tabs_polling_at_once_get_json_and_no_error(lab):
    def poll(_: int) -> tuple[int, str]:
        answer = _clusters(lab["server"])
        return answer.status_code, answer.text

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = [a for _ in range(4) for a in pool.map(poll, range(8))]
    assert [status for status, _ in answers] == [200] * 32, [a for a in answers if a[0] != 200][:2]
    for _, text in answers:
        assert lab["id"] in {c["id"] for c in json.loads(text)["clusters"]}, text
    _still_runs(lab)


def test_a_read_only_authorizer_shows_the_panel_and_refuses_its_buttons(lab):
    read_only = lab["read_only"]
    cluster = _mine(read_only)
    assert cluster and cluster["id"] == lab["id"], cluster
    for action in ("stop", "stacks"):
        answer = requests.post(f"{read_only['url']}/hvd-notebook/clusters/{lab['id']}/{action}",
                               headers=_auth(read_only), timeout=60)
        assert answer.status_code == 403, (action, answer.status_code, answer.text)
        assert "rank 0" not in answer.text and "stopped" not in answer.text, answer.text
    _still_runs(lab)


def _own_base(lab: dict) -> Path:
    """The private folder of the module's kernel (its card names its cluster's directory): where its suspends go."""
    from hvd_notebook.cluster.node import registry

    found = [Path(c.workdir).parent for c in registry.read_all() if c.cluster == lab["id"]]
    assert found, f"no card of {lab['id']} in the node's register"
    return found[0]


def make_suspended(base: Path | None, ident: str, rank_bytes: int = 3000) -> Path:
    """A suspended cluster of 2 ranks as a suspend writes it (``Making``: a folder per rank, then the manifest),
    without ranks, in the private folder ``base`` (None: ``private.base_dir()``): each rank's state file
    ``rank_bytes`` long. Its folder."""
    from hvd_notebook.cluster.launching import suspension
    from hvd_notebook.config import ClusterOptions

    making = suspension.Making(suspension.suspended_root(base), ident, [0, 1])
    for folder in making.rank_dirs.values():
        (folder / "state.pkl").write_bytes(b"x" * rank_bytes)
    saves = [{"rank": r, "bytes": rank_bytes, "seconds": 0.1, "saved": ["x"], "unsaved": {}} for r in (0, 1)]
    manifest = suspension.Manifest(
        id=ident, user=private.user_name(), kernel=os.getpid(), ranks=2, gpus=[],
        options=suspension.options_record(ClusterOptions(n=2)), cells=[], saves=saves,
        suspended=time.time() - 90, seconds=0.2, bytes=2 * rank_bytes, why="")
    return making.finish(manifest).path


def _delete(server: dict, ident: str, headers: dict | None = None) -> requests.Response:
    return requests.post(f"{server['url']}/hvd-notebook/clusters/{ident}/delete",
                         headers=_auth(server) if headers is None else headers, timeout=60)


def test_a_suspended_cluster_is_listed_with_its_size_and_its_delete_removes_it(lab):
    ident = f"hvd-{os.getpid()}-{secrets.randbelow(10**6)}"
    folder = make_suspended(_own_base(lab), ident)
    try:
        listed = {s["id"]: s for s in _clusters(lab["server"]).json()["suspended"]}
        entry = listed.get(ident)
        assert entry is not None, listed
        on_disk = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        assert entry["ranks"] == 2 and entry["bytes"] == on_disk and on_disk > 6000, (entry, on_disk)
        assert abs(entry["since"] - (time.time() - 90)) < 60 and entry["kernel"] == os.getpid() and not entry["error"]
        assert ident not in {c["id"] for c in _clusters(lab["server"]).json()["clusters"]}
        refused = _delete(lab["read_only"], ident)  # (a viewer may read, not delete)
        assert refused.status_code == 403 and folder.is_dir(), refused.text
        deleted = _delete(lab["server"], ident)
        assert deleted.status_code == 200 and f"Deleted the suspended cluster {ident}" in deleted.json()["text"], \
            deleted.text
        assert not folder.exists()
        assert ident not in {s["id"] for s in _clusters(lab["server"]).json()["suspended"]}
        again = _delete(lab["server"], ident)
        assert again.status_code == 404 and "no suspended cluster" in again.json()["message"], again.text
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    _still_runs(lab)


def test_a_made_up_or_running_id_is_not_deleted_and_is_404(lab):
    for ident in ("hvd-999999999-1", "not-a-cluster", "hvd-1-1.x", lab["id"]):
        answer = _delete(lab["server"], ident)
        assert answer.status_code == 404 and answer.json()["message"], (ident, answer.text)
    _still_runs(lab)


def test_a_delete_without_the_xsrf_header_is_refused_and_the_state_kept(lab):
    ident = f"hvd-{os.getpid()}-{secrets.randbelow(10**6)}"
    folder = make_suspended(_own_base(lab), ident)
    try:
        url = lab["server"]["url"]
        browser = requests.Session()
        browser.get(f"{url}/login", timeout=60)
        browser.post(f"{url}/login", data={"password": lab["server"]["token"], "_xsrf": browser.cookies["_xsrf"]},
                     allow_redirects=False, timeout=60)
        refused = browser.post(f"{url}/hvd-notebook/clusters/{ident}/delete", timeout=60)
        assert refused.status_code == 403 and "_xsrf" in refused.text and folder.is_dir(), refused.text
        assert ident in {s["id"] for s in _clusters(lab["server"]).json()["suspended"]}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_another_users_suspended_cluster_is_not_listed_nor_deleted(lab):
    """A folder of user nobody's in this user's own ``suspended/`` (a name planted where the panel looks), and one
    in nobody's own private folder: neither is listed, a delete of either is 404, and both stay."""
    if os.geteuid() != 0:
        pytest.skip("plants a suspended cluster of another uid (chown): needs root, as make test runs it")
    planted = make_suspended(_own_base(lab), f"hvd-{NOBODY}-7")
    theirs_base = lab["tmp"] / f"run-{NOBODY}" / "hvd_notebook"
    theirs_base.mkdir(mode=0o700, parents=True)
    theirs = make_suspended(theirs_base, f"hvd-{NOBODY}-8")
    try:
        for path in (*planted.rglob("*"), planted, *theirs.rglob("*"), theirs, theirs_base / "suspended",
                     theirs_base, theirs_base.parent):
            os.chown(path, NOBODY, NOBODY, follow_symlinks=False)
        listed = {s["id"] for s in _clusters(lab["server"]).json()["suspended"]}
        assert not listed & {planted.name, theirs.name}, listed
        for folder in (planted, theirs):
            answer = _delete(lab["server"], folder.name)
            assert answer.status_code == 404 and folder.is_dir() and (folder / "manifest.json").is_file(), answer.text
    finally:
        shutil.rmtree(planted, ignore_errors=True)
        shutil.rmtree(lab["tmp"] / f"run-{NOBODY}", ignore_errors=True)
    _still_runs(lab)
