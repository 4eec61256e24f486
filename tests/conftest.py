"""The tests' one harness: a real IPython shell with the extension loaded, one 2-rank cluster shared by
the tests that only run cells, real Jupyter kernels (``started_kernel``, ``execute``) and stand-in
kernel processes (``Kernel``), and proof by PID that every process a test started is gone afterwards."""

from __future__ import annotations

import concurrent.futures
import contextlib
import getpass
import os
import re
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

# tests/parallel/ runs inside an MPI world, started by tests/integration/test_parallel.py; tests/horovod_examples/
# holds Horovod's own scripts, which tests/integration/test_horovod_examples.py runs (never collected)
collect_ignore = ["horovod_examples"] + ([] if os.environ.get("HVD_PARALLEL") else ["parallel"])

os.environ.setdefault("HVD_NOTEBOOK_GPUS", "")  # CPU ranks in tests unless a GPU test says otherwise
# a warm standby doubles every cluster's ranks on 2 cores: only tests/integration/test_standby.py asks for one
os.environ.setdefault("HVD_NOTEBOOK_STANDBY", "off")


# `make test`'s two pytest runs: "beside" (the tests that hold with others running beside them, on the
# xdist workers) and "alone" (those marked alone, after); unset, every test. An -m of one's own still applies.
PHASE = os.environ.get("HVD_TEST_PHASE", "")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if PHASE not in ("", "beside", "alone"):
        raise pytest.UsageError(f"HVD_TEST_PHASE={PHASE!r}: give beside, alone, or leave it unset.")
    if not PHASE:
        return
    kept: list[pytest.Item] = []
    dropped: list[pytest.Item] = []
    for item in items:
        (kept if (item.get_closest_marker("alone") is not None) == (PHASE == "alone") else dropped).append(item)
    config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """What each rank of the parallel tier's worlds counted (``integration/test_parallel.py`` records it),
    so that the inner skips show in every run, not only in a failure's output."""
    lines = [value for reports in terminalreporter.stats.values() for r in reports
             for key, value in getattr(r, "user_properties", ()) if key == "inner" and r.when == "call"]
    if lines:
        terminalreporter.section("the parallel tier, inside its worlds")
        for line in sorted(lines):
            terminalreporter.write_line(line)


ROOT_DIR = Path(__file__).resolve().parent.parent  # the clone
ARTIFACTS = ROOT_DIR / "build" / "test-artifacts"


def artifacts_dir() -> Path:
    """Where tests leave what they measured or saw (figures, screenshots): build/test-artifacts/, or, where
    the clone cannot be written (it belongs to another user, as in scripts/test-unprivileged.sh's run),
    ``$TMPDIR/hvd_notebook-test-artifacts-$USER``."""
    path = existing = ARTIFACTS
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        path = Path(tempfile.gettempdir()) / f"hvd_notebook-test-artifacts-{getpass.getuser()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def figure(text: str) -> None:
    """A measured figure that README.md's tables quote: appended to
    build/test-artifacts/figures.txt (and shown with pytest -s)."""
    with (artifacts_dir() / "figures.txt").open("a") as f:
        f.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
    sys.__stderr__.write(f"\n[figure] {text}\n")


def left_running(marker: str) -> list[str]:
    """Processes of this user whose command line names ``marker`` (a test's own tmp path)."""
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            if p.info["cmdline"] and any(marker in a for a in p.info["cmdline"]) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(f"{p.pid} {' '.join(p.info['cmdline'])}")
        except psutil.Error:
            pass
    return found


def holds_for(check: Callable[[], bool], seconds: float) -> bool:
    """Does ``check()`` hold for ``seconds`` (asked every 50 ms)? False as soon as it does not: for a
    negative check (a process left alive, a file never made), which a fixed sleep would answer only at its
    end."""
    deadline = time.monotonic() + seconds
    while check():
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)
    return False


def comes_within(check: Callable[[], Any], seconds: float, every: float = 0.1) -> Any:
    """The first true answer of ``check()`` within ``seconds`` (asked every ``every`` s), else its last (false)
    answer: for a state the test waits for (a cell under way, a card that says busy), which a fixed sleep
    would either overshoot or miss on a loaded machine."""
    deadline = time.monotonic() + seconds
    while True:
        answer = check()
        if answer or time.monotonic() >= deadline:
            return answer
        time.sleep(every)


