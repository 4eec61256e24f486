"""The dashboard's parts on their own: throttle, aggregation, text fallback, static summary."""

from __future__ import annotations

import base64

import pytest

from hvd_notebook.dashboard import (
    Dashboard,
    ProgressModel,
    ProgressUpdate,
    TextView,
    formatting,
    resolve_mode,
    static_bundle,
)
from hvd_notebook.dashboard.message import KEY_PREFIX
from hvd_notebook.progress import Throttle


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
    board = ProgressModel([0, 1])
    board.feed(update(0, 0, step=10, logs={"loss": 2.0}))
    board.feed(update(0, 1, step=20, logs={"loss": 1.0}))
    board.feed(update(1, 0, step=15, logs={"loss": 4.0}))
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
    assert lines == ["[hvd] fit epoch 1/2 | 2 ranks | 6,400 samples/s | loss 1 accuracy 0.9 | 2.0 s\n"]
    board.feed(update(0, 0, run="e", kind="evaluate", state="done", step=10, steps=10, samples=320, elapsed=0.5,
                      logs={"loss": 0.25}))
    board.feed(update(1, 0, run="e", kind="evaluate", state="done", step=10, steps=10, samples=320, elapsed=0.5,
                      logs={"loss": 0.75}))
    view.render()
    board.fail(1, "KeyError: 'x'")
    view.render()
    assert lines[1:] == ["[hvd] evaluate | 2 ranks | 1,280 samples/s | loss 0.5\n",
                         "[hvd] rank 1 failed: KeyError: 'x'\n"]


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
    assert ("[hvd] reset: rank 1 died (signal Kill) at epoch 1/2 step 40; world restarted; resumed from the "
            "last commit (batch=30, committed at 10:02:11)") in text, text
    bundle = static_bundle(model)
    assert "reset 1 at 0:42: rank 1 died" in bundle["text/plain"]
    assert "class='hvd-reset'" in bundle["text/html"] and bundle["image/png"]
