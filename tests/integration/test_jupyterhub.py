"""A real JupyterHub (from PyPI, with its proxy from the npm registry) on loopback, with the shipped
deploy/jupyterhub/jupyterhub_config.py, two real Unix users created for the test, the local process
spawner, and a node of three GPUs listed in the kernelspec (HVD_NOTEBOOK_GPUS=0,1,2; no GPU here, the
ranks run on the CPU). Logged in through the hub's login page in Debian's chromium (Playwright), each
user runs cells in their own JupyterLab: alice trains on two GPUs; bob is refused two and gets the one
free GPU; bob's own shell (a Jupyter terminal) can neither list, read nor signal alice's cluster, nor
reach her kernels' channels (Unix sockets in her 0700 runtime folder, not TCP ports); root cannot log
in; the admin's `hvd-notebook list --all` shows both; alice's idle cluster is released, her next cell says why,
and bob then takes two GPUs.

The package is deployed as docs/jupyterhub.md deploys it: a wheel built from the checkout (setup.py's build puts
the JupyterLab panel in it), pip-installed into a fresh environment that the hub's servers and kernels run. That
environment sees the suite's other packages through a path in a .pth file (a real deployment pip-installs them
there), so hvd_notebook and the panel come from the wheel alone, not from the checkout.

The login is JupyterHub's SharedPasswordAuthenticator with a test password instead of PAM (the shipped file's
choice): PAM would need the test to set system passwords; everything after the login is the same.
Needs root (useradd, and the hub spawns servers as the users); the unprivileged run skips it."""

from __future__ import annotations

import json
import os
import pwd
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest
from conftest import (
    CELL_DONE,
    CELL_TEXT,
    RUN_CELL,
    figure,
    free_port,
    let_others_traverse,
    put_modes_back,
    wait_for_server,
)

ROOT = Path(__file__).resolve().parents[2]
SHIPPED_CONFIG = ROOT / "deploy" / "jupyterhub" / "jupyterhub_config.py"
PROXY = ROOT / ".venv" / "node" / "node_modules" / ".bin" / "configurable-http-proxy"
CHROMIUM = "/usr/bin/chromium"
ARTIFACTS = ROOT / "build" / "test-artifacts"
USERS = ("hvdt-alice", "hvdt-bob")
MPICH_TOOLS = ("mpiexec", "mpiexec.gforker", "mpiexec.hydra", "hydra_pmi_proxy")  # the [mpich] extra's, in bin/
IDLE = 45  # seconds: the policy's idle_timeout

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="creates Unix users (useradd) and runs a hub that "
                                "spawns servers as them: needs root; the suite's root run covers it")

TRAIN = """%%hvd
import numpy as np, keras
x = np.random.default_rng(hvd.rank()).normal(size=(512, 8)).astype('float32'); y = (x[:, 0] > 0).astype('int64')
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, activation='softmax')])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss='sparse_categorical_crossentropy')
history = model.fit(x, y, batch_size=32, epochs=2, verbose=0)
print('trained: rank', hvd.rank(), 'loss', round(history.history['loss'][-1], 3))"""

NOTEBOOKS = {
    "hvdt-alice": ["%hvd start -n 2", TRAIN, "%%hvd\nprint('still here')", "%hvd restart --replay"],
    "hvdt-bob": ["%hvd start -n 2 --no-wait", "%hvd start", "%hvd start --restart -n 2", "%hvd stop"],
}

def _remove_users() -> None:
    """The users, their processes, and the shared memory their killed ranks leave in /dev/shm (MPICH's
    segments, which only a rank that ends unlinks: left, they would outlive the uid)."""
    uids = set()
    for user in USERS:
        try:
            uids.add(pwd.getpwnam(user).pw_uid)
        except KeyError:
            continue
        subprocess.run(["pkill", "-KILL", "-u", user], capture_output=True)
    time.sleep(0.5)
    for path in Path("/dev/shm").iterdir():
        try:
            if path.lstat().st_uid in uids:
                path.unlink()
        except FileNotFoundError:
            pass
    for user in USERS:
        subprocess.run(["userdel", "-r", "-f", user], capture_output=True)