def assert_gone(pids: Iterable[int], timeout: float = 15.0) -> None:
    """Fail unless every process in ``pids`` has exited within ``timeout`` seconds."""
    pids = set(pids)
    assert pids, "no PIDs were recorded: the test proves nothing"
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid} {' '.join(p.cmdline())[:100]}")
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return
        if time.monotonic() > deadline:
            pytest.fail("processes left running:\n" + "\n".join(alive))
        time.sleep(0.2)


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_server(url: str, proc: subprocess.Popen, log: Path, what: str, timeout: float = 60) -> None:
    """Until ``url`` answers; ``pytest.fail`` with the end of ``log`` where ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"{what} did not start:\n" + log.read_text()[-3000:])
            time.sleep(0.3)


CHROMIUM = "/usr/bin/chromium"
# JavaScript for a page of JupyterLab (``--LabApp.expose_app_in_browser``) with a notebook in focus: run cell i
# (not awaited: the call returns at once), whether it has run and the kernel is idle again, its output's text
RUN_CELL = """(i) => {
  const notebook = window.jupyterapp.shell.currentWidget.content;
  notebook.activeCellIndex = i;
  window.jupyterapp.commands.execute('notebook:run-cell');
}"""
CELL_DONE = """(i) => {
  const w = window.jupyterapp.shell.currentWidget;
  const k = w.sessionContext.session && w.sessionContext.session.kernel;
  const cell = w.content.widgets[i];
  return cell.model.executionCount !== null && !!k && k.status === 'idle';
}"""
CELL_TEXT = "(i) => window.jupyterapp.shell.currentWidget.content.widgets[i].outputArea.node.innerText"
KERNEL_IDLE = """() => {
  const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.status === 'idle';
}"""


@contextlib.contextmanager
def jupyter_lab(tmp_path: Path, notebooks: dict[str, list[str]], env: dict[str, str] | None = None) -> Iterator[dict]:
    """A real JupyterLab on a free localhost port, in a private directory, serving ``notebooks`` (name: its
    cells' sources); its kernels shut down at the end, and every cluster process they started gone. Yields
    its url, token, log, the notebooks' folder, and ``watch()``, which notes the cluster processes now
    running (checked gone at the end)."""
    import nbformat

    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install Debian's chromium as root (`sudo apt-get install chromium`; "
                    "`make install` does it when run as root). Nothing else of the suite needs root.")
    work = tmp_path / "work"  # the file browser shows this folder only, not the server's state below
    work.mkdir()
    for name, cells in notebooks.items():
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, work / name)
    # no "get notified about Jupyter news?" pop-up over the page
    settings = tmp_path / "settings" / "@jupyterlab" / "apputils-extension"
    settings.mkdir(parents=True)
    (settings / "notification.jupyterlab-settings").write_text('{"fetchNews": "false", "checkForUpdates": false}')
    port, token = free_port(), secrets.token_hex(16)
    lab_env = {**os.environ, "HVD_NOTEBOOK_GPUS": "", "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
               "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "workspaces"), "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"),
               "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "settings"), **(env or {})}
    lab_env.pop("HVD_NOTEBOOK_PROGRESS", None)
    cmd = [sys.executable, "-m", "jupyter", "lab", "--no-browser", f"--port={port}", "--ServerApp.ip=127.0.0.1",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={work}",
           "--LabApp.expose_app_in_browser=True", "--ServerApp.open_browser=False"]
    if os.geteuid() == 0:
        cmd.append("--allow-root")
    log = open(tmp_path / "lab.log", "w")
    proc = subprocess.Popen(cmd, env=lab_env, stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    lab_process = psutil.Process(proc.pid)
    seen: set[int] = set()

    def cluster_processes_of_lab() -> set[int]:
        pids = set()
        for child in lab_process.children(recursive=True):
            try:
                if any(n in " ".join(child.cmdline()) for n in ("ipyparallel", "hydra_pmi_proxy", "mpiexec")):
                    pids.add(child.pid)
            except psutil.Error:
                pass
        return pids

    try:
        wait_for_server(f"{url}/api/status?token={token}", proc, tmp_path / "lab.log", "JupyterLab")
        yield {"url": url, "token": token, "watch": lambda: seen.update(cluster_processes_of_lab()),
               "log": tmp_path / "lab.log", "work": work}
        seen |= cluster_processes_of_lab()
    finally:
        proc.terminate()  # shuts its kernels down; a kernel's exit stops its cluster
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    if seen:
        assert_gone(seen, timeout=30)


def browser_page(pw, width: int = 1400, height: int = 1000):
    """Debian's chromium, headless, driven by Playwright: (browser, a new page)."""
    browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"])
    return browser, browser.new_page(viewport={"width": width, "height": height})


def let_others_traverse(paths: Iterable[Path]) -> list[tuple[Path, int]]:
    """Let other users reach ``paths`` (the suite's environment, and the interpreter it was made from, which may
    lie under root's home): o+x (traverse only, not read) on each folder above them that lacks it, as
    scripts/test-unprivileged.sh gives its user; the folders changed, with their old modes, for
    ``put_modes_back``. (Its two users, the hub test and the hostile module, never run at the same time: the
    hostile module is marked ``alone``.)"""
    changed: list[tuple[Path, int]] = []
    for path in paths:
        for folder in reversed(Path(path).parents):
            mode = folder.stat().st_mode & 0o7777
            if not mode & 0o001:  # (a folder already changed has it now: changed once)
                folder.chmod(mode | 0o001)
                changed.append((folder, mode))
    return changed


def put_modes_back(changed: list[tuple[Path, int]]) -> None:
    for folder, mode in reversed(changed):
        folder.chmod(mode)


class FakeController:
    """The part of ipyparallel's ``Client`` that asks the controller for its queues, as
    ``hvd_notebook.cluster.launching.channel.RankChannel`` sends the question: a subclass answers with
    ``queues(targets)`` (None: every engine); ``silent`` is a controller that never answers (stopped or hung)."""

    silent = False
    _query_stream = "query"

    def queues(self, targets: list[int] | None) -> dict:
        raise NotImplementedError

    def _build_targets(self, targets: list[int]) -> tuple[None, list[int]]:
        return None, list(targets)

    def _send(self, stream: str, msg_type: str, content: dict) -> concurrent.futures.Future:
        assert (stream, msg_type) == ("query", "queue_request"), (stream, msg_type)
        reply: concurrent.futures.Future = concurrent.futures.Future()
        if not self.silent:
            reply.set_result({"content": {"status": "ok", **{str(k): v for k, v in
                                                             self.queues(content["targets"]).items()}}})
        return reply

    def _unwrap_exception(self, content: dict) -> Exception:
        return RuntimeError(content)


@pytest.fixture
def sleeper():
    """A real process that does nothing for a minute (a stand-in owner, e.g. another notebook's kernel)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def cluster_processes() -> set[int]:
    """PIDs of the ipyparallel/mpiexec processes descended from this test process
    (other clusters on the machine, such as a benchmark's, are not ours)."""
    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if any(name in cmd for name in ("ipyparallel", "hydra_pmi_proxy", "mpiexec",
                                        "hvd_notebook.cluster.processes.reaper")):
            out.add(p.pid)
    return out


class ProcessWatch:
    """Samples cluster processes in a background thread while a failing start
    runs, so the test can prove afterwards that each one it saw is gone."""

    def __init__(self) -> None:
        self.before = cluster_processes()
        self.seen: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.seen |= cluster_processes() - self.before
            time.sleep(0.1)

    def __enter__(self) -> ProcessWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture(scope="session")
def ip():
    """A real IPython shell (the one IPython's own tests use) with %load_ext hvd_notebook."""
    from IPython.testing.globalipapp import start_ipython

    from hvd_notebook.kernel.session import Session

    shell = start_ipython()
    shell.run_line_magic("load_ext", "hvd_notebook")
    yield shell
    Session.get().stop()


@pytest.fixture(scope="module")
def cluster(ip):
    """One running 2-rank cluster for a module's tests that only run cells;
    stopped and proven gone at the end of the module."""
    from hvd_notebook.kernel.session import Session

    session = Session.get()
    if session.cluster is None:
        ip.run_line_magic("hvd", "start -n 2")
    assert session.cluster is not None
    yield session.cluster
    pids = session.cluster.pids() if session.cluster else set()
    ip.run_line_magic("hvd", "stop")
    if pids:
        assert_gone(pids)


@pytest.fixture
def session(ip):
    """The kernel's Session with no cluster; whatever cluster the test starts is stopped and proven gone."""
    from hvd_notebook.kernel.session import Session

    s = Session.get()
    assert s.cluster is None, "another test left a cluster running"
    yield s
    pids = s.cluster.pids() if s.cluster else set()
    s.stop()
    if pids:
        assert_gone(pids)


@pytest.fixture
def run(ip, capsys):
    """Run a cell in the shell; return (ExecutionResult, stdout+stderr without colours)."""

    def _run(source: str):
        result = ip.run_cell(source)
        captured = capsys.readouterr()
        return result, re.sub(r"\x1b\[[0-9;]*m", "", captured.out + captured.err)

    return _run


# ------------------------------------------------------------------ kernels
CLI = [sys.executable, "-m", "hvd_notebook.cli"]


def interrupt_blocked_cell(km, kc, cell: str, limit: float) -> tuple[set[int], dict, str, float, float]:
    """Run ``cell``, in which a rank blocks in a collective, and press the kernel's stop button 3 s into
    it; require the old ranks gone within ``limit`` s. The old ranks' PIDs, the cell's reply and output,
    and the seconds from the interrupt until the ranks were stopped and until the cell returned."""
    _, out = execute(kc, "print('RANKS', [r.pid for r in Session.get().cluster.ranks])")
    old = {int(p) for p in out.split("RANKS", 1)[1].strip().strip("[]").split(",")}
    msg_id = kc.execute(cell)
    time.sleep(3)  # the cell is running; the rank is inside the collective
    t0 = time.monotonic()
    km.interrupt_kernel()
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in old):
        assert time.monotonic() - t0 < limit, f"the ranks were not stopped within {limit} s of the interrupt"
        time.sleep(0.1)
    stopped = time.monotonic() - t0
    reply, out = collect(kc, msg_id)
    return old, reply, out, stopped, time.monotonic() - t0


def cluster_pids(kc) -> set[int]:
    """Every process of the kernel's cluster, as the kernel knows them."""
    _, out = execute(kc, "print('PIDS', sorted(Session.get().cluster.pids()))")
    return {int(p) for p in out.split("PIDS", 1)[1].strip().strip("[]").split(",")}


@contextlib.contextmanager
def started_kernel(env: dict[str, str] | None = None) -> Iterator[tuple[Any, Any]]:
    """A real ipykernel started by jupyter_client, as JupyterLab starts it, with ``env`` added to its
    environment (no GPUs by default): (manager, client); its channels closed and the kernel shut down at
    the end, if the test has not."""
    # ipykernel's own spec runs this interpreter (sys.executable). jupyter_client picks five free TCP
    # ports and the kernel binds them later: another process of the suite may take one between the two,
    # and the kernel dies at start, printing zmq's "Address already in use". That is the fixture's race, not
    # what a test tests: a second start, with new ports. A kernel that dies otherwise fails the test at once,
    # with what it printed.
    km, kc, output = _start_kernel(env)
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=False)  # (a shutdown request, as JupyterLab sends: atexit runs; killed after a wait)
        output.close()


