"""pdb on a rank, driven from the notebook: ``%hvd debug`` on a rank's failed cell (``post_mortem``), and a
rank stopped at ``breakpoint()`` while its cell runs (``at_breakpoint``). Each command is read from the
notebook's input box (the kernel's stdin channel, as IPython's own ``%debug`` reads it in a local kernel),
run by the rank's side (``engine/debugging.py``; ``engine/breakpoints.py``, reached on the engine's control
channel because the cell holds its shell) and its output printed here. Nothing but the cluster's own channels
carries the commands."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from IPython.core.error import StdinNotImplementedError

from ..cluster.launching.channel import RankChannel
from ..config import PREFIX
from ..engine import debugging
from . import failures
from .failures import HvdError

ANSWER_S = 30.0  # a command's answer: pdb on an idle rank answers at once
NO_INPUT = ("This front end cannot take input, which {what} reads its commands from: run it in JupyterLab, "
            "Notebook or jupyter console.")


def rank_to_debug(cluster: Any, failed_ranks: list[int], rank: int | None) -> int:
    """The rank ``%hvd debug`` opens: ``rank``, or the first of ``failed_ranks`` (those that raised in the last
    cell that failed); an ``HvdError`` where there is none, or ``rank`` is not one of ``cluster``.

    Args:
        cluster: the session's cluster.
        failed_ranks: the ranks that raised in the last failed cell.
        rank: the rank asked for, or None.
    """
    if rank is None:
        if not failed_ranks:
            raise HvdError("No %%hvd cell has raised on a rank of this cluster: %hvd debug opens pdb where one "
                           "did (name a rank with --rank R).")
        rank = failed_ranks[0]
    if rank not in [r.rank for r in cluster.ranks]:
        raise failures.unknown_ranks([rank], cluster.n)
    return rank


def post_mortem(cluster: Any, rank: int, ask: Callable[[str], str] = input,
                say: Callable[..., Any] = print) -> None:
    """pdb on ``rank``'s last failed cell, a command at a time from ``ask`` until the session ends.

    Args:
        cluster: the session's cluster.
        rank: the rank to debug.
        ask: reads the user's next pdb command.
        say: shows pdb's answer.
    """
    channel = cluster.channel
    where = _call(channel, rank, debugging.begin)
    if where is None:
        raise HvdError(f"Rank {rank} has no failed cell to debug: %hvd debug opens pdb where a %%hvd cell raised "
                       "on a rank (a rank that died has no traceback: see %hvd status).")
    say(f"{PREFIX} pdb on rank {rank}, where its cell failed (up/down, p EXPR, l, where; q ends it):")
    say(where, end="")
    try:
        _drive(rank, lambda line: _call(channel, rank, debugging.step, line), ask, say)
    except StdinNotImplementedError:
        _call(channel, rank, debugging.end)
        raise HvdError(NO_INPUT.format(what="%hvd debug")) from None
    say(f"{PREFIX} pdb on rank {rank} ended.")


def at_breakpoint(cluster: Any, rank: int, stop: int, where: str, ask: Callable[[str], str] = input,
                  say: Callable[..., Any] = print) -> tuple[bool, int]:
    """pdb on ``rank``, stopped at ``where`` (its stop number ``stop``), a command at a time from ``ask`` until
    the rank goes on: whether it quit (``q``: its cell then fails there), and its last stop taken (``n`` and
    ``s`` stop again).

    Args:
        cluster: the session's cluster.
        rank: the rank stopped at a ``breakpoint()``.
        stop: that stop's number.
        where: the stop's place, as pdb shows it.
        ask: reads the user's next pdb command.
        say: shows pdb's answer.
    """
    stopped = _Stopped(cluster.channel, rank, stop)
    first, _ = stopped.step(None)
    if stopped.stale:  # (taken already: a `next` of an earlier session stopped there)
        return False, stop
    say(f"{PREFIX} rank {rank} stopped at {where}; pdb on it (p EXPR, l, where, n, s; c goes on, q ends the cell "
        "on every rank):")
    say(first, end="")
    try:
        _drive(rank, stopped.step, ask, say)
    except StdinNotImplementedError:
        stopped.step("c")
        say(f"{PREFIX} rank {rank} goes on: {NO_INPUT.format(what='its debugger')}")
        return False, stopped.stop
    say(f"{PREFIX} rank {rank} quit its debugger: the cell ends on every rank." if stopped.quit
        else f"{PREFIX} rank {rank} goes on.")
    return stopped.quit, stopped.stop


def _drive(rank: int, step: Callable[[str], tuple[str, bool]], ask: Callable[[str], str],
           say: Callable[..., Any]) -> None:
    """Read a command with ``ask``, run it with ``step``, show what it printed, until ``step`` says the session
    is over; the end of input (or an interrupt) is ``q``."""
    while True:
        try:
            line = ask(f"(Pdb rank {rank}) ")
        except (EOFError, KeyboardInterrupt):
            line = "q"
        out, done = step(line)
        say(out, end="")
        if done:
            return


class _Stopped:
    """A rank stopped in its debugger, reached with ``hvd_debug_request`` on its engine's control channel."""

    def __init__(self, channel: RankChannel, rank: int, stop: int) -> None:
        self.channel, self.rank, self.stop = channel, rank, stop
        self.stale = self.quit = False

    def step(self, line: str | None) -> tuple[str, bool]:
        """Run ``line`` (None: nothing) at the stop: what pdb printed, and whether the rank went on."""
        deadline = time.monotonic() + ANSWER_S
        while True:
            reply = self._request(line)
            if not reply.get("busy"):
                break
            line = None  # (the command runs on: ask for its answer again)
            if time.monotonic() > deadline:
                deadline = time.monotonic() + ANSWER_S
                print(f"{PREFIX} rank {self.rank} is still running the command (interrupt to end the cell)",
                      file=sys.stderr, flush=True)
        self.stop, self.stale, self.quit = int(reply["stop"]), bool(reply.get("stale")), bool(reply.get("quit"))
        return str(reply.get("output", "")), bool(reply.get("done"))

    def _request(self, line: str | None) -> dict[str, Any]:
        try:
            return self.channel.control(self.rank, "hvd_debug_request", {"stop": self.stop, "command": line},
                                        timeout=ANSWER_S)
        except TimeoutError:
            raise HvdError(f"Rank {self.rank}'s debugger did not answer within {ANSWER_S:g} s: interrupt the "
                           "cell (the stop button) to end it.") from None


def _call(channel: RankChannel, rank: int, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` on the rank, its answer; an ``HvdError`` naming the rank where it gives none."""
    try:
        return channel.call(rank, function, *args, timeout=ANSWER_S)
    except TimeoutError:
        raise HvdError(f"Rank {rank} did not answer within {ANSWER_S:g} s (is it running a cell? %hvd status "
                       "says).") from None
    except Exception as exc:
        raise HvdError(f"Debugging rank {rank} failed: {getattr(exc, 'ename', type(exc).__name__)}: "
                       f"{getattr(exc, 'evalue', exc)}") from None
