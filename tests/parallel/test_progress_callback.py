"""The engine side of the dashboard with real Keras on 2 ranks: what the
automatic ProgressCallback publishes for fit/evaluate/predict and custom loops.

Publishing is captured here instead of going to an engine's IOPub channel (the
cluster tests in tests/test_dashboard.py cover that leg)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import hvd_notebook
from hvd_notebook.engine import custom_loops, keras_progress, reporter


@pytest.fixture
def published(hvd, monkeypatch):
    sent: list[dict] = []
    monkeypatch.setattr(reporter._State, "publish", lambda data: sent.extend(data.values()))
    monkeypatch.setattr(reporter._State, "rank", hvd.rank())
    monkeypatch.setattr(reporter._State, "enabled", True)
    keras_progress.install()
    return sent


@pytest.fixture(scope="module")
def model(tf):
    import keras

    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"),
                          keras.layers.Dense(2, activation="softmax")])
    m.compile(optimizer="sgd", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return m


def data(n=256):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64)


def test_fit_reports_epochs_steps_samples_and_every_metric(published, model, hvd):
    x, y = data()
    model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    assert published, "fit published nothing"
    assert {u["rank"] for u in published} == {hvd.rank()}
    assert {u["kind"] for u in published} == {"fit"} and len({u["run"] for u in published}) == 1
    ends = [u for u in published if u["state"] == "epoch_end"]
    assert [u["epoch"] for u in ends] == [0, 1, 2]
    assert all(u["step"] == u["steps"] == 8 and u["epochs"] == 3 for u in ends)
    assert [u["samples"] for u in ends] == [256, 512, 768]
    assert set(ends[-1]["epoch_logs"]) == {0, 1, 2}
    assert {"loss", "accuracy", "time", "samples"} <= set(ends[-1]["epoch_logs"][2])
    last = published[-1]
    assert last["state"] == "done" and last["samples"] == 768 and last["step"] == 8 and last["epoch"] == 2
    assert {"loss", "accuracy"} <= set(last["logs"])
    assert [u["seq"] for u in published] == sorted(u["seq"] for u in published)


def test_batch_updates_are_throttled_to_ten_a_second(published, model):
    import keras

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(0.004)

    x, y = data(2048)
    start = time.monotonic()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Slow()])  # 256 batches, >= 1 s
    seconds = time.monotonic() - start
    running = [u for u in published if u["state"] == "running"]
    assert len(running) <= 10 * seconds + 3, (len(running), seconds)
    assert len(running) >= 5  # and it does report while training


def test_users_callbacks_are_left_as_they_are(published, model):
    import keras

    seen = []

    class Mine(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(epoch)

    callbacks = [Mine()]
    x, y = data()
    model.fit(x, y, epochs=2, verbose=0, callbacks=callbacks)
    assert len(callbacks) == 1 and seen == [0, 1] and published


def test_an_explicit_progress_callback_is_not_doubled(published, model):
    x, y = data()
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[hvd_notebook.ProgressCallback()])
    assert len({u["run"] for u in published}) == 1
    assert published[-1]["samples"] == 256  # the hook told it the batch size


def test_evaluate_and_predict_report_as_their_own_runs(published, model):
    x, y = data()
    model.evaluate(x, y, batch_size=32, verbose=0)
    model.predict(x, batch_size=64, verbose=0)
    kinds = [u["kind"] for u in published if u["state"] == "done"]
    assert kinds == ["evaluate", "predict"]
    done = [u for u in published if u["state"] == "done"]
    assert done[0]["step"] == 8 and done[0]["samples"] == 256 and "loss" in done[0]["logs"]
    assert done[1]["step"] == 4 and done[1]["samples"] == 256


def test_validation_inside_fit_stays_in_the_fit_run(published, model):
    x, y = data()
    model.fit(x, y, epochs=2, verbose=0, validation_split=0.25)
    assert {u["kind"] for u in published} == {"fit"}
    assert "val_loss" in published[-1]["epoch_logs"][1]
    assert published[-1]["samples"] == 2 * 192  # the validation quarter is not trained on


def test_no_progress_turns_the_hook_off(published, model):
    reporter.set_enabled(False)
    try:
        x, y = data()
        model.fit(x, y, epochs=1, verbose=0)
        custom_loops.report(step=1, total=1, loss=0.5)
    finally:
        reporter.set_enabled(True)
    assert published == []


def test_custom_loops_report_through_report(published):
    for epoch in range(2):
        for step in range(1, 21):
            custom_loops.report(step=step, total=20, epoch=epoch, epochs=2, loss=1.0 / step)
    assert {u["kind"] for u in published} == {"custom"}
    assert published[-1]["state"] == "done" and published[-1]["epoch"] == 1 and published[-1]["step"] == 20
    assert published[-1]["logs"]["loss"] == pytest.approx(0.05)
    assert set(published[-1]["epoch_logs"]) == {0, 1}
    assert sum(u["state"] == "epoch_end" for u in published) == 1


def test_outside_an_engine_nothing_is_published(hvd, model, monkeypatch):
    monkeypatch.setattr(reporter._State, "publish", None)
    keras_progress.install()
    x, y = data()
    model.fit(x, y, epochs=1, verbose=0)  # the hook passes straight through
    custom_loops.report(step=1, total=1)


def test_fit_times_each_step_and_the_rank_that_sleeps_is_the_one_waited_for(published, hvd, tf, monkeypatch):
    import keras

    from hvd_notebook.dashboard import ProgressModel
    from hvd_notebook.messages import ProgressUpdate
    from hvd_notebook.runtime.core import collective_time

    monkeypatch.setattr(reporter._State, "collective_seconds", staticmethod(collective_time.seconds))  # (install)
    sleep = 0.2

    class Sleepy(keras.callbacks.Callback):  # rank 1 computes longer in each step
        def on_train_batch_begin(self, batch, logs=None):
            if hvd.rank() == 1:
                time.sleep(sleep)

    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, activation="softmax")])
    m.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="sparse_categorical_crossentropy")
    x, y = data(64)
    m.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[Sleepy()])  # 8 steps, one allreduce each
    mine = [ProgressUpdate.from_dict(u) for u in published]
    steps = [s for u in mine for s in u.step_times]
    assert [s[0] for s in steps] == list(range(1, 8))  # the first step (tracing the step function) is not timed
    assert all(collective <= wall for _, wall, collective in steps)
    board = ProgressModel(list(range(hvd.size())))  # the notebook kernel's model of every rank's updates
    for updates in hvd.allgather_object(mine):
        for update in updates:
            board.feed(update)
    breakdown = board.step_breakdown()
    assert breakdown.waited_for == 1 and breakdown.steps == 7, breakdown
    waiting, step_s = breakdown.per_rank[0]
    assert waiting == pytest.approx(sleep, rel=0.3) and breakdown.waited_s == pytest.approx(sleep, rel=0.3), \
        breakdown
    # (a step lasts the slowest rank's sleep: measured on rank 0's clock, from a later start than rank 1's, so
    # within a few per cent of it on a loaded VM)
    assert breakdown.per_rank[1][0] < 0.25 * sleep and step_s >= 0.9 * sleep
    print(f"rank 0 waited {waiting * 1e3:.0f} ms a step for rank 1's {sleep * 1e3:.0f} ms sleep; "
          f"steps of {step_s * 1e3:.0f} ms; {breakdown.fraction:.0%} in collectives")
