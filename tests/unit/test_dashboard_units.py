"""The dashboard's parts on their own: throttle, aggregation, curves, text fallback, static summary, and
each rank's output tabs."""

from __future__ import annotations

import base64

import pytest

from hvd_notebook.dashboard import (
    Dashboard,
    ProgressModel,
    TextView,
    curves,
    formatting,
    resolve_mode,
    static_bundle,
)
from hvd_notebook.dashboard.model import KEPT_STEPS, STEP_WINDOW
from hvd_notebook.dashboard.outputs import OUTPUT_TAIL_BYTES, RankOutputs, output_html
from hvd_notebook.engine.reporter import Throttle
from hvd_notebook.messages import KEY_PREFIX, ProgressUpdate, RunKind


class Clock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def update(rank: int, seq: int, run: str = "r", kind: str = "fit", **fields) -> ProgressUpdate:
    base = {"rank": rank, "seq": seq, "run": f"{rank}.{run}", "kind": kind, "state": "running", "epoch": 0,
            "epochs": 2, "step": 0, "steps": 100, "samples": 0, "elapsed": 0.0, "logs": {}, "epoch_logs": {}}
    base.update(fields)
    return ProgressUpdate.from_dict(base)


def test_throttle_passes_at_most_ten_a_second_and_forced_events_always():
    clock = Clock(0.0)
    throttle = Throttle(clock=clock)
    passed = 0
    for i in range(1000):  # 1000 batches over 2 seconds
        clock.now = i * 0.002
        passed += throttle.ready()
    assert 19 <= passed <= 21
    assert throttle.ready(force=True) and throttle.ready(force=True)


def test_rates_sum_over_ranks_over_the_recent_window():
    board = ProgressModel([0, 1])
    for t in range(0, 6):
        board.feed(update(0, t, step=t * 10, samples=t * 640, elapsed=float(t)))  # 640 samples/s
        board.feed(update(1, t, step=t * 5, samples=t * 320, elapsed=float(t)))  # 320 samples/s
    assert board.rate() == pytest.approx(960)
    assert board.current.unit == "samples/s"


def test_rate_falls_back_to_steps_when_samples_are_unknown():
    board = ProgressModel([0])
    board.feed(update(0, 0, step=0, samples=None, elapsed=0.0))
    board.feed(update(0, 1, step=30, samples=None, elapsed=3.0))
    assert board.current.unit == "steps/s"
    assert board.rate() == pytest.approx(10)


def test_eta_follows_the_slowest_rank():
    board = ProgressModel([0, 1])
    board.feed(update(0, 0, epoch=1, step=0, elapsed=10.0))  # half of 2 x 100 steps in 10 s
    board.feed(update(1, 0, epoch=0, step=50, elapsed=10.0))  # a quarter in 10 s
    assert board.eta() == pytest.approx(30.0)
    board.feed(update(0, 1, state="done", epoch=1, step=100, elapsed=20.0))
    board.feed(update(1, 1, state="done", epoch=1, step=100, elapsed=20.0))
    assert board.eta() == 0.0


def test_straggler_is_a_rank_more_than_ten_percent_behind_the_median():
    board = ProgressModel([0, 1, 2])
    board.feed(update(0, 0, step=100))
    board.feed(update(1, 0, step=95))
    board.feed(update(2, 0, step=80))
    assert board.stragglers() == [2]  # 80 is 20 % behind the median 95; 100 is ahead
    board.feed(update(2, 1, step=90))
    assert board.stragglers() == []  # within 10 %


def test_no_straggler_before_the_median_has_ten_steps():
    board = ProgressModel([0, 1])
    board.feed(update(0, 0, step=4))
    board.feed(update(1, 0, step=1))
    assert board.stragglers() == []


def test_epoch_rows_average_the_ranks_once_every_rank_finished_the_epoch():
    board = ProgressModel([0, 1])
    e0 = {"loss": 1.0, "accuracy": 0.5, "time": 2.0, "samples": 1000}
    board.feed(update(0, 0, state="epoch_end", step=100, epoch_logs={0: e0}))
    assert board.epoch_rows() == []  # rank 1 has not finished epoch 1
    board.feed(update(1, 0, state="epoch_end", step=100,
                      epoch_logs={0: {"loss": 3.0, "accuracy": 0.7, "time": 4.0, "samples": 1000}}))
    (row,) = board.epoch_rows()
    assert row["epoch"] == 1 and row["loss"] == pytest.approx(2.0) and row["accuracy"] == pytest.approx(0.6)
    assert row["time"] == 4.0 and row["samples/s"] == pytest.approx(500)


