"""The clusters panel and the status-bar item in a real JupyterLab in a real browser (Debian's chromium, driven
by Playwright), over a real 2-rank cluster: the panel lists it with its ranks; their CPU figures move while a
cell trains; a stall in a named collective and a breakpoint show as such; the GPU columns are there where the
driver answers and absent where it does not; a job of ``hvd-notebook run`` is listed by its command and stopped
from its row; Stop (confirmed in its dialog) leaves no process, and the notebook's next ``%%hvd`` says the
cluster was stopped from the panel; a suspended cluster shows with its size and resume line, and its Delete
(confirmed) removes it. (The user's other clusters, of tests running beside this one, are in the
panel too: this notebook's is found by its name.) Another user's clusters (processes of another uid: root's run)
are one line of the panel: a test of their own. Screenshots go to build/test-artifacts/ (docs/img/jupyterlab-*.png
are taken from there)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import CELL_DONE, CELL_TEXT, CLI, KERNEL_IDLE, RUN_CELL, artifacts_dir, browser_page, figure, jupyter_lab
from test_lab_http import make_suspended
from test_lab_panel import another_users_clusters, nvml_gpus

CELLS = [
    "%load_ext hvd_notebook\n%hvd start -n 2 --env HOROVOD_STALL_CHECK_TIME_SECONDS=1",
    """%%hvd
import time
import numpy as np, keras
rng = np.random.default_rng(hvd.rank())
x = rng.normal(size=(16384, 32)).astype('float32'); y = (x[:, 0] > 0).astype('int64')
model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation='relu'),
                          keras.layers.Dense(2, activation='softmax')])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss='sparse_categorical_crossentropy')
