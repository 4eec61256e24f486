"""``%hvd debug``: pdb on a rank's failed cell, driven from the notebook. Each command is read from the
notebook's input box (the kernel's stdin channel, as IPython's own ``%debug`` reads it in a local kernel),
run by the rank's side (``engine/debugging.py``) and its output printed here; ``q`` ends it. The other ranks
are untouched, and nothing but the cluster's own channel carries the commands."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from IPython.core.error import StdinNotImplementedError

from ..engine import debugging
from .failures import HvdError

ANSWER_S = 30.0  # a command's answer: pdb on an idle rank answers at once


def post_mortem(cluster: Any, rank: int, ask: Callable[[str], str] = input,
                say: Callable[..., Any] = print) -> None:
    """pdb on ``rank``'s last failed cell, a command at a time from ``ask`` until the session ends."""
    view = cluster.client[cluster.engine_ids([rank])[0]]
    where = _call(view, rank, debugging.begin)
    if where is None:
        raise HvdError(f"Rank {rank} has no failed cell to debug: %hvd debug opens pdb where a %%hvd cell raised "
                       "on a rank (a rank that died has no traceback: see %hvd status).")
    say(f"[hvd] pdb on rank {rank}, where its cell failed (up/down, p EXPR, l, where; q ends it):")
    say(where, end="")
    while True:
        try:
            line = ask(f"(Pdb rank {rank}) ")
        except StdinNotImplementedError:
            _call(view, rank, debugging.end)
            raise HvdError("This front end cannot take input, which %hvd debug reads its commands from: run it "
                           "in JupyterLab, Notebook or jupyter console.") from None
        except (EOFError, KeyboardInterrupt):
            line = "q"
        out, done = _call(view, rank, debugging.step, line)
        say(out, end="")
        if done:
            say(f"[hvd] pdb on rank {rank} ended.")
            return


def _call(view: Any, rank: int, function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` on the rank, its answer; an ``HvdError`` naming the rank where it gives none."""
    try:
        return view.apply_async(function, *args).get(timeout=ANSWER_S)
    except TimeoutError:
        raise HvdError(f"Rank {rank} did not answer within {ANSWER_S:g} s (is it running a cell? %hvd status "
                       "says).") from None
    except Exception as exc:
        raise HvdError(f"Debugging rank {rank} failed: {getattr(exc, 'ename', type(exc).__name__)}: "
                       f"{getattr(exc, 'evalue', exc)}") from None
