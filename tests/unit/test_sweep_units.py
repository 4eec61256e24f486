"""``%%hvd sweep``'s parts on their own: the point's learning-rate rules and warm-up, the grid, the target, the
results file (resumable, refusing another sweep's file and links), the figures measured from a point's
dashboard model, scaling efficiency, and the table and plots."""

from __future__ import annotations

import json
import os

import pytest
from IPython.core.error import UsageError

from hvd_notebook.dashboard import ProgressModel
from hvd_notebook.dashboard.sweep import SweepDisplay, row_cells
from hvd_notebook.engine.sweep_point import SweepPoint
from hvd_notebook.kernel import sweep
from hvd_notebook.kernel.failures import HvdError
from hvd_notebook.kernel.magics import _build_sweep_parser
from hvd_notebook.messages import ProgressUpdate


def test_the_rules_scale_the_base_rate_to_the_global_batch_and_warm_up_from_it():
    point = SweepPoint(ranks=4, batch=64, lr_rule="linear", warmup=2, base_batch=64)
    assert point.global_batch == 256 and point.lr(0.01) == pytest.approx(0.04)
    assert SweepPoint(4, 64, "sqrt", base_batch=64).lr(0.01) == pytest.approx(0.02)
    assert SweepPoint(4, 64, "none", base_batch=64).lr(0.01) == 0.01
    assert [point.lr_at(0.01, e) for e in (0, 1, 2, 5)] == pytest.approx([0.01, 0.025, 0.04, 0.04])
    assert SweepPoint(4, 64, "linear", base_batch=64).callbacks(0.01) == []  # no warm-up: nothing to add


def test_the_warm_up_callback_sets_the_rate_at_every_step():
    keras = pytest.importorskip("keras")
    point = SweepPoint(ranks=2, batch=8, lr_rule="linear", warmup=1, base_batch=8)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.SGD(point.lr(0.1)), loss="mse")
    seen = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: seen.append(float(model.optimizer.learning_rate)))
    import numpy as np
    model.fit(np.zeros((16, 2)), np.zeros(16), batch_size=4, epochs=2, verbose=0,
              callbacks=[*point.callbacks(0.1), record])
    assert seen[:4] == pytest.approx([0.125, 0.15, 0.175, 0.2]) and seen[4:] == pytest.approx([0.2] * 4)


def test_the_grid_runs_ranks_ascending_and_refuses_an_unknown_rule():
    points = sweep.Grid((2, 1), (16, 64), ("none", "linear")).points()
    assert [p.ranks for p in points] == [1, 1, 1, 1, 2, 2, 2, 2]
    assert {p.base_batch for p in points} == {16} and [p.index for p in points] == list(range(8))
    assert points[0].key == "ranks=1 batch=16 lr=none warmup=0" and points[0].total == 8
    with pytest.raises(ValueError, match="the rules are none, linear, sqrt"):
        sweep.Grid((1,), (16,), ("cubic",)).points()


def test_a_target_is_parsed_and_checked_against_an_epochs_row():
    target = sweep.Target.parse("val_accuracy >= 0.95")
    assert str(target) == "val_accuracy>=0.95"
    assert target.met({"val_accuracy": 0.96}) and not target.met({"val_accuracy": 0.9}) and not target.met({})
    assert sweep.Target.parse("val_loss<1e-2").met({"val_loss": 0.005})
    for bad in ("accuracy", "accuracy=0.9", ">=0.9", "accuracy>=high"):
        with pytest.raises(ValueError, match="write METRIC>=VALUE"):
            sweep.Target.parse(bad)


def test_the_magics_options_refuse_bad_lists_with_help():
    parser = _build_sweep_parser()
    args = parser.parse_args(["-n", "1,2", "--batch", "16,64", "--lr", "linear,sqrt", "--warmup", "0,3"])
    assert args.np == (1, 2) and args.batch == (16, 64) and args.lr == ("linear", "sqrt") and args.warmup == (0, 3)
    for argv in (["-n", "0,2", "--batch", "16"], ["-n", "1,x", "--batch", "16"], ["--batch", "16"]):
        with pytest.raises(UsageError, match="See %%hvd"):
            parser.parse_args(argv)