def test_curves_per_rank_and_their_mean():
    board = ProgressModel([0, 1])  # (a custom loop's metrics are plotted as reported)
    board.feed(update(0, 0, kind="custom", step=10, logs={"loss": 2.0}))
    board.feed(update(0, 1, kind="custom", step=20, logs={"loss": 1.0}))
    board.feed(update(1, 0, kind="custom", step=15, logs={"loss": 4.0}))
    per_rank, (xs, ys) = board.curve("loss")
    assert per_rank[0] == ([10, 20], [2.0, 1.0]) and per_rank[1] == ([15], [4.0])
    assert xs == [15, 20] and ys == [pytest.approx(3.0), pytest.approx(2.5)]  # from step 15, where both have one


def test_runs_of_a_cell_are_matched_across_ranks_by_order():
    board = ProgressModel([0, 1])
    board.feed(update(0, 0, run="a"))
    board.feed(update(0, 1, run="b", kind="evaluate"))
    board.feed(update(1, 0, run="x"))
    assert [r.kind for r in board.runs] == ["fit", "evaluate"]
    assert set(board.runs[0].ranks) == {0, 1} and set(board.runs[1].ranks) == {0}


def test_a_failed_rank_is_marked_with_its_error():
    board = ProgressModel([0, 1])
    board.feed(update(0, 0, step=10))
    board.fail(1, "ValueError: boom")
    assert board.current.ranks[1].state == "failed"
    assert "failed on rank(s) [1]" in formatting.headline(board)
    assert "FAILED: ValueError: boom" in formatting.rank_line(board.current.ranks[1])


def test_text_view_prints_one_line_per_epoch_with_the_figures():
    board = ProgressModel([0, 1])
    lines: list[str] = []
    view = TextView(board, lines.append)
    for rank in (0, 1):
        board.feed(update(rank, 0, state="epoch_end", step=100, epoch_logs={
            0: {"loss": 0.5 + rank, "accuracy": 0.9, "time": 2.0, "samples": 6400}}))
    view.render()
    view.render()  # nothing twice
    assert lines == ["[hvd_notebook] fit epoch 1/2 | 2 ranks | 6,400 samples/s | loss 1 accuracy 0.9 | 2.0 s\n"]
    board.feed(update(0, 0, run="e", kind="evaluate", state="done", step=10, steps=10, samples=320, elapsed=0.5,
                      logs={"loss": 0.25}))
    board.feed(update(1, 0, run="e", kind="evaluate", state="done", step=10, steps=10, samples=320, elapsed=0.5,
                      logs={"loss": 0.75}))
    view.render()
    board.fail(1, "KeyError: 'x'")
    view.render()
    assert lines[1:] == ["[hvd_notebook] evaluate | 2 ranks | 1,280 samples/s | loss 0.5\n",
                         "[hvd_notebook] rank 1 failed: KeyError: 'x'\n"]


def test_progress_reads_each_ranks_ring_of_published_updates_once():
    lines: list[str] = []
    progress = Dashboard("text", [0, 1], write=lines.append)
    data = {0: {}, 1: {}}
    for seq in range(70):  # more than the ring holds: only the newest 64 stay
        data[0][f"{KEY_PREFIX}{seq % 64}"] = update(0, seq, step=seq, steps=100).to_dict()
    assert progress.poll(data)
    assert progress.model.current.ranks[0].step == 69
    assert not progress.poll(data)  # nothing new
    data[1][f"{KEY_PREFIX}0"] = update(1, 0, step=3).to_dict()
    assert progress.poll(data) and progress.model.current.ranks[1].step == 3
    progress.finish()
    assert not progress.poll({0: {f"{KEY_PREFIX}5": update(0, 500).to_dict()}})  # frozen


def test_static_summary_has_bars_the_epoch_table_and_a_png_of_the_curves():
    board = ProgressModel([0, 1])
    for rank in (0, 1):
        board.feed(update(rank, 0, step=50, logs={"loss": 1.0, "accuracy": 0.5}))
        board.feed(update(rank, 1, state="done", epoch=1, step=100, logs={"loss": 0.5, "accuracy": 0.8},
                          epoch_logs={0: {"loss": 0.8, "accuracy": 0.6, "time": 1.0},
                                      1: {"loss": 0.5, "accuracy": 0.8, "time": 1.0}}))
    bundle = static_bundle(board)
    png = base64.b64decode(bundle["image/png"])
    assert png.startswith(b"\x89PNG")
    assert bundle["text/html"].count("data-percent='100'") == 2
    assert "hvd-epochs" in bundle["text/html"] and "data:image/png;base64," in bundle["text/html"]
    assert "rank 1: epoch 2/2" in bundle["text/plain"]


def test_mode_resolution(monkeypatch):
    monkeypatch.delenv("HVD_NOTEBOOK_PROGRESS", raising=False)
    assert resolve_mode("text") == "text" and resolve_mode("none") == "none"
    assert resolve_mode("auto") == "text"  # no Jupyter front end in a test process
    monkeypatch.setenv("HVD_NOTEBOOK_PROGRESS", "widgets")
    assert resolve_mode(None) == "widgets"
    assert resolve_mode("text") == "text"  # an explicit mode wins
    with pytest.raises(ValueError, match="use one of auto, widgets, text, none"):
        resolve_mode("fancy")


