"""How figures read on the dashboard: durations, rates, metric lists, the
headline of a run and the line of one rank. Shared by every view, and by the
tables of ``%hvd`` and ``hvd-notebook`` (``text_table``)."""

from __future__ import annotations

from collections.abc import Sequence

from ..messages import RankState
from .model import TIMING, ProgressModel, RankProgress, ResetEvent


def text_table(rows: Sequence[Sequence[str]]) -> str:
    """Rows of cells as left-aligned columns two spaces apart (the first row is the header).

    Args:
        rows: the header, then the rows, as text cells.
    """
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)


def fmt_duration(seconds: float | None) -> str:
    """``1:15`` or ``1:02:05``; ``-`` when unknown.

    Args:
        seconds: the duration, or None.
    """
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def fmt_rate(rate: float | None) -> str:
    """``6,400`` for large rates, three significant digits for small ones.

    Args:
        rate: samples (or steps) per second, or None.
    """
    if rate is None:
        return "-"
    return f"{rate:,.0f}" if rate >= 100 else f"{rate:.3g}"


def fmt_logs(logs: dict[str, float]) -> str:
    """``loss 0.41 accuracy 0.88``: loss first, then the other metrics, validation last.

    Args:
        logs: metric name -> value.
    """
    names = sorted((k for k in logs if k not in TIMING), key=lambda k: (k.startswith("val_"), "loss" not in k))
    return " ".join(f"{k} {logs[k]:.4g}" for k in names)


def fmt_epoch(rank_progress: RankProgress) -> str:
    """``epoch 3/10`` (counted from 1); nothing for a run of one epoch.

    Args:
        rank_progress: one rank's progress in the current run.
    """
    epochs = rank_progress.epochs or 1
    return f"epoch {min(rank_progress.epoch + 1, epochs)}/{epochs}" if epochs > 1 else ""


def noise_reading(model: ProgressModel) -> str | None:
    """One sentence on the measured gradient noise scale (an estimate of the critical batch size, McCandlish
    et al. 2018) against the global batch: whether more ranks should still pay off. None before it is
    measured.

    Args:
        model: the cell's progress (every rank's runs).
    """
    measured = model.noise_scale()
    if measured is None:
        return None
    scale = f"the measured noise scale {fmt_rate(measured)}"
    batch = model.global_batch()
    if batch is None:
        return f"{scale[4:]} samples is about the largest global batch that still pays off"
    if batch < measured / 2:
        return f"the global batch {batch:,} is below {scale}: more ranks should still pay off"
    if batch > 2 * measured:
        return f"the global batch {batch:,} is above {scale}: more ranks would mostly add samples, not save steps"
    return f"the global batch {batch:,} is near {scale}, the critical batch size: more ranks pay off less and less"


def fmt_seconds(seconds: float) -> str:
    """``0.20 s`` from a tenth of a second up, ``12 ms`` or ``0.8 ms`` below.

    Args:
        seconds: a duration.
    """
    return f"{seconds:.2f} s" if seconds >= 0.1 else f"{seconds * 1e3:.2g} ms"


def step_time_reading(model: ProgressModel) -> str | None:
    """One sentence on where the recent steps' time went: the share in collectives, and the rank the others
    wait for where one holds them back. None before every rank timed a step, or without collectives.

    Args:
        model: the cell's progress (every rank's runs).
    """
    breakdown = model.step_breakdown()
    if breakdown is None:
        return None
    reading = f"communication {breakdown.fraction:.0%} of each step"
    if breakdown.waited_for is not None:
        return f"{reading}; the others wait {fmt_seconds(breakdown.waited_s)} a step for rank {breakdown.waited_for}"
    return reading + ("; no rank holds the others back" if len(breakdown.per_rank) > 1 else "")


def headline(model: ProgressModel) -> str:
    """One line: the current run, its epoch, the global rate, elapsed and ETA.

    Args:
        model: the cell's progress (every rank's runs).
    """
    run = model.current
    if run is None:
        return "waiting for the ranks' progress"
    parts = [run.kind.value, fmt_epoch(next(iter(run.ranks.values()))) if run.kind.has_curves else ""]
    parts.append(f"{fmt_rate(model.rate(run))} {run.unit} over {len(run.ranks)} rank(s)")
    parts.append(f"elapsed {fmt_duration(model.elapsed())}")
    if model.run_done(run):
        parts.append("done")
    elif model.failed:
        parts.append(f"failed on rank(s) {sorted(model.failed)}")
    else:
        parts.append(f"ETA {fmt_duration(model.eta())}")
    return " | ".join(p for p in parts if p)


def event_lines(model: ProgressModel) -> list[str]:
    """A line per reset of the world during the cell: ``reset 1 at 0:42: rank 1 died (signal Kill) at
    epoch 3/10 step 40; world restarted; resumed from the last commit (epoch=2, batch=32, ...)``.

    Args:
        model: the cell's progress, with its resets.
    """
    return [f"reset {i} at {fmt_duration(e.elapsed)}: {reset_text(e)}" for i, e in enumerate(model.events, 1)]


def reset_text(event: ResetEvent) -> str:
    """What happened at one reset, in a sentence.

    Args:
        event: the reset: the ranks that died, where, and the commit resumed from.
    """
    deaths = []
    for rank, how in sorted(event.died.items()):
        death = f"rank {rank} died" + (f" ({how})" if how else "")
        if rank in event.stood:
            epoch, epochs, step = event.stood[rank]
            death += (f" at epoch {epoch + 1}/{epochs}" if (epochs or 1) > 1 else " at") + f" step {step}"
        deaths.append(death)
    return f"{', '.join(deaths)}; world restarted; resumed from the last commit ({event.commit or 'unknown'})"


def rank_line(rank_progress: RankProgress) -> str:
    """One rank's epoch, step, and metrics (or its error).

    Args:
        rank_progress: one rank's progress in the current run.
    """
    parts = [fmt_epoch(rank_progress),
             f"step {rank_progress.step}/{rank_progress.steps if rank_progress.steps is not None else '?'}"]
    if rank_progress.state == RankState.FAILED:
        parts.append(f"FAILED: {rank_progress.error}")
    else:
        parts.append(fmt_logs(rank_progress.logs))
    return "  ".join(p for p in parts if p)
