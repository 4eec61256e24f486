"""The dashboard in a real JupyterLab in a real browser (Debian's chromium,
driven by Playwright): it appears under the running cell, its bars move and
reach 100 %, its curve has points, and it freezes into a static summary; a
tab per rank holds that rank's output, with a badge where it wrote to stderr
or failed, and the summary keeps their text; `%hvd debug` after the failed cell takes pdb's commands from
the notebook's input box.

Screenshots go to build/test-artifacts/ (conftest.artifacts_dir: under $TMPDIR where the clone is not
writable). Chromium is the one thing only root can install: without it the test fails and says so."""

from __future__ import annotations

import re
import subprocess
import sys
import time

import nbformat
import pytest
from conftest import KERNEL_IDLE, artifacts_dir, browser_page, jupyter_lab

CELLS = [
    "%load_ext hvd_notebook",
    "%hvd start -n 2",
    """%%hvd
import time
import numpy as np, keras
keras.utils.set_random_seed(0)  # the same start on every rank and in every run (the noise scale read below)
rng = np.random.default_rng(hvd.rank())
x = rng.normal(size=(2048, 8)).astype('float32'); y = (x[:, 0] > 0).astype('int64')
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation='relu'),
                          keras.layers.Dense(2, activation='softmax')])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)),
              loss='sparse_categorical_crossentropy', metrics=['accuracy'])

class Slow(keras.callbacks.Callback):  # a few seconds of training, to watch
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.02)""",
    "%%hvd\nprint(f'rank {hvd.rank()}: {len(x)} samples', flush=True)\n"
    "model.fit(x, y, batch_size=16, epochs=2, verbose=0, callbacks=[Slow()])",
    # a tqdm bar, as a PyTorch loop would have one: it feeds the dashboard instead of printing
    "%%hvd\nfrom tqdm.auto import tqdm\nbar = tqdm(range(40))\nfor i in bar:\n    time.sleep(0.05)\n"
    "    bar.set_postfix(loss=1.0 / (i + 1))",
    # rank 1's output, in its tab; the cell waits until the test has read it (the file RELEASE appears)
    """%%hvd
import os, sys
print(f'hello from rank {hvd.rank()}', flush=True)
if hvd.rank() == 1:
    print('rank 1 says: careful', file=sys.stderr, flush=True)
deadline = time.monotonic() + 120
while not os.path.exists(RELEASE) and time.monotonic() < deadline:
    time.sleep(0.1)""",
    "%%hvd\nprint(f'rank {hvd.rank()} before the error')\nif hvd.rank() == 1:\n"
    "    raise ValueError('rank 1 gives up')",
    "%hvd debug",  # pdb on rank 1, its commands typed into the notebook's input box
    "%hvd stop",
]
FAILING_CELL = len(CELLS) - 3  # run-all stops there; the test runs the last two cells itself

SAMPLE = """() => {
  const bars = [...document.querySelectorAll('.hvd-dashboard .hvd-rank-bar .progress-bar')]
    .map(b => parseFloat(b.style.width || b.style.height || '0'));
  const paths = [...document.querySelectorAll('.hvd-dashboard .hvd-curve path')]
    .map(p => (p.getAttribute('d') || '').split(/[LM]/).length - 1);
  return {bars, points: Math.max(0, ...paths), summary: !!document.querySelector('.hvd-summary'),
          tabs: !!document.querySelector('.hvd-dashboard .hvd-output-tabs')};
}"""

TAB_TITLES = """() => [...document.querySelectorAll('.hvd-output-tabs .lm-TabBar-tab')].map(t => t.innerText.trim())"""

# the static copies of output tabs shown on their own (cells without a dashboard), in the notebook's order
STANDALONE_OUTPUTS = """() => [...document.querySelectorAll('.hvd-outputs')].filter(e => !e.closest('.hvd-summary'))
  .map(e => [...e.querySelectorAll('details')].map(d => ({
    title: d.querySelector('summary').innerText.trim(), open: d.open, text: d.textContent})))"""

CELL_TEXT = "(i => document.querySelectorAll('.jp-Notebook .jp-Cell')[i].innerText)"

RUN_CELL_FROM_END = """(back) => {
  const notebook = window.jupyterapp.shell.currentWidget.content;
  notebook.activeCellIndex = notebook.widgets.length - back;
  window.jupyterapp.commands.execute('notebook:run-cell');
}"""


def wait_or_explain(page, lab, condition: str, timeout_s: float, what: str) -> None:
    """Wait for the JavaScript ``condition``; where it does not come true in ``timeout_s``, fail with a
    screenshot, what the notebook shows and the end of the lab's log (what CI's log needs to tell why)."""
    try:
        page.wait_for_function(condition, timeout=timeout_s * 1000, polling=250)
    except Exception:
        name = re.sub(r"\W+", "-", what).strip("-")[:60]
        page.screenshot(path=str(artifacts_dir() / f"missing-{name}.png"), full_page=True)
        raise AssertionError(f"no {what} in {timeout_s:g} s; the notebook shows:\n"
                             + page.inner_text(".jp-Notebook")[-4000:] + "\nlab log:\n"
                             + lab["log"].read_text()[-3000:]) from None