def test_formatting():
    assert formatting.fmt_duration(75) == "1:15" and formatting.fmt_duration(3725) == "1:02:05"
    assert formatting.fmt_logs({"accuracy": 0.5, "val_loss": 2, "loss": 1, "time": 3}) == \
        "loss 1 accuracy 0.5 val_loss 2"


def test_a_reset_marks_the_event_and_the_new_worlds_updates_continue_the_curves():
    lines: list[str] = []
    clock = Clock()
    board = Dashboard("text", [0, 1], write=lines.append, clock=clock)
    data = {0: {}, 1: {}}
    for rank in (0, 1):  # the first world: run "a", up to step 40 of epoch 0; rank 1 then dies
        for seq, step in enumerate((10, 20, 30, 40)):
            data[rank][f"{KEY_PREFIX}{seq}"] = update(rank, seq, run="a", step=step, elapsed=step / 10,
                                                       logs={"loss": 1.0 - step / 100}).to_dict()
    board.poll(data)
    board.fail(1, "died")
    clock.now += 42
    board.reset({1: "signal Kill"}, "batch=30, committed at 10:02:11", [0, 1])
    assert board.model.failed == {} and board.model.events[0].step == 40
    data = {0: {}, 1: {}}
    for rank in (0, 1):  # the new world: another run id, its updates counted from 0, resumed at step 30
        for seq, step in enumerate((30, 35, 50)):
            data[rank][f"{KEY_PREFIX}{seq}"] = update(rank, seq, run="b", step=step, elapsed=0.5 + seq,
                                                       logs={"loss": 0.5 - step / 1000}).to_dict()
    assert board.poll(data, force=True)
    model = board.model
    assert len(model.runs) == 1  # the resumed fit continues the run, not a new one
    per_rank, (xs, _) = model.curve("loss")
    assert per_rank[0][0] == [10, 20, 30, 35, 50]  # the lost steps 31..40 are replaced by the redone ones
    assert xs == [10, 20, 30, 35, 50]
    assert model.current.ranks[1].state == "running" and model.current.ranks[1].step == 50
    text = "".join(lines)
    assert ("[hvd_notebook] reset: rank 1 died (signal Kill) at epoch 1/2 step 40; world restarted; resumed from the "
            "last commit (batch=30, committed at 10:02:11)") in text, text
    bundle = static_bundle(model)
    assert "reset 1 at 0:42: rank 1 died" in bundle["text/plain"]
    assert "class='hvd-reset'" in bundle["text/html"] and bundle["image/png"]


# ------------------------------------------------------------------ curves: per-step values from running means
def running_means(values: list[float]) -> list[float]:
    """What Keras logs after each batch of an epoch: the mean of the epoch's batches so far."""
    return [sum(values[:k]) / k for k in range(1, len(values) + 1)]


EPOCHS = [[2.0, 1.0, 1.5, 0.5, 1.0, 0.25], [0.75, 0.5, 1.0, 0.25, 0.5, 0.125]]  # two epochs of 6 steps


def recover(reports):
    """(epoch, step, running mean) reports of one rank and metric to (epoch, step, value), as the model
    recovers them (``curves.StepValues``): the reports it can tell no value from are left out."""
    values = curves.StepValues()
    return [(e, k, v) for e, k, m in reports if (v := values.add(e, k, m)) is not None]


def test_recovered_values_are_the_steps_own_values():
    reports = [(e, k, m) for e, values in enumerate(EPOCHS) for k, m in enumerate(running_means(values), 1)]
    recovered = recover(reports)
    assert [(e, k) for e, k, _ in recovered] == [(e, k) for e, k, _ in reports]
    assert [v for _, _, v in recovered] == pytest.approx([v for values in EPOCHS for v in values])


def test_throttled_reports_give_the_mean_of_the_steps_since_the_last_one():
    means = running_means(EPOCHS[0])
    recovered = recover([(0, k, means[k - 1]) for k in (1, 2, 5, 6)])
    assert [k for _, k, _ in recovered] == [1, 2, 5, 6]
    assert [v for _, _, v in recovered] == pytest.approx([2.0, 1.0, (1.5 + 0.5 + 1.0) / 3, 0.25])


def test_the_first_report_of_an_epoch_is_its_running_mean():
    second = running_means(EPOCHS[1])
    reports = [(0, 6, running_means(EPOCHS[0])[-1]), (1, 0, 99.0), (1, 3, second[2]), (1, 4, second[3])]
    recovered = recover(reports)  # step 0 (the epoch's begin) carries the last epoch's means: skipped
    assert [(e, k) for e, k, _ in recovered] == [(0, 6), (1, 3), (1, 4)]
    assert recovered[1][2] == pytest.approx((0.75 + 0.5 + 1.0) / 3) and recovered[2][2] == pytest.approx(0.25)


