"""``tqdm`` bars in ``%%hvd`` cells feed the dashboard instead of printing interleaved text.

``install`` (once per engine, from the bootstrap) puts ``DashboardTqdm`` in place of ``tqdm.tqdm``,
``tqdm.std.tqdm``, ``tqdm.auto.tqdm`` and ``tqdm.notebook.tqdm`` (and their ``trange``), so a cell's
``from tqdm.auto import tqdm`` gets it with nothing added to the user's code. While a cell reports
progress, a bar writes nothing and reports its position through ``custom_loops.report``: the innermost
open bar is the steps of an epoch, an outer bar (``for epoch in trange(E)``) the epochs; numbers given
to ``set_postfix`` are the metrics; a bar over a ``DataLoader`` counts ``batch_size`` samples per
step, so the dashboard shows samples/s. A bar made with ``disable=True`` on some ranks (the usual
``disable=hvd.rank() != 0``) still reports: the dashboard shows every rank. Outside a reporting cell
(``%%hvd --no-progress``, a script under mpiexec) the bar is tqdm's own.
"""

from __future__ import annotations

import importlib
import io
import numbers
from typing import Any

from .custom_loops import report
from .reporter import reporting

_MODULES = ("tqdm", "tqdm.std", "tqdm.auto", "tqdm.autonotebook", "tqdm.notebook")


class _Sink(io.StringIO):
    """Where a reporting bar writes: nowhere."""

    def write(self, text: str) -> int:
        return len(text)


class _Open:
    """The reporting bars now open on this rank, outermost first, and the samples of closed inner bars."""

    bars: list[Any] = []
    samples_before = 0


def _numbers(values: dict[str, Any]) -> dict[str, float]:
    return {str(k): float(v) for k, v in values.items() if isinstance(v, numbers.Real) and not isinstance(v, bool)}


def _report() -> None:
    """Tell the dashboard where the open bars are."""
    bars = _Open.bars
    if not bars or (len(bars) == 1 and bars[0].hvd_outer):  # an epoch bar between its inner bars
        return
    inner, outer = bars[-1], (bars[0] if len(bars) > 1 else None)
    total = int(inner.total) if inner.total else None
    batch = inner.hvd_batch_size
    samples = _Open.samples_before + int(inner.n) * batch if batch else None
    inner.hvd_reported = inner.n
    metrics = dict(outer.hvd_metrics) if outer is not None else {}
    metrics.update(inner.hvd_metrics)
    report(step=int(inner.n), total=total,
                    epoch=int(outer.n) if outer is not None else None,
                    epochs=int(outer.total) if outer is not None and outer.total else None,
                    samples=samples, **metrics)


def dashboard_class(base: type) -> type:
    """A subclass of tqdm's ``base`` whose bars report to the dashboard while a cell reports progress.

    Args:
        base: tqdm's class (``tqdm.tqdm``, or ``tqdm.auto``'s).
    """

    class DashboardTqdm(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self.hvd_reporting = reporting()
            self.hvd_metrics: dict[str, float] = {}
            if self.hvd_reporting:
                # every step reaches update() (tqdm's iterator otherwise counts in a local variable between
                # prints, and an outer bar's position would lag a whole epoch); nothing is drawn (display)
                kwargs.update(file=_Sink(), disable=False, mininterval=0, miniters=1)
                kwargs.pop("gui", None)
            super().__init__(*args, **kwargs)
            if not self.hvd_reporting:
                return
            self.hvd_batch_size = getattr(self.iterable, "batch_size", None)
            if not isinstance(self.hvd_batch_size, int):
                self.hvd_batch_size = None
            self.hvd_reported = None  # the position last reported
            self.hvd_outer = False  # an inner bar was opened inside this one: it counts epochs
            if _Open.bars:
                _Open.bars[0].hvd_outer = True
            else:
                _Open.samples_before = 0
            _Open.bars.append(self)

        def update(self, n: float = 1) -> Any:
            shown = super().update(n)
            if self.hvd_reporting:
                _report()
            return shown

        def display(self, msg: Any = None, pos: Any = None) -> Any:
            return True if getattr(self, "hvd_reporting", False) else super().display(msg, pos)

        def set_postfix(self, ordered_dict: Any = None, refresh: bool = True, **kwargs: Any) -> None:
            if self.hvd_reporting:
                self.hvd_metrics.update(_numbers(dict(ordered_dict or {}, **kwargs)))
            super().set_postfix(ordered_dict, refresh, **kwargs)

        def close(self) -> None:
            # (by identity: tqdm compares bars by their screen position)
            if getattr(self, "hvd_reporting", False) and any(b is self for b in _Open.bars):
                if self.n != self.hvd_reported:  # (a finished run is not reported twice: it would start anew)
                    _report()
                _Open.bars[:] = [b for b in _Open.bars if b is not self]
                if _Open.bars and self.hvd_batch_size:  # an inner bar ended: its samples stay counted
                    _Open.samples_before += int(self.n) * self.hvd_batch_size
                elif not _Open.bars:
                    _Open.samples_before = 0
            super().close()

    DashboardTqdm.__name__ = DashboardTqdm.__qualname__ = "tqdm"
    DashboardTqdm.__module__ = base.__module__
    return DashboardTqdm


def install() -> bool:
    """Put the dashboard's bar in place of tqdm's wherever a cell may import it (once per process).
    False where tqdm is not installed."""
    try:
        std = importlib.import_module("tqdm.std")
    except ImportError:
        return False
    if getattr(std.tqdm, "hvd_dashboard", False):
        return True
    cls = dashboard_class(std.tqdm)
    cls.hvd_dashboard = True

    def trange(*args: Any, **kwargs: Any) -> Any:
        return cls(range(*args), **kwargs)

    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except Exception:  # (tqdm.notebook needs ipywidgets; any of them may be missing)
            continue
        if hasattr(module, "tqdm"):
            module.tqdm = cls
        if hasattr(module, "trange"):
            module.trange = trange
    return True


__all__ = ["dashboard_class", "install"]
