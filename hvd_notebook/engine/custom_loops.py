"""Custom training loops report their progress to the dashboard: ``report(step=..., total=..., **metrics)``
(public as ``hvd_notebook.progress.report``), one ``RunReport`` per loop and cell."""

from __future__ import annotations

import time
from typing import Any

from ..messages import NOISE_SCALE, RankState, RunKind
from .reporter import RunReport, float_logs, measured_noise_scale, reporting, tell_batch


class _Custom:
    run: RunReport | None = None
    cell: Any = None


def _current_cell() -> Any:
    """The id of the request this engine is executing (a new cell starts a new run)."""
    try:
        from ipykernel.kernelbase import Kernel

        if Kernel.initialized():
            return Kernel.instance().get_parent().get("header", {}).get("msg_id")
    except Exception:
        pass
    return None


def report(step: int, total: int | None = None, epoch: int | None = None, epochs: int | None = None,
           samples: int | None = None, batch_size: int | None = None, **metrics: float) -> None:
    """Report a custom training loop's progress to the dashboard (throttled).

    ``step`` counts the completed steps of the current epoch (1 after the first),
    ``total`` is the steps per epoch; ``epoch`` (0-based) and ``epochs`` are for
    loops over several epochs; ``samples`` is this rank's samples so far; every
    other keyword is a metric to plot (``loss=..., accuracy=...``). With ``batch_size``
    (this rank's samples per step) the dashboard plots the gradient noise scale that
    the distributed optimizer or tape measured (``hvd.noise_scale``) beside them.
    The time from one report to the next, and its part in collectives, is the steps'
    in between (the first report only starts the clock).

    >>> for step in range(1, 101):
    ...     loss = train_step()
    ...     hvd_notebook.progress.report(step=step, total=100, loss=float(loss))

    Args:
        step: the completed steps of the current epoch (1 after the first).
        total: the steps per epoch, where known.
        epoch: the current epoch, 0-based, for loops over several epochs.
        epochs: the number of epochs.
        samples: this rank's samples so far (else counted from ``batch_size``).
        batch_size: this rank's samples per step; the dashboard then plots the gradient noise scale.
        **metrics: numbers to plot by name (``loss=..., accuracy=...``).
    """
    if not reporting():
        return
    cell = _current_cell()
    run = _Custom.run
    if run is None or _Custom.cell != cell or (epoch or 0) < run.epoch:
        run = _Custom.run = RunReport(RunKind.CUSTOM)
        _Custom.cell = cell
    if epochs:
        run.epochs = epochs
    last_epoch = (epoch or 0) + 1 >= (epochs or 1)
    next_epoch = epoch is not None and epoch != run.epoch
    run.end_steps(int(step) if next_epoch or not run.steps_timed else int(step) - run.step)
    if next_epoch:
        if run.epoch not in run.epoch_logs:  # the loop moved on without reporting the last step
            run.epoch_logs[run.epoch] = _custom_epoch_record(run)
        run.epoch, run.epoch_start = epoch, time.monotonic()
        run.epoch_first_sample = run.told_samples or 0
    run.step, run.steps = int(step), total
    if batch_size is not None:
        run.batch_size = int(batch_size)
        tell_batch(run.batch_size)  # (hvd.noise_scale() in the loop takes it from now on)
        measured = measured_noise_scale(batch_size)
        if measured is not None and NOISE_SCALE not in metrics:
            metrics[NOISE_SCALE] = measured
    run.logs.update(float_logs(metrics))
    if samples is not None:
        run.told_samples = int(samples)
    finished = total is not None and step >= total
    if finished:
        run.epoch_logs[run.epoch] = _custom_epoch_record(run, samples is not None)
    run.update(RankState.DONE if finished and last_epoch else RankState.EPOCH_END if finished else RankState.RUNNING)
    if finished and last_epoch:
        _Custom.run = None


def _custom_epoch_record(run: RunReport, with_samples: bool = True) -> dict[str, float]:
    record = dict(run.logs, time=time.monotonic() - run.epoch_start)
    if with_samples and run.told_samples is not None:
        record["samples"] = run.told_samples - run.epoch_first_sample
    return record
