"""The dashboard on a real 2-rank cluster driven through IPython: the ranks'
published updates reach the session, and the widgets change while the cell runs."""

from __future__ import annotations

import time

import pytest

from hvd_notebook.dashboard import Dashboard
from hvd_notebook.dashboard.widget import WidgetView
from hvd_notebook.kernel import cell

SETUP = """%%hvd
import time
import numpy as np, keras
rng = np.random.default_rng(hvd.rank())
x = rng.normal(size=(2048, 8)).astype('float32'); y = (x[:, 0] > 0).astype('int64')
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation='relu'),
                          keras.layers.Dense(2, activation='softmax')])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.05)),
              loss='sparse_categorical_crossentropy', metrics=['accuracy'])

class Slow(keras.callbacks.Callback):  # stretches training to a few seconds
    def on_train_batch_end(self, batch, logs=None):
        time.sleep(0.01)
"""


@pytest.fixture
def dashboards(monkeypatch) -> list[Dashboard]:
    """The dashboards the cells of a test made, in order."""
    made: list[Dashboard] = []

    class Recorded(Dashboard):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(cell, "Dashboard", Recorded)
    return made


@pytest.fixture(scope="module")
def model(cluster, ip):
    result = ip.run_cell(SETUP)
    assert result.success
    return True


def test_widgets_change_during_the_cell_and_reach_the_final_step(model, run, monkeypatch, dashboards):
    seen: list[tuple[float, list[int], list[int], int]] = []
    original = WidgetView.render

    def recording_render(self):
        original(self)
        bars = [self.bars[r][0] for r in sorted(self.bars)]
        loss = self.figures.get("loss")  # (figure, (unsmoothed, mean, ...), ...)
        seen.append((time.monotonic(), [b.value for b in bars], [b.max for b in bars],
                     len(loss[1][1].x) if loss else 0))

    monkeypatch.setattr(WidgetView, "render", recording_render)
    start = time.monotonic()
    result, out = run("%%hvd --progress widgets\nmodel.fit(x, y, batch_size=16, epochs=2, verbose=0, "
                      "callbacks=[Slow()])")
    seconds = time.monotonic() - start
    assert result.success, out
    (progress,) = dashboards
    view = progress.view
    assert isinstance(view, WidgetView)
    # while training: several redraws with the bars part-way, moving forward
    during = [values for _, values, maxes, _ in seen if all(0 < v < m for v, m in zip(values, maxes))]
    assert len(during) >= 3, seen
    assert during == sorted(during) and len({tuple(v) for v in during}) >= 3
    # at the end: every rank at its last step (2 epochs x 128 steps), green, curves drawn
    for bar, _ in view.bars.values():
        assert bar.value == bar.max == 256 and bar.bar_style == "success"
    assert seen[-1][3] >= 5, "the loss curve has too few points"
    # the curves plot each step's value, recovered from Keras' running means: weighted by the steps each
    # point stands for, an epoch's points average to the epoch's loss (the last running mean)
    run = progress.model.runs[0]
    for rank, rank_progress in run.ranks.items():
        points = rank_progress.points["loss"]
        for epoch in (0, 1):
            inside = [(s, v) for s, v in points if epoch * 128 < s <= (epoch + 1) * 128]
            starts = [epoch * 128] + [s for s, _ in inside[:-1]]
            mean = sum(v * (s - start) for (s, v), start in zip(inside, starts)) / 128
            assert mean == pytest.approx(run.epoch_logs[epoch][rank]["loss"], rel=1e-4), (rank, epoch, inside)
    assert progress.model.epoch_starts() == [128]
    _, (_, _, _, epoch_marks, _), _ = view.figures["loss"]
    assert [list(x) for x in epoch_marks.x.reshape(-1, 2)] == [[128, 128]]
    assert set(view.figures) >= {"loss", "accuracy", "noise_scale"}
    assert view.reading.value.startswith("the global batch 32 is ")  # 16 a rank; the measured noise scale beside it
    assert view.step_time.value.startswith("communication ")
    assert "done" in view.headline.value and "samples/s over 2 rank(s)" in view.headline.value
    assert "hvd-epochs" in view.table.value
    # no rank sent more than about 10 updates a second (plus its epoch and end updates)
    for rank in (0, 1):
        assert progress.seen[rank] + 1 <= 10 * seconds + 8, (progress.seen, seconds)
    # frozen: the live view was replaced by the static summary (printed as text in a terminal)
    assert progress.frozen and "rank 1: epoch 2/2" in out