def test_a_step_reported_twice_keeps_its_value_and_steps_going_back_start_afresh():
    values = curves.StepValues()
    assert values.add(0, 2, 3.0) == 3.0
    assert values.add(0, 4, 2.0) == pytest.approx(1.0)
    assert values.add(0, 4, 2.0) == pytest.approx(1.0)  # the epoch's end after its last batch
    assert values.add(0, 1, 5.0) == 5.0  # the epoch again from its start (a rank's run restarted)


def keras_fit(rank: int, epochs: list[list[float]], report: tuple[int, ...] | None = None, run: str = "k",
              first_epoch: int = 0, seq: int = 0) -> list[ProgressUpdate]:
    """The updates one rank's ProgressCallback publishes for ``fit`` over ``epochs`` (each a list of the
    steps' losses): each epoch's begin (step 0, the logs so far), the batch ends of the ``report`` steps
    (all where None; the throttle lets some through) with Keras' running means, the epoch's end."""
    out, logs = [], {}
    steps = len(epochs[0])
    for epoch, values in enumerate(epochs):
        out.append(update(rank, seq + len(out), run=run, epoch=epoch, epochs=len(epochs), step=0, steps=steps,
                          logs=dict(logs), first_epoch=first_epoch))
        means = running_means(values)
        for k in report or range(1, steps + 1):
            logs = {"loss": means[k - 1]}
            out.append(update(rank, seq + len(out), run=run, epoch=epoch, epochs=len(epochs), step=k, steps=steps,
                              logs=logs, first_epoch=first_epoch))
        logs = {"loss": means[-1], "val_loss": 9.0}
        out.append(update(rank, seq + len(out), run=run, state="epoch_end", epoch=epoch, epochs=len(epochs),
                          step=steps, steps=steps, logs=logs, first_epoch=first_epoch,
                          epoch_logs={epoch: dict(logs, time=1.0)}))
    return out


def test_fit_curves_plot_each_steps_value_and_custom_loops_as_reported():
    board = ProgressModel([0, 1])
    for u in keras_fit(0, EPOCHS) + keras_fit(1, EPOCHS, report=(2, 5)):
        board.feed(u)
    per_rank, (xs, ys) = board.curve("loss")
    assert per_rank[0][0] == list(range(1, 13))
    assert per_rank[0][1] == pytest.approx(EPOCHS[0] + EPOCHS[1])  # no saw-tooth at step 6
    assert per_rank[1][0] == [2, 5, 6, 8, 11, 12]
    assert per_rank[1][1] == pytest.approx([1.5, 1.0, 0.25, 0.625, 0.5833333, 0.125])
    assert "val_loss" not in board.metrics()
    custom = ProgressModel([0])
    for u in keras_fit(0, EPOCHS):
        u.kind = RunKind.CUSTOM
        custom.feed(u)
    assert custom.curve("loss")[0][0][1][:3] == pytest.approx(running_means(EPOCHS[0])[:3])


def test_epochs_begin_where_a_rank_has_reached_them():
    board = ProgressModel([0, 1])
    assert board.epoch_starts() == []
    for u in keras_fit(0, EPOCHS + EPOCHS[:1]):
        board.feed(u)
    assert board.epoch_starts() == [6, 12]
    board.feed(update(1, 0, kind="custom", epoch=0, steps=None, step=3, logs={"loss": 1.0}))
    assert board.epoch_starts() == [6, 12]  # (no mark from a rank without its steps per epoch)


def test_a_fit_resumed_after_a_reset_recovers_its_values_from_the_new_worlds_means():
    board = Dashboard("text", [0, 1], write=lambda text: None)
    resumed = [[0.5, 0.25, 0.75, 0.5, 0.25, 0.125]]
    for rank in (0, 1):  # the first world: epoch 1 whole, epoch 2 up to step 4; then rank 1 dies
        updates = keras_fit(rank, [EPOCHS[0], EPOCHS[1]], run="a")[:-3]
        board.poll({rank: {f"{KEY_PREFIX}{u.seq}": u.to_dict() for u in updates}})
    board.fail(1, "died")
    board.reset({1: "signal Kill"}, "epoch=1, batch=0", [0, 1])
    for rank in (0, 1):  # the new world: fit(initial_epoch=1) runs epoch 2 again from its start
        updates = keras_fit(rank, resumed, run="b", first_epoch=1)
        board.poll({rank: {f"{KEY_PREFIX}{u.seq}": u.to_dict() for u in updates}})
    per_rank, (xs, ys) = board.model.curve("loss")
    assert per_rank[0][0] == list(range(1, 13)) and xs == list(range(1, 13))
    assert per_rank[0][1] == pytest.approx(EPOCHS[0] + resumed[0])  # the lost steps 7..10 redone
    assert ys == pytest.approx(EPOCHS[0] + resumed[0])
    assert board.model.epoch_starts() == [6]