def _run_quietly(args: list, **kwargs) -> subprocess.CompletedProcess:
    """``args`` run to completion; a failure shows its output."""
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=600, **kwargs)
    assert done.returncode == 0, f"{args} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
    return done


def _hub_environment(base: Path) -> Path:
    """The hub's environment, as docs/jupyterhub.md makes it: the wheel built from the checkout (its panel built
    by setup.py where stale), pip-installed into a fresh venv; the suite's packages and MPICH's launchers, which
    a deployment installs there too, reached through a .pth path and links."""
    wheels = base / "wheel"
    _run_quietly([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, ROOT])
    env = base / "env"
    _run_quietly([sys.executable, "-m", "venv", "--without-pip", env])
    _run_quietly([sys.executable, "-m", "pip", "--python", env / "bin" / "python", "install", "--no-deps",
                  *wheels.glob("hvd_notebook-*.whl")])
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = _run_quietly([env / "bin" / "python", "-c", purelib]).stdout.strip()
    Path(site, "suite-packages.pth").write_text(_run_quietly([sys.executable, "-c", purelib]).stdout)
    for tool in MPICH_TOOLS:
        (env / "bin" / tool).symlink_to(ROOT / ".venv" / "bin" / tool)
    for lib in (ROOT / ".venv" / "lib").iterdir():  # MPICH's libmpi, where mpi4py looks (sys.prefix/lib)
        if not lib.name.startswith("python"):
            (env / "lib" / lib.name).symlink_to(lib)
    lab = env / "share" / "jupyter" / "labextensions" / "hvd-notebook-lab" / "package.json"
    assert lab.is_file() and not lab.is_symlink() and not lab.parent.is_symlink(), f"{lab}: not the wheel's own"
    return env


