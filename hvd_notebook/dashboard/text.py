"""The text view: one compact line per finished epoch and per finished
evaluate/predict, where no widget front end exists (nbclient/nbconvert runs,
IPython in a terminal). The widget view subclasses it."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from ..config import PREFIX
from .formatting import fmt_logs, fmt_rate, noise_reading, reset_text, step_time_reading
from .model import ProgressModel


class TextView:
    """Prints a line per finished epoch, per finished evaluate/predict and per failed rank.

    >>> view = TextView(ProgressModel([0, 1]))
    >>> view.show(); view.render(); view.finish()

    Args:
        model: the cell's progress (every rank's runs), which the view draws; its subclasses take it too.
        write: where the lines go (``sys.stdout`` by default).
    """

    def __init__(self, model: ProgressModel, write: Callable[[str], Any] | None = None) -> None:
        self.model = model
        self.write = write or (lambda text: sys.stdout.write(text))
        self.printed: set[tuple[int, int]] = set()  # (run index, epoch)
        self.ended: set[int] = set()  # runs of evaluate/predict printed
        self.failures: set[int] = set()
        self.events = 0  # reset events printed

    def show(self) -> None:
        """Put the view under the cell (text needs nothing until the first line)."""

    def render(self) -> None:
        """Draw what changed since the last call."""
        for line in self.lines():
            self.write(line + "\n")

    def finish(self) -> None:
        """The cell ended: draw the last of it."""
        self.render()

    def lines(self) -> list[str]:
        """The lines not printed yet."""
        out = []
        model = self.model
        for index, run in enumerate(model.runs):
            ranks = len(run.ranks)
            for row in model.epoch_rows(run):
                epoch = int(row["epoch"])
                if (index, epoch) in self.printed:
                    continue
                self.printed.add((index, epoch))
                epochs = next(iter(run.ranks.values())).epochs or 1
                parts = [f"{PREFIX} {run.kind} epoch {epoch}/{epochs}", f"{ranks} ranks"]
                if "samples/s" in row:
                    parts.append(f"{fmt_rate(row['samples/s'])} samples/s")
                parts += [fmt_logs({k: v for k, v in row.items() if k not in ("epoch", "samples/s")}),
                          f"{row['time']:.1f} s"]
                out.append(" | ".join(p for p in parts if p))
                if run is model.curve_run:
                    out += [f"{PREFIX} {reading}" for reading in (noise_reading(model), step_time_reading(model))
                            if reading]
            if not run.kind.has_curves and index not in self.ended and model.run_done(run):
                self.ended.add(index)
                parts = [f"{PREFIX} {run.kind}", f"{ranks} ranks", f"{fmt_rate(model.rate(run))} {run.unit}",
                         fmt_logs(run.mean_logs())]
                out.append(" | ".join(p for p in parts if p))
        for event in model.events[self.events:]:
            out.append(f"{PREFIX} reset: {reset_text(event)}")
        self.events = len(model.events)
        for rank, message in sorted(model.failed.items()):
            if rank not in self.failures:
                self.failures.add(rank)
                out.append(f"{PREFIX} rank {rank} failed: {message}")
        return out
