"""The one recovery loop: work on a world (a notebook's cell, a job of ``hvd-notebook run``) whose ranks
died after rank 0 made an ``hvd.elastic`` commit is run again on a new world, and resumes from that
commit, up to ``--max-resets`` times. The session and ``hvd-notebook run`` say what an attempt, a
failure that can be resumed and a reset are; the loop is the same."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_with_resets(attempt: Callable[[], T], resumable: Callable[[T], bool], reset: Callable[[T, int], str],
                    max_resets: int) -> tuple[T, list[str]]:
    """``attempt()``; while what it returned is a failure that ``resumable`` says can resume and fewer than
    ``max_resets`` resets were made, ``reset(failure, number)`` (a new world: it returns a line on the
    reset, for the history) and ``attempt()`` again. What the last attempt returned, and the lines."""
    outcome, lines = attempt(), []
    while len(lines) < max_resets and resumable(outcome):
        lines.append(reset(outcome, len(lines) + 1))
        outcome = attempt()
    return outcome, lines