@pytest.fixture
def hub():
    """The hub, its two users with a notebook each, and the node's folders; all removed afterwards."""
    if not PROXY.exists():
        pytest.fail(f"{PROXY} is missing: run `make install` (it installs configurable-http-proxy with npm).")
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make install` (it installs Debian's chromium) as root.")
    _remove_users()  # (a run killed before its clean-up)
    base = Path(tempfile.mkdtemp(prefix="hvd-hub-"))
    base.chmod(0o755)
    changed = let_others_traverse([ROOT / ".venv" / "bin", Path(os.path.realpath(sys.executable)),
                                   Path(sys.base_prefix) / "lib"])
    proc = None
    try:
        for user in USERS:
            subprocess.run(["useradd", "-m", "-s", "/bin/bash", user], check=True)
            home = Path(pwd.getpwnam(user).pw_dir)
            nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in NOTEBOOKS[user]])
            nb.metadata["kernelspec"] = {"name": "hvd-tensorflow", "display_name": "Python 3 (hvd_notebook)",
                                         "language": "python"}
            nbformat.write(nb, home / "hub.ipynb")
            shutil.chown(home / "hub.ipynb", user, user)
        env = _hub_environment(base)
        python = env / "bin" / "python"
        leases = base / "leases"  # root's, made as docs/jupyterhub.md's admin makes it
        made = subprocess.run([python, "-m", "hvd_notebook.cli", "setup-node", "--gpus", "0,1,2"],
                              capture_output=True, text=True, env={**os.environ, "HVD_NOTEBOOK_LEASE_DIR": str(leases)})
        assert made.returncode == 0 and "is ready for GPU(s) 0,1,2" in made.stdout, made.stdout + made.stderr
        policy = base / "policy.toml"  # root's, as /etc/hvd_notebook/policy.toml would be
        policy.write_text(f'max_gpus_per_user = 2\nidle_timeout = "{IDLE}s"\nidle_action = "stop"\n')
        prefix = base / "prefix"
        subprocess.run([python, "-m", "hvd_notebook.cli", "install-kernel", "--prefix", str(prefix),
                        "--env", "HVD_NOTEBOOK_GPUS=0,1,2", "--env", f"HVD_NOTEBOOK_LEASE_DIR={leases}",
                        "--env", f"HVD_NOTEBOOK_POLICY_FILE={policy}", "--env", "HVD_NOTEBOOK_STANDBY=off",
                        "--env", "HVD_NOTEBOOK_PROGRESS=text"], check=True, capture_output=True)
        os.system(f"chmod -R a+rX {prefix}")
        state = base / "hub"  # the hub's database and cookie secret: root's only
        state.mkdir(mode=0o700)
        port, token, password = free_port(), secrets.token_hex(16), secrets.token_hex(8)
        (state / "test_config.py").write_text(f"""
load_subconfig({str(SHIPPED_CONFIG)!r})
c.JupyterHub.bind_url = "http://127.0.0.1:{port}"
c.JupyterHub.hub_port = {free_port()}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{free_port()}"
c.ConfigurableHTTPProxy.command = [{str(PROXY)!r}]
c.JupyterHub.db_url = "sqlite:///{state}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{state}/cookie_secret"
c.JupyterHub.authenticator_class = "shared-password"
c.SharedPasswordAuthenticator.user_password = {password!r}
c.Authenticator.allow_all = False
c.Authenticator.allowed_users = {set(USERS) | {"root"}!r}  # root too: the shipped blocked_users must refuse it
# the suite's JupyterLab (its app folder and server extensions), which the hub's environment sees through its .pth
c.Spawner.environment = {{"JUPYTER_PATH": "{prefix}/share/jupyter", "JUPYTERLAB_DIR": "{ROOT}/.venv/share/jupyter/lab",
                          "JUPYTER_CONFIG_PATH": "{ROOT}/.venv/etc/jupyter"}}
c.Spawner.args = ["--LabApp.expose_app_in_browser=True"]  # the test drives JupyterLab through window.jupyterapp
c.JupyterHub.services = [{{"name": "hvd-test", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [{{"name": "hvd-test", "services": ["hvd-test"],
                             "scopes": ["admin:users", "admin:servers", "access:servers", "read:users"]}}]
""")
        log = open(base / "hub.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "jupyterhub", "-f", str(state / "test_config.py")],
                                cwd=state, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "HVD_HUB_PYTHON": str(python)})
        url = f"http://127.0.0.1:{port}"
        wait_for_server(f"{url}/hub/api/", proc, base / "hub.log", "JupyterHub")
        yield {"url": url, "token": token, "password": password, "leases": leases, "log": base / "hub.log",
               "python": python}
    finally:
        if proc is not None:
            proc.terminate()  # cleanup_servers: the users' servers stop, their kernels and clusters with them
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
        _remove_users()
        put_modes_back(changed)
        shutil.rmtree(base, ignore_errors=True)


def _api(hub, path: str, method: str = "GET", data: dict | None = None):
    request = urllib.request.Request(f"{hub['url']}{path}", method=method,
                                     data=None if data is None else json.dumps(data).encode(),
                                     headers={"Authorization": f"token {hub['token']}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        body = response.read()
        return json.loads(body) if body else None


def _login(browser, hub, user: str):
    """A page of ``user``'s JupyterLab with hub.ipynb open and its kernel idle, after the hub's login."""
    page = browser.new_context(viewport={"width": 1300, "height": 900}).new_page()
    page.goto(f"{hub['url']}/hub/login")
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", hub["password"])
    page.click("input[type=submit], button[type=submit]")
    try:
        page.wait_for_url(f"**/user/{user}/lab**", timeout=150_000)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / f"hub-{user}-login.png"), full_page=True)
        raise AssertionError(f"{user}'s JupyterLab did not open (at {page.url}); the hub's log:\n"
                             + hub["log"].read_text()[-4000:]) from None
    page.goto(f"{hub['url']}/user/{user}/lab/tree/hub.ipynb")
    try:
        page.wait_for_function("""() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
            const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
            return !!k && k.status === 'idle'; }""", timeout=120_000, polling=250)
    except Exception:
        page.screenshot(path=str(ARTIFACTS / f"hub-{user}-kernel.png"), full_page=True)
        raise AssertionError(f"{user}'s notebook kernel did not start; the hub's log (with the servers'):\n"
                             + hub["log"].read_text()[-6000:]) from None
    return page


def _login_refused(browser, hub, user: str) -> bool:
    """Does the hub's login page refuse ``user`` with the right password?"""
    page = browser.new_context().new_page()
    page.goto(f"{hub['url']}/hub/login")
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", hub["password"])
    page.click("input[type=submit], button[type=submit]")
    page.wait_for_load_state()
    refused = "/hub/login" in page.url and f"/user/{user}" not in page.url
    page.context.close()
    return refused


def _run(page, i: int, timeout: float = 180) -> str:
    """Run cell ``i`` of the open notebook; its output's text."""
    page.evaluate(RUN_CELL, i)
    page.wait_for_function(CELL_DONE, arg=i, timeout=timeout * 1000, polling=250)
    return page.evaluate(CELL_TEXT, i)


def _terminal(hub, user: str, commands: str) -> str:
    """Run ``commands`` in a new Jupyter terminal of ``user`` (their own login shell); what it printed."""
    import websocket

    name = _api(hub, f"/user/{user}/api/terminals", "POST", {})["name"]
    ws = websocket.create_connection(f"{hub['url'].replace('http', 'ws')}/user/{user}/terminals/websocket/{name}",
                                     header=[f"Authorization: token {hub['token']}"], timeout=30)
    out = []
    try:
        ws.send(json.dumps(["stdin", commands + "; echo END-$((6*7))\r"]))  # (the command line echoed is not the end)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "END-42" not in "".join(out):
            kind, *rest = json.loads(ws.recv())
            if kind == "stdout":
                out.append(rest[0])
    finally:
        ws.close()
    return re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]|\x1b\][^\x07]*\x07", "", "".join(out)).replace("\r\n", "\n")


def _list_all(hub) -> str:
    done = subprocess.run([hub["python"], "-m", "hvd_notebook.cli", "list", "--all"], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "HVD_NOTEBOOK_LEASE_DIR": str(hub["leases"])})
    assert done.returncode == 0, done.stderr
    return done.stdout


def _processes_of(user: str, word: str) -> list[int]:
    found = subprocess.run(["pgrep", "-u", user, "-f", word], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


def test_two_users_share_a_gpu_node_through_a_real_jupyterhub(hub):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    alice, bob = USERS
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
        try:
            assert _login_refused(browser, hub, "root")  # (allowed in the test's config, blocked in the shipped one)
            a = _login(browser, hub, alice)
            started = _run(a, 0)
            assert "Started 2 MPI ranks" in started and "GPU 0" in started and "GPU 1" in started, started
            assert f"at most 2 GPU(s) per user, a cluster stops after {IDLE} s without a %%hvd cell" in started
            trained = _run(a, 1)
            assert "trained: rank 0 loss" in trained and "Error" not in trained, trained
            trained_at = time.monotonic()
            a.screenshot(path=str(ARTIFACTS / "hub-alice.png"), full_page=True)

            b = _login(browser, hub, bob)
            refused = _run(b, 0)
            figure(f"bob asks for 2 GPUs while alice holds 2 of 3:\n{refused.strip()}")
            assert "-n 2 needs 2 GPU(s), but only 1 of this host's 3 (2) are free" in refused, refused
            assert f"GPU 0 by {alice}" in refused and f"GPU 1 by {alice}" in refused, refused
            one = _run(b, 1)
            assert "Started 1 MPI ranks" in one and "GPU 2" in one, one

            listing = _list_all(hub)
            figure(f"the admin's hvd-notebook list --all:\n{listing}")
            rows = {line.split()[0]: line for line in listing.splitlines()[1:] if line.startswith("hvdt-")}
            assert "0,1" in rows[alice] and "(running)" in rows[alice], listing
            assert "  2  " in rows[bob] or rows[bob].split()[5] == "2", listing
            assert f"GPU 0: {alice}" in listing and f"GPU 2: {bob}" in listing, listing

            # bob's JupyterLab panel: his cluster with its rank; alice's only as a lease line
            seen = _api(hub, f"/user/{bob}/hvd-notebook/clusters")
            figure(f"bob's panel, as its server extension answers:\n{json.dumps(seen, indent=1)[:1500]}")
            assert seen["user"] == bob, seen
            assert [(c["n"], c["ranks"][0]["device"]) for c in seen["clusters"]] == [(1, "GPU 2")], seen
            assert [(o["user"], o["gpus"], o["ranks"]) for o in seen["others"]] == [(alice, ["0", "1"], 2)], seen
            assert f"hvd_notebook-{alice}" not in json.dumps(seen)  # (nothing of her folders, her processes)
            assert seen["caps"] == {"max_gpus_per_user": 2, "max_ranks_per_user": None, "my_gpus": 1,
                                    "my_cpu_ranks": 0}, seen["caps"]  # (the admin's rules, from the kernelspec)
            b.evaluate("() => window.jupyterapp.commands.execute('hvd-notebook:open-panel')")
            b.wait_for_selector("#hvd-notebook-panel .hvd-other-lease", timeout=30_000)
            assert b.inner_text("#hvd-notebook-panel .hvd-other-lease").startswith(f"{alice}: 2 ranks, GPUs 0, 1")
            caps = b.inner_text("#hvd-notebook-panel .hvd-caps")  # (shown without a driver too)
            assert caps == "at most 2 GPUs per user; you hold 1", caps
            b.screenshot(path=str(ARTIFACTS / "hub-bob-panel.png"))
            with pytest.raises(urllib.error.HTTPError) as not_his:  # alice's cluster is not his to stop
                _api(hub, f"/user/{bob}/hvd-notebook/clusters/{rows[alice].split()[1]}/stop", "POST", {})
            assert not_his.value.code == 404

            # bob's own shell: alice's cluster folder is not his to list or read, her ranks not his to signal
            rank = _processes_of(alice, "ipyparallel")[0]
            # and the notebook kernels' own channels are Unix sockets in each user's 0700 runtime folder
            runtime = ".local/share/jupyter/runtime"
            shell = _terminal(hub, bob, f"whoami; ls /tmp/hvd_notebook-{alice}; echo ls=$?; "
                                        f"cat /tmp/hvd_notebook-{alice}/*/owner; echo cat=$?; "
                                        f"kill -TERM {rank}; echo kill=$?; "
                                        f"ls {pwd.getpwnam(alice).pw_dir}/{runtime}; echo runtime=$?; "
                                        f"grep -ho '\"transport\": \"[a-z]*\"' ~/{runtime}/kernel-*.json")
            figure(f"bob's terminal:\n{shell.strip()}")
            assert bob in shell.splitlines() and "Permission denied" in shell, shell
            assert "ls=2" in shell and "cat=1" in shell and "kill=1" in shell and "runtime=2" in shell, shell
            assert '"transport": "ipc"' in shell and '"transport": "tcp"' not in shell, shell
            assert rank in _processes_of(alice, "ipyparallel")

            # alice's cluster ran no cell for IDLE s: released, and her next cell says so
            deadline = trained_at + IDLE + 30
            while _processes_of(alice, "ipyparallel") and time.monotonic() < deadline:
                time.sleep(1)
            assert not _processes_of(alice, "ipyparallel"), "alice's idle cluster was not released"
            again = _run(b, 2)
            assert "Started 2 MPI ranks" in again and "GPU 0" in again and "GPU 1" in again, again
            told = _run(a, 2)
            figure(f"alice's next cell:\n{told.strip()}")
            assert "This notebook's cluster was stopped at" in told and "GPU(s) 0,1 released" in told, told
            assert f"no %%hvd cell for {IDLE} s" in told and "%hvd restart" in told, told
            a.screenshot(path=str(ARTIFACTS / "hub-alice-released.png"), full_page=True)
            assert "Cluster stopped." in _run(b, 3)
            back = _run(a, 3)  # %hvd restart --replay: her cluster and its set-up come back
            assert "Restarted 2 MPI ranks" in back and "Replayed 1 cell(s)." in back, back
        finally:
            browser.close()
