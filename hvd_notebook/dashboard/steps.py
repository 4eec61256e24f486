"""Where a run's recent training steps went, from each rank's step times (seconds, and seconds in
collectives): the throughput that scaling efficiency compares, the share of a step in collectives and the
rank the others wait for. Plain Python, no display."""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

STEP_WINDOW = 50  # the step breakdown's steps: the most recent that every rank has timed
WAITED_SHARE = 0.10  # a rank is waited for where the others wait for it this share of a step ...
WAITED_MIN_S = 0.005  # ... and at least this long

StepTimes = dict[int, tuple[float, float]]  # step -> (seconds, seconds in collectives)


@dataclass
class StepBreakdown:
    """Where the recent training steps' time went: in collectives (waiting for the other ranks, moving data)
    or outside them (``ProgressModel.step_breakdown``).

    >>> breakdown = model.step_breakdown()
    >>> f"communication {breakdown.fraction:.0%} of each step", breakdown.waited_for
    ('communication 38% of each step', 1)
    """

    fraction: float  # seconds in collectives over step seconds, each rank's over the window, mean over ranks
    waited_for: int | None  # the rank the others wait for; None where no rank holds them back much
    waited_s: float  # how long the others wait per step, on average, for the rank most often slowest
    step_s: float  # seconds per step, mean over ranks
    per_rank: dict[int, tuple[float, float]]  # rank -> (seconds in collectives per step, seconds per step)
    slowest: dict[int, int]  # step -> the rank with the least time in collectives, the one the others waited for
    steps: int  # the steps of the window


class StepTiming:
    """The timed steps of every rank of one run, and what they add up to.

    Args:
        times: rank -> its timed steps (step -> (seconds, seconds in collectives)); at least one rank.
        batch_sizes: rank -> its samples per step, None where unknown.
    """

    def __init__(self, times: dict[int, StepTimes], batch_sizes: dict[int, int | None]) -> None:
        self.times = dict(sorted(times.items()))
        self.batch_sizes = batch_sizes

    def rate(self) -> float | None:
        """Samples a second summed over the ranks, from their steps' mean time; None where a rank timed no
        step or its batch is unknown."""
        rates = []
        for rank, times in self.times.items():
            walls = [wall for wall, _ in times.values()]
            batch = self.batch_sizes.get(rank)
            if not walls or not batch or statistics.fmean(walls) <= 0:
                return None
            rates.append(batch / statistics.fmean(walls))
        return sum(rates)

    def breakdown(self) -> StepBreakdown | None:
        """The share in collectives of the last ``STEP_WINDOW`` steps every rank timed, and the rank the others
        wait for; None where no step is common to all, or no collective time was counted."""
        times = self.times
        window = sorted(set.intersection(*(set(t) for t in times.values())))[-STEP_WINDOW:]
        if not window or not any(t[i][1] for t in times.values() for i in window):
            return None
        per_rank = {r: (statistics.fmean(t[i][1] for i in window), statistics.fmean(t[i][0] for i in window))
                    for r, t in times.items()}
        fraction = statistics.fmean(min(1.0, c / s) if s > 0 else 0.0 for c, s in per_rank.values())
        step_s = statistics.fmean(s for _, s in per_rank.values())
        slowest = {i: min(times, key=lambda r: times[r][i][1]) for i in window}
        waited_for, waited_s = self._waited_for(window, slowest, step_s)
        return StepBreakdown(fraction, waited_for, waited_s, step_s, per_rank, slowest, len(window))

    def _waited_for(self, window: list[int], slowest: dict[int, int], step_s: float) -> tuple[int | None, float]:
        """The rank most often slowest and the others' mean wait for it per step; no rank where that wait
        is small (or there is no other rank)."""
        if len(self.times) < 2:
            return None, 0.0
        candidate = Counter(slowest.values()).most_common(1)[0][0]
        others = [r for r in self.times if r != candidate]
        waited_s = statistics.fmean(self.times[r][i][1] - self.times[candidate][i][1] for i in window for r in others)
        held_back = waited_s > max(WAITED_SHARE * step_s, WAITED_MIN_S)
        return (candidate if held_back else None), waited_s
