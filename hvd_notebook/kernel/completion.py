"""Tab completion and inspection (Shift-Tab, the contextual help) in ``%%hvd`` cells from rank 0's namespace,
where the cells' variables live; everywhere else the kernel completes and inspects as before.

Completion is an IPython context matcher (``IPCompleter.custom_matchers``); inspection wraps the ipykernel
kernel's ``do_inspect``, the one place that sees the cell and not only the name. Both ask rank 0 through the
session (``ask_idle``: the cluster's own channel, a short timeout, never while a cell runs) and fall
back to the kernel's own answer where rank 0 gives none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from IPython.core.completer import CompletionContext, SimpleCompletion, SimpleMatcherResult, context_matcher
from IPython.utils.tokenutil import token_at_cursor

from ..engine import completion as on_rank
from .session import Session

log = logging.getLogger(__name__)

ANSWER_S = 0.2  # how long a completion or inspection waits for rank 0 before the kernel answers itself
MAGIC = "%%hvd"


def cell_body(code: str, cursor_pos: int) -> tuple[str, int] | None:
    """The code a ``%%hvd`` cell runs on the ranks and the cursor in it; None outside such cells, and with
    the cursor on the magic's own line (its options complete as before).

    >>> cell_body("%%hvd --timeout 9\\nx = mod", 24)
    ('x = mod', 7)

    Args:
        code: the whole cell.
        cursor_pos: the cursor's offset in ``code``.
    """
    if not code.startswith(MAGIC) or code[len(MAGIC):len(MAGIC) + 1] not in ("", " ", "\t", "\n"):
        return None
    newline = code.find("\n")
    if newline < 0 or cursor_pos <= newline:
        return None
    return code[newline + 1:], cursor_pos - newline - 1


def ask_idle(func: Callable[..., Any], *args: Any, timeout: float) -> Any:
    """``func(*args)`` on rank 0 of the session's cluster, only while nothing uses the cluster: None at once where
    a command holds it (a cell runs) or requests are pending, and None where no answer came within ``timeout``
    seconds (the request then runs when rank 0 gets to it) or ``func`` raised. ``func`` must not return None.

    Args:
        func: the function rank 0 runs.
        *args: its arguments.
        timeout: seconds to wait for rank 0's answer.
    """
    session = Session.get()
    with session.in_use(wait=False) as held:
        cluster = session.cluster
        if not held or cluster is None:
            return None
        try:
            if cluster.channel.waiting() or cluster.channel.busy([0], timeout)[0]:  # (the kernel's or others' work)
                return None
            return cluster.channel.call(0, func, *args, timeout=timeout)
        except Exception as exc:  # (no answer in time, the rank's own error, a controller gone)
            log.debug("rank 0 did not answer %s: %s", getattr(func, "__name__", func), exc)
            return None


@context_matcher(identifier="hvd_notebook.rank_matcher")
def rank_matcher(context: CompletionContext) -> SimpleMatcherResult:
    """Rank 0's completions in a ``%%hvd`` cell, in place of the kernel's (which they suppress).

    Args:
        context: IPython's completion context of the cell.
    """
    lines = context.full_text.split("\n")
    cursor = sum(len(line) + 1 for line in lines[:context.cursor_line]) + context.cursor_position
    found = cell_body(context.full_text, cursor)
    answer = None if found is None else ask_idle(on_rank.complete, *found, timeout=ANSWER_S)
    if not answer or not answer[1]:  # (with no completions IPython lets the others through anyway)
        return {"completions": [], "suppress": False}
    body, body_cursor = found  # type: ignore[misc]
    start, completions = answer
    return {"completions": [SimpleCompletion(text, type=kind) for text, kind in completions],
            "matched_fragment": body[start:body_cursor], "suppress": True}


def inspect_on_rank(shell: Any, code: str, cursor_pos: int, detail_level: int = 0,
                    omit_sections: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """An inspect_reply's content for rank 0's object under the cursor of a ``%%hvd`` cell; None where the
    kernel should answer (outside such cells, or rank 0 gave no answer in time).

    Args:
        shell: the IPython shell.
        code: the whole cell.
        cursor_pos: the cursor's offset in ``code``.
        detail_level: 0 for ``obj?``, 1 for ``obj??``.
        omit_sections: sections of the answer to leave out, as IPython's inspector takes them.
    """
    found = cell_body(code, cursor_pos)
    if found is None:
        return None
    bundle = ask_idle(on_rank.inspect, token_at_cursor(*found), detail_level, tuple(omit_sections),
                      timeout=ANSWER_S)
    if bundle is None:
        return None
    if not shell.enable_html_pager:  # (as ipykernel's own do_inspect)
        bundle.pop("text/html", None)
    return {"status": "ok", "found": bool(bundle), "data": bundle, "metadata": {}}


def install(shell: Any) -> None:
    """Complete and inspect ``%%hvd`` cells from rank 0 in ``shell`` (and its ipykernel kernel, where it has
    one: a terminal IPython has no inspect requests). Installing twice changes nothing.

    Args:
        shell: the IPython shell to complete in.
    """
    if rank_matcher not in shell.Completer.custom_matchers:
        shell.Completer.custom_matchers.append(rank_matcher)
    kernel = getattr(shell, "kernel", None)
    if kernel is None or hasattr(kernel.do_inspect, "kernel_own"):
        return
    own = kernel.do_inspect

    def do_inspect(code: str, cursor_pos: int, detail_level: int = 0, omit_sections: tuple[str, ...] = ()) -> Any:
        reply = inspect_on_rank(shell, code, cursor_pos, detail_level, omit_sections)
        return own(code, cursor_pos, detail_level, omit_sections) if reply is None else reply

    do_inspect.kernel_own = own  # type: ignore[attr-defined]
    do_inspect.replaced = vars(kernel).get("do_inspect")  # type: ignore[attr-defined]  # (None: the class's)
    kernel.do_inspect = do_inspect


def uninstall(shell: Any) -> None:
    """Undo ``install``: the kernel completes and inspects as before the extension was loaded.

    Args:
        shell: the IPython shell ``install`` was given.
    """
    if rank_matcher in shell.Completer.custom_matchers:
        shell.Completer.custom_matchers.remove(rank_matcher)
    kernel = getattr(shell, "kernel", None)
    if kernel is None or not hasattr(kernel.do_inspect, "kernel_own"):
        return
    if kernel.do_inspect.replaced is None:
        del kernel.do_inspect
    else:
        kernel.do_inspect = kernel.do_inspect.replaced