def test_smoothing_is_a_centred_rolling_mean_that_widens_with_the_curve():
    assert curves.smooth([1.0, 3.0, 2.0, 6.0, 4.0], width=1) == pytest.approx([2.0, 2.0, 11 / 3, 4.0, 5.0])
    assert curves.smooth([1.0, 3.0], width=0) == [1.0, 3.0]
    assert curves.half_width(39) == 0 and curves.half_width(80) == 2 and curves.half_width(10**6) == 12
    noisy = [1.0 + (0.5 if i % 2 else -0.5) for i in range(400)]  # 400 points: a half-width of 10
    assert max(curves.smooth(noisy)[10:-10]) - min(curves.smooth(noisy)[10:-10]) < 0.05
    assert len(curves.smooth(noisy)) == 400 and curves.smooth([]) == []


def test_the_widget_view_draws_the_smoothed_mean_the_unsmoothed_one_and_epoch_lines():
    pytest.importorskip("bqplot")
    from hvd_notebook.dashboard.widget import WidgetView

    board = ProgressModel([0])
    for u in keras_fit(0, EPOCHS):
        board.feed(u)
    view = WidgetView(board, display=Front())
    view.render()
    fig, (raw, mean, resets, epochs, _), _ = view.figures["loss"]
    assert list(raw.y) == pytest.approx(EPOCHS[0] + EPOCHS[1])
    assert list(mean.y) == pytest.approx(curves.smooth(EPOCHS[0] + EPOCHS[1]))
    assert epochs.x.ravel().tolist() == [6, 6]  # one vertical line, at step 6
    assert epochs in fig.marks and resets not in fig.marks


# ------------------------------------------------------------------ each rank's output, in tabs
class Front:
    """Stands in for the notebook's front end: what was displayed, and each update of a display."""

    def __init__(self) -> None:
        self.shown: list[tuple[object, bool]] = []
        self.updates: list[tuple[object, bool]] = []

    def __call__(self, obj: object, display_id: bool = False, raw: bool = False) -> Front.Handle:
        self.shown.append((obj, raw))
        return Front.Handle(self)

    class Handle:
        def __init__(self, front: Front) -> None:
            self.front = front

        def update(self, obj: object, raw: bool = False) -> None:
            self.front.updates.append((obj, raw))


def test_each_ranks_output_keeps_its_order_its_badge_and_its_failure():
    outputs = RankOutputs([0, 1, 2], shown={0})
    outputs.write(0, "stdout", "zero\n")
    assert not outputs.hidden_news  # only the rank the cell prints wrote something
    outputs.write(1, "stdout", "a <b>\n")
    outputs.write(1, "stderr", "warned\n")
    outputs.write(1, "stdout", "c\n")
    assert outputs.hidden_news and outputs.selected == 0
    assert outputs[1].chunks == [("stdout", "a <b>\n"), ("stderr", "warned\n"), ("stdout", "c\n")]
    assert [outputs[r].title for r in outputs.ranks] == ["rank 0", "rank 1 ⚠", "rank 2"]
    outputs.fail(2, "ValueError: x", "Traceback\nValueError: x")
    assert outputs[2].title == "rank 2 ✗"
    page = output_html(outputs[1])
    assert "a &lt;b&gt;\n<span class='hvd-stderr'" in page and "warned\n</span>c\n</pre>" in page
    assert "✗ failed: ValueError: x" in output_html(outputs[2]) and "Traceback" in output_html(outputs[2])
    assert "(no output)" in output_html(RankOutputs([5], shown={5})[5])
    outputs.note("[hvd_notebook] reset 1: rank 2 died")  # a reset: the failure so far becomes text
    assert outputs[2].title == "rank 2 ⚠" and outputs[2].chunks[-1] == ("note", "[hvd_notebook] reset 1: rank 2 died\n")


def test_a_long_output_keeps_its_last_part_with_a_note():
    output = RankOutputs([0], shown={0})[0]
    line = "é" * 99 + "\n"  # 199 bytes
    for _ in range(300):
        output.add("stdout", line)
    assert output.kept <= OUTPUT_TAIL_BYTES and output.kept + output.dropped == 300 * 199
    text = "".join(t for _, t in output.chunks)
    assert text.endswith(line * 160) and text.encode() == (line * 300).encode()[-output.kept:]
    assert "(the first 26.3 KiB are left out: the last 32.0 KiB follow)" in output_html(output)


