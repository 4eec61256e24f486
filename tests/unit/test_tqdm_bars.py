"""tqdm bars feed the dashboard's progress updates (engine/tqdm_bars.py), in this process: the
publisher that an engine would use is replaced by a list, everything else is real tqdm."""

from __future__ import annotations

import importlib
import io

import pytest

from hvd_notebook.engine import custom_loops, reporter, tqdm_bars
from hvd_notebook.messages import ProgressUpdate, RankState


@pytest.fixture
def updates(monkeypatch):
    published: list[ProgressUpdate] = []

    def publish(data):
        published.extend(ProgressUpdate.from_dict(v) for v in data.values())

    monkeypatch.setattr(reporter._State, "publish", publish)
    monkeypatch.setattr(reporter._State, "enabled", True)
    monkeypatch.setattr(custom_loops, "_current_cell", lambda: "cell-1")
    monkeypatch.setattr(reporter.Throttle, "ready", lambda self, force=False: True)  # every update, here
    modules = {name: importlib.import_module(name) for name in ("tqdm", "tqdm.std", "tqdm.auto")}
    saved = {name: (m.tqdm, getattr(m, "trange", None)) for name, m in modules.items()}
    assert tqdm_bars.install()
    yield published
    for name, (cls, trange) in saved.items():
        modules[name].tqdm = cls
        if trange is not None:
            modules[name].trange = trange
    custom_loops._Custom.run = None


class Loader(list):
    batch_size = 8


def test_a_bar_over_a_loader_reports_steps_samples_and_metrics_and_prints_nothing(updates, capsys):
    from tqdm.auto import tqdm

    bar = tqdm(Loader(range(5)), desc="train")
    for _ in bar:
        bar.set_postfix(loss=0.5, note="text")
    bar.close()
    out = capsys.readouterr()
    assert out.out == "" and out.err == ""
    last = updates[-1]
    assert (last.step, last.steps, last.samples, last.state) == (5, 5, 40, RankState.DONE)
    assert last.logs["loss"] == 0.5 and "note" not in last.logs


def test_an_outer_trange_is_the_epochs_and_inner_bars_add_up_samples(updates):
    from tqdm.auto import tqdm, trange

    for epoch in trange(3, desc="epochs", disable=True):  # disabled as on every rank but 0: still reported
        bar = tqdm(Loader(range(4)), desc=f"epoch {epoch}")  # (tqdm compares bars by position, not identity)
        for _ in bar:
            bar.set_postfix(loss=0.25)
    epochs = {u.epoch for u in updates}
    assert epochs == {0, 1, 2} and all(u.epochs == 3 for u in updates)
    assert max(u.samples or 0 for u in updates) == 3 * 4 * 8
    assert len({u.run for u in updates}) == 1  # one run on the dashboard, not one per epoch
    assert updates[-1].state == RankState.DONE


def test_without_a_dashboard_a_bar_is_tqdms_own(updates, monkeypatch):
    import tqdm

    monkeypatch.setattr(reporter._State, "enabled", False)  # %%hvd --no-progress
    sink = io.StringIO()
    for _ in tqdm.tqdm(range(3), file=sink, mininterval=0):
        pass
    assert "3/3" in sink.getvalue() and updates == []


def test_install_is_idempotent(updates):
    import tqdm

    cls = tqdm.tqdm
    assert tqdm_bars.install() and tqdm.tqdm is cls and getattr(cls, "hvd_dashboard", False)


def test_a_custom_loop_told_its_batch_reports_the_measured_noise_scale(updates, monkeypatch):
    from hvd_notebook.runtime.core import noise_scale

    estimator = noise_scale.NoiseScale(decay=0.5)
    monkeypatch.setattr(noise_scale, "_latest", None)
    monkeypatch.setattr(reporter._State, "noise_scale", staticmethod(noise_scale.noise_scale))  # as install() does
    custom_loops.report(step=1, total=3, batch_size=32, loss=1.0)
    assert "noise_scale" not in updates[-1].logs  # nothing measured yet
    noise_scale.record(estimator, local_sq=3.0, global_sq=2.0, ranks=2)  # a tape cannot tell its batch
    custom_loops.report(step=2, total=3, batch_size=32, loss=0.9)
    assert updates[-1].logs["noise_scale"] == pytest.approx(64.0) and updates[-1].batch_size == 32
    custom_loops.report(step=3, total=3, loss=0.8)  # without a batch: only what the loop gave
    assert updates[-1].logs["noise_scale"] == pytest.approx(64.0)  # (the last one reported stays in the logs)


def test_a_custom_loop_times_its_steps_and_their_collectives(updates, monkeypatch):
    now, collective = [0.0], [0.0]
    monkeypatch.setattr(reporter.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(reporter._State, "collective_seconds", staticmethod(lambda: collective[0]))

    def step(step: int, seconds: float, in_collectives: float, **kwargs) -> list[list[float]]:
        now[0] += seconds
        collective[0] += in_collectives
        custom_loops.report(step=step, total=10, **kwargs)
        return updates[-1].step_times

    assert step(1, 9.0, 5.0) == []  # the first report starts the clock: the time before it is unknown
    assert step(2, 1.0, 0.25) == [[1, 1.0, 0.25]]
    assert step(4, 3.0, 1.0) == [[3, 1.5, 0.5]]  # two steps since the last report: their means
    assert step(4, 1.0, 1.0) == []  # the same step again: its time goes to the next
    assert step(1, 1.0, 0.0, epoch=1) == [[4, 2.0, 1.0]]  # the next epoch's first step
    # throttled updates: the next one carries every step since the last one sent
    monkeypatch.setattr(reporter.Throttle, "ready", lambda self, force=False: force)
    sent = len(updates)
    step(2, 1.0, 0.5, epoch=1)
    step(3, 1.0, 0.0, epoch=1)
    assert len(updates) == sent
    assert step(10, 7.0, 0.0, epoch=1) == [[5, 1.0, 0.5], [6, 1.0, 0.0], [13, 1.0, 0.0]]  # (its end is forced)


def test_without_the_runtime_no_step_is_timed(updates):
    custom_loops.report(step=1, total=3)
    custom_loops.report(step=2, total=3)
    assert updates[-1].step_times == []