model.fit(x, y, batch_size=32, epochs=2, verbose=0)""",
    "%%hvd\nif hvd.rank() == 1:\n    time.sleep(6)\nhvd.allreduce(np.ones(1), name='late_gradient')",
    "%%hvd\nhvd.breakpoint(rank=1)\nprint('went on')",
    "%%hvd\ntime.sleep(120)",
    "%%hvd\nprint('after the stop')",
]
TRAIN, STALL, BREAK, LONG, AFTER = 1, 2, 3, 4, 5
BUILT = Path(__file__).resolve().parents[2] / "hvd_notebook" / "lab" / "labextension"  # (make install builds it)

# this notebook's cluster in the panel (the user's other clusters, of tests beside this one, are listed too)
MINE = "[...document.querySelectorAll('#hvd-notebook-panel .hvd-cluster')]" \
       ".find(c => (c.querySelector('.hvd-open-notebook') || {dataset: {}}).dataset.path === 'panel.ipynb')"
CLUSTER = f"() => {{ const c = {MINE}; " \
          "return c ? {state: c.dataset.state, text: c.querySelector('.hvd-cluster-state').innerText, " \
          "cpu: [...c.querySelectorAll('td.hvd-rank-cpu')].map(td => td.dataset.cpu), " \
          "ranks: c.querySelectorAll('tr.hvd-rank-row').length, " \
          "gpu_cells: c.querySelectorAll('td.hvd-rank-gpu-util, td.hvd-rank-gpu-mem').length, " \
          "node_gpus: !(document.querySelector('#hvd-notebook-panel .hvd-node-gpus') || {hidden: true}).hidden} " \
          ": null; }"
STATE_IS = f"(s) => {{ const c = {MINE}; return !!c && c.dataset.state === s; }}"
JOB = "[...document.querySelectorAll('#hvd-notebook-panel .hvd-cluster')]" \
      ".find(c => (c.querySelector('.hvd-cluster-command') || {}).innerText?.includes('slow_job.py'))"


def _built() -> None:
    if not (BUILT / "package.json").exists():
        pytest.fail(f"the JupyterLab extension is not built ({BUILT} is missing): make install builds it with npm "
                    "(as root it installs Debian's nodejs and npm; else run `sudo apt-get install nodejs npm` first)")


def test_the_panel_shows_the_users_ranks_live_and_stops_the_cluster(tmp_path, monkeypatch):
    from playwright.sync_api import sync_playwright

    _built()
    node, runtime = tmp_path / "node", tmp_path / "run"
    runtime.mkdir(mode=0o700)  # (the private folder of the lab, its kernels and this test: a suspended one planted)
    monkeypatch.setenv("HVD_NOTEBOOK_LEASE_DIR", str(node))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))
    artifacts = artifacts_dir()
    samples = []
    with jupyter_lab(tmp_path, {"panel.ipynb": CELLS}, {"HVD_NOTEBOOK_LEASE_DIR": str(node),
                                                         "XDG_RUNTIME_DIR": str(runtime)}) as lab, \
            sync_playwright() as pw:
        browser, page = browser_page(pw, 1500, 950)

        def wait(condition: str, seconds: float, what: str, arg=None) -> None:
            try:
                page.wait_for_function(condition, arg=arg, timeout=seconds * 1000, polling=250)
            except Exception:
                name = re.sub(r"\W+", "-", what)
                page.screenshot(path=str(artifacts / f"panel-missing-{name}.png"))
                raise AssertionError(f"no {what} in {seconds:g} s; the panel shows:\n"
                                     + page.inner_text("#hvd-notebook-panel") + "\nthe notebook:\n"
                                     + page.inner_text(".jp-Notebook")[-3000:] + "\nlab log:\n"
                                     + lab["log"].read_text()[-3000:]) from None

        def run(i: int) -> None:
            page.evaluate(RUN_CELL, i)

        try:
            page.goto(f"{lab['url']}/lab/tree/panel.ipynb?token={lab['token']}")
            wait(KERNEL_IDLE, 90, "idle kernel")
            page.evaluate("() => window.jupyterapp.commands.execute('hvd-notebook:open-panel')")
            wait("() => !!document.querySelector('#hvd-notebook-panel .hvd-cluster, #hvd-notebook-panel .hvd-empty')",
                 30, "the panel's first answer")
            none_yet = page.evaluate(f"() => !{MINE}")
            status_before = page.locator("#hvd-notebook-status").is_visible()

            run(0)
            wait(STATE_IS, 120, "idle cluster in the panel", "idle")
            wait(CELL_DONE, 60, "end of %hvd start", 0)
            lab["watch"]()
            wait("() => (document.querySelector('#hvd-notebook-status') || {}).innerText?.includes('2 ranks')", 30,
                 "status-bar item")
            status = page.inner_text("#hvd-notebook-status")

            run(TRAIN)  # the CPU figures while it trains
            wait(STATE_IS, 60, "running cell", "running")
            shot = False
            while not page.evaluate(CELL_DONE, TRAIN):
                sample = page.evaluate(CLUSTER)
                samples.append(sample)
                busy = [float(c) for c in sample["cpu"] if c]
                running_for = sum(s["state"] == "running" for s in samples)  # (a few seconds of history drawn)
                if not shot and running_for >= 8 and len(busy) == 2 and min(busy) > 20:
                    page.screenshot(path=str(artifacts / "jupyterlab-panel.png"))
                    shot = True
                time.sleep(0.5)
            trained = page.evaluate(CELL_TEXT, TRAIN)

            run(STALL)
            wait(STATE_IS, 60, "stall", "stalled")
            stalled = page.evaluate(CLUSTER)["text"]
            page.screenshot(path=str(artifacts / "jupyterlab-panel-stall.png"))
            wait(CELL_DONE, 60, "end of the stalled cell", STALL)

            run(BREAK)
            wait(STATE_IS, 60, "breakpoint", "breakpoint")
            at_breakpoint = page.evaluate(CLUSTER)["text"]
            stdin = page.locator(".jp-Stdin-input").last
            stdin.wait_for(state="visible", timeout=30_000)
            stdin.fill("c")
            stdin.press("Enter")
            wait(CELL_DONE, 60, "end of the breakpoint's cell", BREAK)
            wait(STATE_IS, 30, "idle after the breakpoint", "idle")

            # a job of hvd-notebook run beside it: listed by its command line, with its ranks; Stop ends it
            script = tmp_path / "slow_job.py"
            script.write_text("import time\ntime.sleep(120)\n")
            job = subprocess.Popen(CLI + ["run", "-np", "2", sys.executable, str(script)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            try:
                wait(f"() => {JOB}?.querySelectorAll('tr.hvd-rank-row').length === 2", 90, "the job's ranks")
                job_state, job_title = page.evaluate(f"() => [{JOB}.querySelector('.hvd-cluster-state').innerText, "
                                                     f"{JOB}.querySelector('.hvd-cluster-command').innerText]")
                page.screenshot(path=str(artifacts / "jupyterlab-panel-job.png"))
                page.locator("#hvd-notebook-panel .hvd-cluster", has=page.locator(".hvd-cluster-command",
                             has_text="slow_job.py")).locator(".hvd-action-stop").click()
                page.click(".jp-Dialog .jp-mod-accept")
                wait(f"() => !{JOB}", 60, "the job gone")
                job_err = job.communicate(timeout=30)[1]
            finally:
                if job.poll() is None:
                    job.kill()
                    job.communicate()

            run(LONG)  # Stop from the panel, while a cell runs
            wait(STATE_IS, 60, "running cell", "running")
            lab["watch"]()
            mine = page.locator("#hvd-notebook-panel .hvd-cluster",
                                has=page.locator(".hvd-open-notebook[data-path='panel.ipynb']"))
            mine.locator(".hvd-action-stop").click()
            page.click(".jp-Dialog .jp-mod-accept")
            wait(f"() => !{MINE}", 120, "the cluster gone")
            wait(CELL_DONE, 60, "end of the interrupted cell", LONG)
            status_after = page.locator("#hvd-notebook-status").is_visible()
            run(AFTER)
            wait(CELL_DONE, 60, "the next cell", AFTER)
            told = page.evaluate(CELL_TEXT, AFTER)
            page.screenshot(path=str(artifacts / "jupyterlab-panel-stopped.png"))

            # a suspended cluster: its row with its size and resume line; Delete, confirmed, removes it
            suspended = make_suspended(None, "hvd-4242-1")
            row = "#hvd-notebook-panel .hvd-suspended-entry[data-id='hvd-4242-1']"
            page.wait_for_selector(row, timeout=30_000)
            suspended_row = page.inner_text(row)
            page.screenshot(path=str(artifacts / "jupyterlab-panel-suspended.png"))
            page.click(f"{row} .hvd-suspended-delete")
            page.click(".jp-Dialog .jp-mod-accept")
            wait(f"() => !document.querySelector(\"{row}\")", 30, "the suspended row gone")
            deleted = not suspended.exists()
        finally:
            browser.close()

    assert none_yet and not status_before
    assert re.fullmatch(r"hvd · 2 ranks · CPU · idle \d+:\d\d", status.strip()), status
    running = [s for s in samples if s["state"] == "running"]
    moving = {tuple(s["cpu"]) for s in running if all(s["cpu"])}
    figure(f"the panel's CPU figures while the cell trained: {[s['cpu'] for s in running][:12]}")
    assert len(moving) >= 3 and max(float(c) for cpu in moving for c in cpu) > 20, running
    assert all(s["ranks"] == 2 for s in samples) and "Error" not in trained, trained
    if nvml_gpus() is None:  # no driver: no GPU columns; a driver: two per rank, and the node's GPUs
        assert not any(s["gpu_cells"] or s["node_gpus"] for s in samples), samples[-1]
    else:
        assert all(s["gpu_cells"] == 2 * s["ranks"] and s["node_gpus"] for s in samples), samples[-1]
    assert "late_gradient" in stalled and stalled.startswith("stalled"), stalled
    assert "rank 1" in at_breakpoint and "breakpoint" in at_breakpoint, at_breakpoint
    assert re.fullmatch(r"running \d+:\d\d", job_state.strip()), job_state  # (a script runs no cell)
    assert job_title == f"{Path(sys.executable).name} slow_job.py", job_title
    assert job.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in job_err, job_err
    assert not status_after
    assert "stopped from the JupyterLab panel at" in told, told
    assert re.search(r"^2 ranks, [\d.]+ KiB on disk, since \d\d:\d\d$", suspended_row, re.M), suspended_row
    assert "%hvd resume hvd-4242-1" in suspended_row and deleted, suspended_row


def test_another_users_clusters_are_one_line_of_the_panel(tmp_path):
    """User nobody's two clusters (their kernels: processes of uid 65534, one holding the leases of GPUs 2 and 3)
    show as one line: the user, their ranks, the GPUs their leases hold (not those their cards claim), since
    when; nothing of their kernels or directories."""
    from playwright.sync_api import sync_playwright

    _built()
    with another_users_clusters() as (node, secret), \
            jupyter_lab(tmp_path, {}, {"HVD_NOTEBOOK_LEASE_DIR": str(node)}) as lab, sync_playwright() as pw:
        browser, page = browser_page(pw, 1200, 800)
        try:
            page.goto(f"{lab['url']}/lab?token={lab['token']}")
            page.wait_for_function("() => !!window.jupyterapp?.commands.hasCommand('hvd-notebook:open-panel')",
                                   timeout=90_000)
            page.evaluate("() => window.jupyterapp.restored.then(() => null)")  # (then the sidebar stays ours)
            page.evaluate("() => window.jupyterapp.commands.execute('hvd-notebook:open-panel')")
            page.wait_for_selector("#hvd-notebook-panel .hvd-other-lease", timeout=60_000)
            others = page.locator("#hvd-notebook-panel .hvd-other-lease").all_inner_texts()
            panel_text = page.inner_text("#hvd-notebook-panel")
            page.screenshot(path=str(artifacts_dir() / "jupyterlab-panel-others.png"))
        finally:
            browser.close()
    assert len(others) == 1 and re.fullmatch(r"nobody: 5 ranks, GPUs 2, 3, since \d\d:\d\d", others[0]), others
    assert secret not in panel_text, panel_text