def test_output_tabs_are_real_widgets_with_a_tab_per_rank():
    pytest.importorskip("ipywidgets")
    from hvd_notebook.dashboard.widget import OutputTabs

    outputs = RankOutputs([0, 1], shown={0})
    outputs.write(1, "stdout", "hello from 1\n")
    tabs = OutputTabs(outputs)
    assert tabs.widget.titles == ("rank 0", "rank 1") and tabs.widget.selected_index == 0
    assert "hello from 1" in tabs.pages[1].value and "(no output)" in tabs.pages[0].value
    outputs.fail(1, "RuntimeError: boom", "Traceback ...")
    tabs.render()
    assert tabs.widget.titles == ("rank 0", "rank 1 ✗") and "RuntimeError: boom" in tabs.pages[1].value


def test_tabs_appear_on_their_own_for_a_hidden_ranks_output_and_freeze_into_details():
    front = Front()
    board = Dashboard("widgets", [0, 1], display=front, shown={0})
    board.output(0, "stdout", "rank 0 only\n")
    board.poll({0: {}, 1: {}})
    assert front.shown == []  # the cell prints rank 0's output itself: no tabs
    board.output(1, "stdout", "<rank 1>\n")
    board.poll({0: {}, 1: {}})
    ((tabs, _),) = front.shown
    assert tabs.titles == ("rank 0", "rank 1")
    board.fail(1, "ValueError: bad\nmore", "Traceback\nValueError: bad")
    board.finish()
    ((bundle, raw),) = front.updates
    assert raw and "output per rank" in bundle["text/plain"] and "rank 1 ✗" in bundle["text/plain"]
    page = bundle["text/html"]
    assert "<details class='hvd-rank-details' data-rank='0' open><summary style='cursor:pointer'>rank 0</summary>" \
        in page
    assert "data-rank='1'><summary style='cursor:pointer'>rank 1 ✗</summary>" in page
    assert "&lt;rank 1&gt;" in page and "<rank 1>" not in page and "ValueError: bad" in page
    board.output(1, "stdout", "late\n")  # frozen: nothing more
    assert "late" not in "".join(t for _, t in board.outputs[1].chunks)


def test_the_dashboard_takes_the_place_of_the_tabs_and_keeps_them_under_it():
    front = Front()
    board = Dashboard("widgets", [0, 1], display=front, shown={0})
    board.output(1, "stderr", "early\n")
    board.poll({0: {}, 1: {}})
    ((tabs, _),) = front.shown
    data = {r: {f"{KEY_PREFIX}{u.seq}": u.to_dict() for u in keras_fit(r, EPOCHS)} for r in (0, 1)}
    board.poll(data, force=True)
    assert len(front.shown) == 1 and front.updates[0][0] is board.view.widget  # in the same place
    assert board.view.widget.children[-1] is tabs and tabs.titles == ("rank 0", "rank 1 ⚠")
    board.finish()
    bundle, raw = front.updates[-1]
    assert raw and "hvd-summary" in bundle["text/html"] and "hvd-outputs" in bundle["text/html"]
    assert bundle["text/html"].index("hvd-epochs") < bundle["text/html"].index("hvd-outputs")


def test_a_dashboard_shows_its_tabs_and_text_mode_keeps_no_output():
    front = Front()
    board = Dashboard("widgets", [0, 1], display=front, shown={0})
    board.poll({0: {f"{KEY_PREFIX}0": update(0, 0, step=1).to_dict()}})
    ((widget, _),) = front.shown
    assert widget is board.view.widget and "hvd-output-tabs" in widget.children[-1]._dom_classes
    board.finish()
    assert "hvd-outputs" not in front.updates[-1][0]["text/html"]  # no rank wrote anything
    text = Dashboard("text", [0, 1], write=lambda line: None)
    text.output(1, "stdout", "x\n")
    assert text.outputs is None and not text.records_output


def test_after_a_reset_the_resumed_cells_output_goes_on_in_the_same_tabs():
    front = Front()
    board = Dashboard("widgets", [0, 1], display=front, shown={0})
    board.output(1, "stdout", "first world\n")
    board.poll({0: {}, 1: {}})
    board.fail(1, "the process died")
    board.reset({1: "signal Kill"}, "epoch=2", [0, 1])
    ((tabs, _),) = front.shown
    assert tabs.titles == ("rank 0", "rank 1 ⚠")  # the death is part of its text now; the rank runs again
    board.output(1, "stdout", "second world\n")
    board.poll({0: {}, 1: {}}, force=True)
    text = board.tabs.pages[1].value
    assert text.index("first world") < text.index("failed: the process died") \
        < text.index("[hvd_notebook] reset 1: rank 1 died (signal Kill)") < text.index("second world")