PORT_TAKEN = "Address already in use"  # what zmq says where the kernel cannot bind a port jupyter_client chose


def _start_kernel(env: dict[str, str] | None) -> tuple[Any, Any, Any]:
    """(manager, client, the file its output goes to) of a started kernel; started once more only where the
    first start died of a taken port."""
    from jupyter_client.manager import start_new_kernel

    for attempt in (1, 2):
        output = tempfile.TemporaryFile()
        try:
            km, kc = start_new_kernel(kernel_name="python3", startup_timeout=60, stdout=output, stderr=output,
                                      env={**os.environ, "HVD_NOTEBOOK_GPUS": "", **(env or {})})
            return km, kc, output
        except RuntimeError as exc:
            output.seek(0)
            said = output.read().decode(errors="replace")
            output.close()
            if attempt == 2 or PORT_TAKEN not in said:
                raise RuntimeError(f"{exc}; the kernel printed:\n{said[-4000:]}") from None
    raise AssertionError("unreachable")


def execute(kc, code: str, wait: bool = True) -> tuple[Any, str]:
    """Run ``code`` in a kernel started by ``started_kernel``: the shell reply and the text output (none
    where ``wait`` is False)."""
    msg_id = kc.execute(code)
    if not wait:
        return None, ""
    return collect(kc, msg_id)


