"""Curves that read right: the per-step values behind the running means Keras
reports, and light smoothing for display.

Keras' ``fit`` logs each metric at a batch's end as the mean over the epoch's
batches so far, reset at every epoch: plotted as they come, the curves
saw-tooth at each epoch boundary. With ``m_k`` the mean after batch ``k`` of an
epoch, batch ``k``'s own value is ``k*m_k - (k-1)*m_(k-1)``; where the throttled
updates skip batches (the previous reported step is ``j < k - 1``), the mean of
batches ``j+1..k`` is ``(k*m_k - j*m_j) / (k-j)``, plotted at step ``k``.
Plain Python, no display."""

from __future__ import annotations

from dataclasses import dataclass

SMOOTH_POINTS_PER_HALF_WIDTH = 40  # the rolling mean's half-width grows by one per this many points
SMOOTH_MAX_HALF_WIDTH = 12  # ... up to 25 points at most


@dataclass
class StepValues:
    """Recovers one rank's per-step values of one metric from its running means, as they arrive.

    >>> values = StepValues()
    >>> values.add(epoch=0, step=1, mean=3.0), values.add(0, 2, 2.5), values.add(0, 4, 2.0)
    (3.0, 2.0, 1.5)
    """

    last: tuple[int, int, float] | None = None  # the latest report: (epoch, step, running mean)
    prior: tuple[int, int, float] | None = None  # the report the latest value was recovered against

    def add(self, epoch: int, step: int, mean: float) -> float | None:
        """The value of the batches since the previous report of this epoch (at ``step``); None for a
        report before the epoch's first batch (``step`` 0), which carries the previous epoch's means.

        Args:
            epoch: the epoch the report is of.
            step: the steps of the epoch so far.
            mean: the metric's running mean over those steps.
        """
        if step <= 0:
            return None
        last = self.last
        if last is not None and last[0] == epoch and last[1] == step:
            last = self.prior  # the same step again (the epoch's end after its last batch): same reference
        elif last is None or last[0] != epoch or last[1] > step:
            last = None  # a new epoch, or the epoch again from its start (a resumed run)
        self.prior, self.last = last, (epoch, step, mean)
        if last is None:
            return mean
        _, j, mean_j = last
        return (step * mean - j * mean_j) / (step - j)


def half_width(points: int) -> int:
    """The smoothing's half-width for a curve of ``points`` points: light, growing with the curve.

    Args:
        points: the curve's number of points.
    """
    return min(SMOOTH_MAX_HALF_WIDTH, points // SMOOTH_POINTS_PER_HALF_WIDTH)


def smooth(values: list[float], width: int | None = None) -> list[float]:
    """A centered rolling mean over ``2*width + 1`` points (``half_width`` of the curve by default),
    narrowed at both ends to the points there are: no lag, and the curve's ends stay where they are.

    >>> smooth([0.0, 3.0, 0.0, 3.0], width=1)
    [1.5, 1.0, 2.0, 1.5]

    Args:
        values: the curve's values.
        width: the half-width; ``half_width(len(values))`` where None.
    """
    width = half_width(len(values)) if width is None else width
    if width <= 0 or len(values) < 2:
        return list(values)
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    out = []
    for i in range(len(values)):
        low, high = max(0, i - width), min(len(values), i + width + 1)
        out.append((sums[high] - sums[low]) / (high - low))
    return out