# ------------------------------------------------------------------ the gradient noise scale
def noisy_fit(noise: list[float], batch_size: int | None = 64) -> ProgressModel:
    """Two ranks of a fit whose logs carry the noise scale (the same on both ranks, as measured), with
    Keras' running mean of the loss beside it; an epoch of 4 steps."""
    board = ProgressModel([0, 1])
    for step, value in enumerate(noise, start=1):
        for rank in (0, 1):
            board.feed(update(rank, step, step=step, steps=4, batch_size=batch_size,
                              logs={"loss": 1.0, "noise_scale": value}))
    return board


def test_the_noise_scale_is_drawn_as_measured_not_as_a_running_mean():
    board = noisy_fit([100.0, 300.0, 500.0])
    _, (steps, values) = board.curve("noise_scale")
    assert steps == [1, 2, 3] and values == [100.0, 300.0, 500.0]  # (a running mean would give 100, 500, 900)
    assert board.noise_scale() == 500.0 and board.global_batch() == 128


@pytest.mark.parametrize("measured, batch, reading", [
    (3100.0, 64, "the global batch 128 is below the measured noise scale 3,100: more ranks should still pay off"),
    (150.0, 64, "the global batch 128 is near the measured noise scale 150, the critical batch size: more ranks "
                "pay off less and less"),
    (40.0, 64, "the global batch 128 is above the measured noise scale 40: more ranks would mostly add "
               "samples, not save steps"),
    (3100.0, None, "measured noise scale 3,100 samples is about the largest global batch that still pays off"),
])
def test_the_reading_compares_the_noise_scale_with_the_global_batch(measured, batch, reading):
    assert formatting.noise_reading(noisy_fit([measured], batch)) == reading
    assert formatting.noise_reading(ProgressModel([0])) is None


def test_every_view_keeps_the_reading():
    board = noisy_fit([3100.0])
    for rank in (0, 1):
        board.feed(update(rank, 9, state="epoch_end", step=4, steps=4, batch_size=64,
                          logs={"loss": 1.0, "noise_scale": 3100.0},
                          epoch_logs={0: {"loss": 1.0, "noise_scale": 3100.0, "time": 1.0, "samples": 256}}))
    lines: list[str] = []
    TextView(board, lines.append).render()
    assert lines[0].startswith("[hvd_notebook] fit epoch 1/2 | 2 ranks | 512 samples/s | loss 1 noise_scale 3100")
    assert lines[1] == ("[hvd_notebook] the global batch 128 is below the measured noise scale 3,100: more ranks "
                        "should still pay off\n")
    bundle = static_bundle(board)
    assert "class='hvd-noise-scale'>the global batch 128 is below" in bundle["text/html"]
    assert bundle["text/plain"].endswith("more ranks should still pay off")


def test_the_widget_draws_the_global_batch_beside_the_noise_scale():
    pytest.importorskip("bqplot")
    from hvd_notebook.dashboard.widget import WidgetView

    view = WidgetView(noisy_fit([3000.0, 3100.0]), display=Front())
    view.render()
    fig, (*_, level), _ = view.figures["noise_scale"]
    assert level in fig.marks and level.y.ravel().tolist() == [128, 128] and level.x.ravel().tolist() == [1, 2]
    loss, (*_, no_level), _ = view.figures["loss"]
    assert no_level not in loss.marks
    assert "below the measured noise scale 3,100" in view.reading.value


def test_a_noise_scale_not_measured_yet_is_left_out_of_the_published_logs():
    from hvd_notebook.engine.reporter import float_logs

    assert float_logs({"loss": float("nan"), "noise_scale": float("nan")}).keys() == {"loss"}
    assert float_logs({"noise_scale": 12.0}) == {"noise_scale": 12.0}


# ------------------------------------------------------------------ where each step's time goes
def timed_fit(times: dict[int, list[tuple[float, float]]], ranks: tuple[int, ...] = (0, 1)) -> ProgressModel:
    """A fit whose ranks timed their steps: rank -> each step's (seconds, seconds in collectives), sent in
    updates of 4 steps."""
    board = ProgressModel(list(ranks))
    for rank, steps in times.items():
        for seq, first in enumerate(range(0, len(steps), 4)):
            board.feed(update(rank, seq, step=first + 4, steps=100, step_times=[
                [i, wall, collective] for i, (wall, collective) in enumerate(steps[first:first + 4], start=first)]))
    return board


def test_the_rank_that_spends_least_in_collectives_is_the_one_the_others_wait_for():
    # rank 1 computes 0.2 s longer each step; rank 0 waits for it in the gradients' allreduce
    board = timed_fit({0: [(0.30, 0.21)] * 12, 1: [(0.30, 0.01)] * 12})
    breakdown = board.step_breakdown()
    assert breakdown.waited_for == 1 and breakdown.waited_s == pytest.approx(0.20)
    assert breakdown.fraction == pytest.approx((0.21 / 0.30 + 0.01 / 0.30) / 2)
    assert breakdown.per_rank == {0: pytest.approx((0.21, 0.30)), 1: pytest.approx((0.01, 0.30))}
    assert breakdown.slowest == dict.fromkeys(range(12), 1) and breakdown.steps == 12
    assert formatting.step_time_reading(board) == "communication 37% of each step; the others wait 0.20 s a " \
                                                  "step for rank 1"