def collect(kc, msg_id: str, displays: bool = False) -> tuple[Any, str]:
    """The shell reply and the text output (streams and tracebacks; the plain text of displays too with
    ``displays``) of one request."""
    out = []
    reply = shell_reply(kc, msg_id)
    while True:
        msg = kc.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if is_idle(msg):
            break
        if displays and msg["msg_type"] == "display_data":
            out.append(msg["content"]["data"].get("text/plain", ""))
        out.append(iopub_text(msg) or "")
    return reply, "".join(out)


def shell_reply(kc, msg_id: str, timeout: float = 180) -> dict:
    """The shell channel's reply to request ``msg_id`` (earlier replies skipped)."""
    reply = kc.get_shell_msg(timeout=timeout)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = kc.get_shell_msg(timeout=timeout)
    return reply


def iopub_text(msg: dict) -> str | None:
    """The text of an IOPub stream or error (its traceback) message; None for any other."""
    if msg["msg_type"] == "stream":
        return msg["content"]["text"]
    if msg["msg_type"] == "error":
        return "\n".join(msg["content"]["traceback"])
    return None


def is_idle(msg: dict) -> bool:
    """The kernel's status message that a request has ended."""
    return msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"


KERNEL = """
import sys
from hvd_notebook.cluster import ClusterOptions
from hvd_notebook.kernel.session import Session
session = Session.get()
session.start(ClusterOptions(n={n!r}, gpus={gpus!r}, wait={wait!r}))
cluster = session.cluster
print("READY", cluster.workdir, " ".join(str(p) for p in sorted(cluster.pids())),
      ",".join(r.device.replace(" ", "") for r in cluster.ranks), flush=True)
session.run_cell({cell!r}) if {cell!r} else None
print("CELL-DONE", flush=True)
sys.stdin.read()  # until the test closes stdin; then atexit stops the cluster
"""