def test_the_results_file_resumes_skips_a_cut_line_and_refuses_another_sweeps(tmp_path):
    path = tmp_path / "sweep.jsonl"
    results = sweep.ResultsFile(path, "abc")
    assert results.finished() == {}
    results.append({"point": "ranks=1 batch=16 lr=none warmup=0", "status": "ok", "code": "abc"})
    results.append({"point": "ranks=1 batch=64 lr=none warmup=0", "status": "failed", "code": "abc"})
    with open(path, "a") as f:
        f.write('{"point": "ranks=2')  # a crash in the middle of a line
    assert set(results.finished()) == {"ranks=1 batch=16 lr=none warmup=0", "ranks=1 batch=64 lr=none warmup=0"}
    with pytest.raises(HvdError, match="holds the results of another sweep"):
        sweep.ResultsFile(path, "other").finished()
    assert sweep.digest("a = 1\n", None) != sweep.digest("a = 2\n", None)
    assert sweep.digest("a = 1\n", None) != sweep.digest("a = 1\n", sweep.Target.parse("loss<1"))


def test_the_results_file_is_not_written_through_a_link(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("")
    os.symlink(elsewhere, tmp_path / "sweep.jsonl")
    with pytest.raises(HvdError, match="symbolic link; it was not followed. Name another with --results"):
        sweep.ResultsFile(tmp_path / "sweep.jsonl", "abc").append({"point": "p"})
    assert elsewhere.read_text() == ""


def _fit(model: ProgressModel, rank: int, epochs: list[dict], batch: int = 16,
         step: tuple[float, float] | None = None) -> None:
    """A fit's updates, an epoch each; ``step``: each step's (seconds, in collectives), where they are timed."""
    for epoch in range(len(epochs)):
        logs = {e: dict(epochs[e]) for e in range(epoch + 1)}
        timed = [[epoch * 10 + i, *step] for i in range(10)] if step else []
        model.feed(ProgressUpdate.from_dict({
            "rank": rank, "seq": epoch, "run": f"{rank}.r", "kind": "fit", "state": "epoch_end", "epoch": epoch,
            "epochs": len(epochs), "step": 10, "steps": 10, "samples": 160 * (epoch + 1), "elapsed": 1.0 + epoch,
            "logs": {"loss": epochs[epoch]["loss"], "noise_scale": 300.0}, "epoch_logs": logs, "batch_size": batch,
            "step_times": timed}))


def test_a_points_figures_come_from_its_dashboard_model():
    model = ProgressModel([0, 1])
    epochs = [{"loss": 1.0, "val_accuracy": 0.5, "time": 3.0, "samples": 160},  # the first epoch traces the step
              {"loss": 0.5, "val_accuracy": 0.92, "time": 1.0, "samples": 160},
              {"loss": 0.4, "val_accuracy": 0.96, "time": 1.0, "samples": 160}]
    for rank in (0, 1):
        _fit(model, rank, epochs)
    point = SweepPoint(2, 16)
    figures = sweep.measure(point, model, sweep.Target.parse("val_accuracy>=0.95"))
    assert figures["samples_per_s"] == pytest.approx(320)  # the epochs after the first, both ranks
    assert figures["seconds"] == pytest.approx(5.0) and figures["epochs"] == 3 and figures["steps_per_epoch"] == 10
    assert figures["seconds_to_target"] == pytest.approx(5.0) and figures["steps_to_target"] == 30
    assert figures["metrics"] == pytest.approx({"loss": 0.4, "val_accuracy": 0.96})
    assert figures["noise_scale"] == pytest.approx(300.0)
    missed = sweep.measure(point, model, sweep.Target.parse("val_accuracy>=0.99"))
    assert missed["seconds_to_target"] is None and missed["steps_to_target"] is None
    with pytest.raises(HvdError, match="trained nothing the sweep could measure"):
        sweep.measure(point, ProgressModel([0]), None)


def test_timed_steps_give_the_training_throughput_and_where_a_steps_time_went():
    model = ProgressModel([0, 1])
    epochs = [{"loss": 1.0, "time": 9.0, "samples": 160}, {"loss": 0.5, "time": 9.0, "samples": 160}]
    _fit(model, 0, epochs, step=(0.1, 0.06))  # rank 0 waits 60 ms of each 100 ms step for rank 1
    _fit(model, 1, epochs, step=(0.1, 0.01))
    figures = sweep.measure(SweepPoint(2, 16), model, None)
    assert figures["samples_per_s"] == pytest.approx(320)  # 2 x 16 samples a 0.1 s step, not the epochs' 9 s
    assert figures["communication"] == pytest.approx(0.35) and figures["waited_for"] == 1
    assert "35%, waits for rank 1" in row_cells(SweepPoint(2, 16), {"status": "ok", **figures})


def test_efficiency_is_against_the_one_rank_point_of_the_same_per_rank_batch():
    rows = [{"status": "ok", "ranks": 1, "batch": 16, "lr_rule": "none", "warmup": 0, "samples_per_s": 100.0},
            {"status": "ok", "ranks": 1, "batch": 64, "lr_rule": "none", "warmup": 0, "samples_per_s": 300.0}]
    two = {"status": "ok", "ranks": 2, "batch": 16, "lr_rule": "linear", "warmup": 0, "samples_per_s": 180.0}
    assert sweep.efficiency(two, rows + [two]) == pytest.approx(0.9)
    assert sweep.efficiency({**two, "batch": 32}, rows) is None  # no 1-rank point of that batch
    assert sweep.efficiency({**two, "status": "failed"}, rows) is None


class FakeDisplay:
    def __init__(self) -> None:
        self.shown: list[dict] = []

    def __call__(self, bundle: dict, raw: bool = False, display_id: bool = False) -> FakeDisplay:
        self.shown.append(bundle)
        return self

    def update(self, bundle: dict, raw: bool = False) -> None:
        self.shown.append(bundle)


def test_the_table_shows_each_point_finished_running_failed_or_to_come_and_plots_once_one_ended():
    points = sweep.Grid((1, 2), (16,), ("none",)).points()
    shown = FakeDisplay()
    view = SweepDisplay(points, sweep.Target.parse("val_accuracy>=0.95"), shown)
    view.update({}, points[0], "fit | epoch 1/3")
    assert "fit | epoch 1/3" in shown.shown[-1]["text/plain"] and "<img" not in shown.shown[-1]["text/html"]
    ok = {"point": points[0].key, "status": "ok", "ranks": 1, "batch": 16, "global_batch": 16, "lr_rule": "none",
          "warmup": 0, "samples_per_s": 1234.0, "efficiency": 1.0, "seconds_to_target": 75.0, "steps_to_target": 300,
          "seconds": 80.0, "communication": 0.25, "noise_scale": 310.0, "metrics": {"val_accuracy": 0.96}}
    failed = {"point": points[1].key, "status": "failed", "error": "rank 1 raised ValueError: no"}
    view.update({points[0].key: ok, points[1].key: failed})
    text, page = shown.shown[-1]["text/plain"], shown.shown[-1]["text/html"]
    assert "2 of 2 point(s) done, target val_accuracy>=0.95" in text
    assert "1,234" in text and "100%" in text and "1:15, 300 steps" in text and "25%" in text and "310" in text
    assert "failed: rank 1 raised ValueError: no" in text and "<img alt='hvd sweep plots'" in page
    assert row_cells(points[1], {**ok, "seconds_to_target": None})[4] == "not reached"
    assert json.dumps(shown.shown[-1])  # plain data, as a notebook saves it


class FailingSession:
    """A session whose every point fails at once: the sweep's bookkeeping without a world."""

    def __init__(self) -> None:
        self.n = 2

    def require(self) -> FailingSession:
        return self

    def fresh_world(self, n: int, keep: bool = False) -> list:
        return []

    def push(self, name: str, value: object) -> None:
        pass

    def run_measured(self, code: str, board: object, timeout: float | None) -> None:
        raise HvdError("no")


def test_an_interrupt_during_a_points_append_counts_the_line_it_wrote(tmp_path, monkeypatch, capsys):
    """The stop button can land in the fsync after a point's line is written: the message counts the file."""
    path, written = tmp_path / "sweep.jsonl", []
    append = sweep.private.append_text

    def append_then_interrupt(target, text):
        append(target, text)
        written.append(text)
        if len(written) == 3:  # (the empty append that makes the file, then two points)
            raise KeyboardInterrupt

    monkeypatch.setattr(sweep.private, "append_text", append_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        sweep.run_sweep(FailingSession(), "pass", sweep.Grid((1, 2), (16, 64), ("none",)), None, path,
                        display=FakeDisplay())
    assert "sweep interrupted; 2 of 4 point(s) are in" in capsys.readouterr().err
    assert len(path.read_text().splitlines()) == 2