def test_balanced_ranks_hold_no_one_back():
    # each rank a little slower every other step: no rank leads by much
    board = timed_fit({0: [(0.10, 0.030), (0.10, 0.032)] * 6, 1: [(0.10, 0.032), (0.10, 0.030)] * 6})
    breakdown = board.step_breakdown()
    assert breakdown.waited_for is None and breakdown.waited_s == pytest.approx(0.0, abs=1e-9)
    assert breakdown.fraction == pytest.approx(0.31)
    assert set(breakdown.slowest.values()) == {0, 1}
    assert formatting.step_time_reading(board) == "communication 31% of each step; no rank holds the others back"
    # a lead of 10% of a step but under 5 ms is no one's either: it is noise at this scale
    small = timed_fit({0: [(0.02, 0.0045)] * 4, 1: [(0.02, 0.0)] * 4}).step_breakdown()
    assert small.waited_for is None and small.waited_s == pytest.approx(0.0045)


def test_the_breakdown_is_over_the_recent_steps_every_rank_timed():
    # rank 1 is 8 steps behind; the first 60 steps were balanced, then rank 1 slowed down
    board = timed_fit({0: [(0.1, 0.01)] * 60 + [(0.1, 0.06)] * 60, 1: [(0.1, 0.01)] * 60 + [(0.1, 0.01)] * 52})
    breakdown = board.step_breakdown()
    assert breakdown.steps == STEP_WINDOW and max(breakdown.slowest) == 111  # (rank 1's last step)
    assert breakdown.waited_for == 1 and breakdown.waited_s == pytest.approx(0.05)
    # each rank keeps its latest steps only
    long = timed_fit({0: [(0.1, 0.01)] * (KEPT_STEPS + 40)}).runs[0].ranks[0].step_times
    assert list(long) == list(range(40, KEPT_STEPS + 40))


def test_no_breakdown_before_every_rank_timed_a_step_nor_without_collectives():
    assert ProgressModel([0, 1]).step_breakdown() is None
    assert timed_fit({0: [(0.1, 0.05)] * 4}).step_breakdown() is None  # rank 1 has sent nothing yet
    assert timed_fit({0: [(0.1, 0.0)] * 4, 1: [(0.1, 0.0)] * 4}).step_breakdown() is None  # none counted
    assert formatting.step_time_reading(ProgressModel([0])) is None
    one = timed_fit({0: [(0.1, 0.02)] * 4}, ranks=(0,))
    assert one.step_breakdown().waited_for is None
    assert formatting.step_time_reading(one) == "communication 20% of each step"


def test_a_reset_forgets_the_old_worlds_step_times():
    board = timed_fit({0: [(0.3, 0.2)] * 8, 1: [(0.3, 0.0)] * 8})
    board.reset({1: "signal Kill"}, "epoch=0")
    assert board.step_breakdown() is None  # the new world numbers its steps from 0 again
    for rank in (0, 1):
        board.feed(update(rank, 1, run="again", step=4, steps=100, step_times=[[0, 0.1, 0.02 + 0.03 * rank]]))
    assert board.step_breakdown().per_rank == {0: pytest.approx((0.02, 0.1)), 1: pytest.approx((0.05, 0.1))}


def test_every_view_keeps_where_the_time_goes():
    board = timed_fit({0: [(0.30, 0.21)] * 4, 1: [(0.30, 0.01)] * 4})
    for rank in (0, 1):
        board.feed(update(rank, 9, state="epoch_end", step=4, steps=4,
                          epoch_logs={0: {"loss": 1.0, "time": 1.2, "samples": 256}}))
    reading = "communication 37% of each step; the others wait 0.20 s a step for rank 1"
    lines: list[str] = []
    TextView(board, lines.append).render()
    assert lines[1] == f"[hvd_notebook] {reading}\n"
    bundle = static_bundle(board)
    assert f"<p class='hvd-step-time'>{reading}</p>" in bundle["text/html"]
    assert bundle["text/plain"].endswith(reading)
    pytest.importorskip("bqplot")
    from hvd_notebook.dashboard.widget import WidgetView

    view = WidgetView(board, display=Front())
    view.render()
    assert view.step_time.value == reading


def test_step_seconds_read_in_seconds_or_milliseconds():
    assert [formatting.fmt_seconds(s) for s in (1.5, 0.2, 0.05, 0.0008)] == ["1.50 s", "0.20 s", "50 ms", "0.8 ms"]