class Kernel:
    """A process standing in for a notebook kernel with a running cluster."""

    def __init__(self, gpus: str = "none", n: int | None = 1, env: dict | None = None, cell: str = "",
                 wait: bool = True) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", KERNEL.format(gpus=gpus, n=n, cell=cell, wait=wait)],
                                     cwd=ROOT_DIR,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, env={**os.environ, **(env or {})})
        self.workdir: Path | None = None
        self.pids: set[int] = set()
        self.devices: list[str] = []
        self.error = ""

    def wait_ready(self, timeout: float = 120) -> Kernel:
        deadline, said = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            said.append(line)
            if line.startswith("READY"):
                parts = line.split()  # READY workdir pid pid ... devices
                self.workdir = Path(parts[1])
                self.pids = {int(p) for p in parts[2:-1]}
                self.devices = parts[-1].split(",")
                return self
            if not line and self.proc.poll() is not None:
                self.error = self.proc.stderr.read()
                return self
            if not line:
                time.sleep(0.1)
        self.proc.kill()  # (what it wrote to stderr says where the start was)
        _, err = self.proc.communicate(timeout=30)
        raise AssertionError(f"the kernel did not start its cluster in {timeout:g} s; it printed:\n"
                             + "".join(said)[-2000:] + "\nstderr:\n" + err[-4000:])

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def wait_for_standby(cluster, timeout: float = 120.0) -> set[int]:
    """The processes of ``cluster``'s warm standby, once it is ready."""
    deadline = time.monotonic() + timeout
    while cluster.standby_state == "starting" and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.standby_state == "ready", cluster.standby_state
    return cluster.standby.pids()
