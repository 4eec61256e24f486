"""The one recovery loop: work on a world (a notebook's cell, a job of ``hvd-notebook run``) whose ranks
died after rank 0 made an ``hvd.elastic`` commit is run again on a new world, and resumes from that
commit, up to ``--max-resets`` times. The session and ``hvd-notebook run`` say what an attempt, a
failure that can be resumed and a reset are; the loop is the same."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class ResetsUsedUp(Exception):
    """Work failed in a way a reset would resume, after as many resets as were allowed.

    Attributes:
        failure: the last attempt's failure.
        lines: one line per reset made, in order.
    """

    def __init__(self, failure: BaseException, lines: list[str]) -> None:
        super().__init__(str(failure))
        self.failure, self.lines = failure, lines


def run_with_resets(attempt: Callable[[], T], resumable: Callable[[BaseException], bool],
                    reset: Callable[[BaseException, int], str], max_resets: int) -> T:
    """Run ``attempt()`` until it returns, resetting the world after each failure that can resume.

    Args:
        attempt: the work; it raises where it fails.
        resumable: whether a failure can resume on a new world (ranks died after a commit).
        reset: makes a new world after ``failure`` for reset number ``number`` (from 1); returns a line on
            it for the history. What it raises ends the loop.
        max_resets: how many resets at most.

    Returns:
        What the first attempt that did not fail returned.

    Raises:
        ResetsUsedUp: from the last failure, where it could resume but ``max_resets`` resets were made (one
            or more).
        BaseException: the failure itself, where it cannot resume, or where no reset was allowed.
    """
    lines: list[str] = []
    while True:
        try:
            return attempt()
        except BaseException as failure:
            if not resumable(failure):
                raise
            if len(lines) >= max_resets:
                if lines:
                    raise ResetsUsedUp(failure, lines) from failure
                raise
            lines.append(reset(failure, len(lines) + 1))