@pytest.fixture
def lab(tmp_path):
    """JupyterLab with the test notebook (its waiting cell released by the file ``release``)."""
    release = tmp_path / "release"
    cells = [c.replace("RELEASE", repr(str(release))) for c in CELLS]
    with jupyter_lab(tmp_path, {"dashboard.ipynb": cells}) as lab:
        yield {**lab, "notebook": lab["work"] / "dashboard.ipynb", "release": release}


def test_dashboard_in_jupyterlab(lab):
    from playwright.sync_api import sync_playwright

    artifacts = artifacts_dir()
    samples = []
    with sync_playwright() as pw:
        browser, page = browser_page(pw)
        try:
            page.goto(f"{lab['url']}/lab/tree/dashboard.ipynb?token={lab['token']}")
            page.wait_for_function(KERNEL_IDLE, timeout=90_000, polling=250)
            # not awaited: the command's promise resolves only when every cell has run
            page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
            try:
                page.wait_for_selector(".hvd-dashboard", timeout=120_000)
            except Exception:
                page.screenshot(path=str(artifacts / "dashboard-missing.png"), full_page=True)
                raise AssertionError("no dashboard appeared; lab log:\n" + lab["log"].read_text()[-3000:]) from None
            shot_taken = False
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                lab["watch"]()
                sample = page.evaluate(SAMPLE)
                samples.append(sample)
                if sample["summary"]:
                    break
                # (in the second epoch: the curves show where it began)
                if not shot_taken and all(55 < b < 100 for b in sample["bars"]) and sample["points"] > 2:
                    page.evaluate("() => document.querySelector('.hvd-dashboard').scrollIntoView({block: 'end'})")
                    page.screenshot(path=str(artifacts / "dashboard-live.png"), full_page=True)
                    shot_taken = True
                time.sleep(0.2)
            page.wait_for_selector(".hvd-summary img[alt='hvd curves']", timeout=30_000)
            # the tqdm cell's dashboard, then its summary
            wait_or_explain(page, lab, "() => document.querySelectorAll('.hvd-summary').length >= 2", 90,
                            "summary of the tqdm cell")
            # the cell that prints and waits: rank 1 wrote to stderr, so its tabs appear on their own, badged
            wait_or_explain(page, lab, f"() => ({TAB_TITLES})().includes('rank 1 ⚠')", 90, "tab 'rank 1 ⚠'")
            titles = page.evaluate(TAB_TITLES)
            tabs = page.locator(".hvd-output-tabs")
            tabs.scroll_into_view_if_needed()
            rank_0_page, rank_1_page = tabs.locator(".hvd-rank-page-0"), tabs.locator(".hvd-rank-page-1")
            page.wait_for_function("() => (document.querySelector('.hvd-output-tabs .hvd-rank-page-0') || {})"
                                   ".innerText?.includes('hello from rank 0')", timeout=30_000, polling=250)
            rank_1_hidden_first = not rank_1_page.is_visible() and rank_0_page.is_visible()
            tabs.locator(".lm-TabBar-tab", has_text="rank 1").click()
            rank_1_page.wait_for(state="visible", timeout=10_000)
            rank_1_text = rank_1_page.inner_text()
            rank_1_stderr = rank_1_page.locator(".hvd-stderr").inner_text()
            page.screenshot(path=str(artifacts / "dashboard-tabs.png"), full_page=True)
            lab["release"].touch()
            # then the cell where rank 1 raises: its tabs' static copy, rank 1 marked failed
            # (waited for by its own text: a count of outputs or an idle kernel alone can be seen between two
            # cells of the run-all, and a cell run then is aborted when the failing cell stops the run-all)
            wait_or_explain(page, lab, f"() => ({STANDALONE_OUTPUTS})().some(c => c.some(d => d.title === 'rank 1 ✗'))",
                            90, "the failed cell's output tabs, rank 1 marked failed")
            wait_or_explain(page, lab, f"() => {CELL_TEXT}({FAILING_CELL}).includes('rank 1 gives up')", 60,
                            "rank 1's error in the failed cell")
            wait_or_explain(page, lab, KERNEL_IDLE, 60, "idle kernel after the failed cell")  # run-all stopped there
            standalone = page.evaluate(STANDALONE_OUTPUTS)
            page.evaluate(RUN_CELL_FROM_END, 2)  # %hvd debug: pdb's prompt in the notebook's input box
            for command, answer in (("p hvd.rank() * 21", "\n21\n"), ("q", "pdb on rank 1 ended")):
                stdin = page.locator(".jp-Stdin-input").last
                stdin.wait_for(state="visible", timeout=60_000)
                stdin.fill(command)
                stdin.press("Enter")
                wait_or_explain(page, lab, f"() => {CELL_TEXT}({FAILING_CELL + 1}).includes({answer!r})", 30,
                                f"pdb's answer to {command!r}")
            wait_or_explain(page, lab, KERNEL_IDLE, 60, "idle kernel after %hvd debug")
            debugged = page.evaluate(f"() => {CELL_TEXT}({FAILING_CELL + 1})")
            page.screenshot(path=str(artifacts / "debug-in-jupyterlab.png"), full_page=True)
            page.evaluate(RUN_CELL_FROM_END, 1)  # %hvd stop
            wait_or_explain(page, lab, "() => document.querySelector('.jp-Notebook').innerText"
                            ".includes('Cluster stopped.')", 60, "'Cluster stopped.' from %hvd stop")
            page.wait_for_function(KERNEL_IDLE, timeout=60_000, polling=250)
            page.screenshot(path=str(artifacts / "dashboard-outputs.png"), full_page=True)
            page.evaluate("() => document.querySelectorAll('.jp-Notebook .jp-Cell')[3].scrollIntoView()")
            page.screenshot(path=str(artifacts / "dashboard-final.png"), full_page=True)
            percents = page.eval_on_selector_all(".hvd-summary .hvd-static-bar",
                                                 "els => els.map(e => e.dataset.percent)")
            tqdm_summary = page.eval_on_selector_all(".hvd-summary", "els => els[1].innerText")
            outputs = page.inner_text(".jp-Notebook")
            # the frozen summary is an ordinary output: saved, and shown again after a reload
            page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
            page.reload()
            page.wait_for_selector(".hvd-summary img[alt='hvd curves']", timeout=60_000)
            # (the outputs of later cells may render after the first summary's image)
            page.wait_for_function(f"() => ({STANDALONE_OUTPUTS})().length >= 2", timeout=60_000, polling=250)
            reloaded = page.eval_on_selector_all(".hvd-summary .hvd-static-bar",
                                                 "els => els.map(e => e.dataset.percent)")
            reloaded_outputs = page.evaluate(STANDALONE_OUTPUTS)
        finally:
            browser.close()

    live = [s for s in samples if len(s["bars"]) == 2 and not s["summary"]]
    assert live, f"the dashboard never showed two bars: {samples[:5]}"
    moving = [tuple(s["bars"]) for s in live if all(0 < b < 100 for b in s["bars"])]
    assert len(set(moving)) >= 3, f"the bars did not move during training: {[s['bars'] for s in live]}"
    assert max(s["points"] for s in live) >= 3, "the loss curve had no points"
    assert all(s["tabs"] for s in live), "the dashboard had no output tabs under it"
    # a tab per rank, rank 0's open; rank 1's output (stderr marked) one click away
    assert titles[-2:] == ["rank 0", "rank 1 ⚠"], titles
    assert rank_1_hidden_first
    assert "hello from rank 1" in rank_1_text and "rank 1 says: careful" in rank_1_text, rank_1_text
    assert "hello from rank 0" not in rank_1_text and "careful" in rank_1_stderr
    printed, failed = standalone[:2]
    assert [(d["title"], d["open"]) for d in printed] == [("rank 0", True), ("rank 1 ⚠", False)], printed
    assert "hello from rank 1" in printed[1]["text"] and "rank 1 says: careful" in printed[1]["text"]
    assert [d["title"] for d in failed] == ["rank 0", "rank 1 ✗"], failed
    assert "rank 1 before the error" in failed[1]["text"] and "ValueError: rank 1 gives up" in failed[1]["text"]
    assert "[0] rank 0 before the error" in outputs and "[1] rank 1 before the error" not in outputs
    assert [[d["title"] for d in cell] for cell in reloaded_outputs[:2]] == [["rank 0", "rank 1 ⚠"],
                                                                              ["rank 0", "rank 1 ✗"]]
    assert percents == ["100"] * 4, percents  # two ranks' bars in each of the two summaries
    assert re.search(r"custom \| [\d,.]+ \S+ over 2 rank\(s\)", tqdm_summary), tqdm_summary
    assert "loss" in tqdm_summary and "it/s" not in outputs, outputs[-2000:]  # no tqdm text printed
    assert re.search(r"fit \| epoch 2/2 \| [\d,]+ samples/s over 2 rank\(s\)", outputs), outputs[-2000:]
    # the gradient noise scale, read against the global batch (16 a rank), kept in the summary
    assert re.search(r"the global batch 32 is \w+ the measured noise scale [\d,.]+", outputs), outputs[-2000:]
    assert "Cluster stopped." in outputs
    assert "[hvd_notebook] pdb on rank 1, where its cell failed" in debugged and "(Pdb rank 1)" in debugged, debugged
    assert reloaded == ["100"] * 4
    saved = nbformat.read(lab["notebook"], as_version=4)
    bundles = [o.get("data", {}) for o in saved.cells[3].outputs]
    assert any("hvd-summary" in b.get("text/html", "") and "image/png" in b for b in bundles), bundles
    html_out = subprocess.run([sys.executable, "-m", "jupyter", "nbconvert", "--to", "html", "--stdout",
                               str(lab["notebook"])], capture_output=True, text=True, timeout=120)
    assert html_out.returncode == 0, html_out.stderr[-2000:]
    assert "hvd-summary" in html_out.stdout and "data:image/png;base64," in html_out.stdout
    assert "hello from rank 1" in html_out.stdout and "rank 1 ✗" in html_out.stdout