def test_text_fallback_prints_a_line_per_epoch_and_per_evaluate(model, run):
    result, out = run("%%hvd --progress text\nmodel.fit(x, y, batch_size=64, epochs=2, verbose=0)\n"
                      "_ = model.evaluate(x, y, verbose=0)")
    assert result.success, out
    lines = [line for line in out.splitlines() if line.startswith("[hvd_notebook]")]
    assert len(lines) == 7, out
    assert lines[0].startswith("[hvd_notebook] fit epoch 1/2 | 2 ranks | ") and "samples/s | loss " in lines[0]
    assert lines[3].startswith("[hvd_notebook] fit epoch 2/2 | 2 ranks | ") and "accuracy " in lines[3]
    for line in lines[0], lines[3]:  # each epoch with the gradient noise scale, and what it means
        assert " noise_scale " in line, line
    assert lines[1].startswith("[hvd_notebook] the global batch 128 is ") and "the measured noise scale" in lines[1]
    assert lines[4].startswith("[hvd_notebook] the global batch 128 is ")
    for line in lines[2], lines[5]:  # ... and where its steps' time went
        assert line.startswith("[hvd_notebook] communication ") and "% of each step" in line, line
    assert lines[6].startswith("[hvd_notebook] evaluate | 2 ranks | ") and "loss " in lines[6]


def test_no_progress_removes_the_callback_and_the_dashboard(model, run, dashboards):
    result, out = run("%%hvd --no-progress\nimport hvd_notebook.progress as p\nmodel.fit(x, y, epochs=1, verbose=0)\n"
                      "print('enabled', p.reporting())")
    assert result.success, out
    assert "[0] enabled False" in out and "[hvd_notebook]" not in out
    assert dashboards == []
    result, out = run("%%hvd\nprint('enabled', p.reporting())")
    assert "[0] enabled True" in out


def test_a_failed_rank_turns_red_with_its_error(model, run, dashboards):
    result, out = run(
        "%%hvd --progress widgets\n"
        "class Fail(keras.callbacks.Callback):\n"
        "    def on_epoch_end(self, epoch, logs=None):\n"
        "        if hvd.rank() == 1 and epoch == 1:\n"
        "            raise RuntimeError('rank 1 gave up')\n"
        "model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[Fail()])"
    )
    assert not result.success
    progress = dashboards[-1]
    assert progress.model.failed == {1: "RuntimeError: rank 1 gave up"}
    bar, text = progress.view.bars[1]
    assert bar.bar_style == "danger" and "rank 1 gave up" in text.value
    assert progress.frozen


def test_a_rank_far_behind_the_others_is_marked_as_a_straggler(model, run, monkeypatch):
    styles: list[dict[int, str]] = []
    original = WidgetView.render

    def recording_render(self):
        original(self)
        styles.append({r: bar.bar_style for r, (bar, _) in self.bars.items()})

    monkeypatch.setattr(WidgetView, "render", recording_render)
    # predict runs no collectives, so a slow rank really falls behind
    result, out = run(
        "%%hvd --progress widgets\n"
        "class Lag(keras.callbacks.Callback):\n"
        "    def on_predict_batch_end(self, batch, logs=None):\n"
        "        time.sleep(0.02 if hvd.rank() == 1 else 0.002)\n"
        "_ = model.predict(x, batch_size=8, verbose=0, callbacks=[Lag()])"
    )
    assert result.success, out
    assert any(s.get(1) == "warning" for s in styles), styles
    assert not any(s.get(0) == "warning" for s in styles)
    assert styles[-1] == {0: "success", 1: "success"}


def test_the_rank_that_sleeps_in_each_step_is_the_one_the_others_wait_for(model, run, dashboards):
    sleep = 0.2
    result, out = run(
        "%%hvd --progress text\n"
        "class Sleepy(keras.callbacks.Callback):  # rank 1 computes longer in each step\n"
        "    def on_train_batch_begin(self, batch, logs=None):\n"
        "        if hvd.rank() == 1:\n"
        f"            time.sleep({sleep})\n"
        "_ = model.fit(x[:128], y[:128], batch_size=16, epochs=1, verbose=0, callbacks=[Sleepy()])"  # 8 steps
    )
    assert result.success, out
    breakdown = dashboards[-1].model.step_breakdown()  # the kernel's figures, from the ranks' updates
    assert breakdown is not None and breakdown.steps == 7, out  # (the first step traces: not timed)
    assert breakdown.waited_for == 1, breakdown
    waiting, step_s = breakdown.per_rank[0]
    assert waiting == pytest.approx(sleep, rel=0.3), breakdown  # rank 0 waits in the allreduce for rank 1
    assert breakdown.waited_s == pytest.approx(sleep, rel=0.3) and step_s >= sleep, breakdown
    reading = [line for line in out.splitlines() if line.startswith("[hvd_notebook] communication ")]
    assert len(reading) == 1 and reading[0].endswith(" a step for rank 1"), out
    print(f"rank 0 waited {waiting * 1e3:.0f} ms a step for rank 1's {sleep * 1e3:.0f} ms sleep: {reading[0]}")
