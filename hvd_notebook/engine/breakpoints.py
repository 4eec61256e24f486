"""The rank's side of ``breakpoint()`` in a ``%%hvd`` cell: IPython's pdb on the rank, driven from the notebook.

A rank at a breakpoint blocks its engine's shell thread (the cell runs there), so its commands cannot come as
cells: they come on the engine's control channel, which ipykernel serves in a thread of its own, as
``hvd_debug_request`` messages of the notebook's kernel (``kernel/debugging.py``). pdb reads them from a
``Console`` instead of a terminal; what it prints until it asks for the next command is the answer. Each stop
is told to the kernel as a rank event (``EventKind.BREAKPOINT``, with the stop's number); meanwhile the rank
answers the other ranks' stall queries with "in the debugger" (``negotiation.answer_from_debugger``).

>>> install(rank=1)          # once per engine (bootstrap): breakpoint() now stops here, driven from the kernel
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from types import FrameType
from typing import Any

from ..messages import EventKind
from .debugging import refusal

ANSWER_S = 2.0  # the longest a control request waits for pdb's answer (then: busy, ask again)
LINGER_S = 0.3  # after pdb goes on, how long a `next` or `step` has to stop again within the same answer
POLL_S = 0.05  # how often a rank waiting for a command answers the other ranks' stall queries


def code_line(path: str, line: int | str, function: str) -> str:
    """A line of the user's code as they know it: "a cell, line 4" (else the file's path), ", in f()" inside
    a function; also how ``cluster.stacks`` tells where a rank is.

    Args:
        path: the code's file (a cell's is IPython's cell file name).
        line: the line number in it.
        function: the function's name (``<module>`` outside any).
    """
    at = f"a cell, line {line}" if "/ipykernel_" in path or path.startswith("<ipython") else f"{path}, line {line}"
    return at if function == "<module>" else f"{at}, in {function}()"


def where(frame: FrameType) -> str:
    """``frame``'s line as the user knows it.

    Args:
        frame: a frame of the user's code.
    """
    return code_line(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


class Console:
    """pdb's stdin and stdout on a rank: commands handed over by ``exchange`` (the control thread), what pdb
    printed handed back.

    Args:
        idle: called with pdb's place while it waits for a command (to serve the engine's control channel).
    """

    def __init__(self, idle: Any = lambda where: None) -> None:
        self.cond = threading.Condition()
        self.text: list[str] = []  # printed since the last answer
        self.command: str | None = None  # handed over, not read yet
        self.prompting = False  # pdb waits for a command
        self.stopped = False  # in pdb now (not gone on)
        self.stop = 0  # this rank's stops so far: the current one's number
        self.where = ""  # the current stop's line
        self.quit = False  # the last stop ended with q
        self.interrupted = False  # the rank was interrupted while it waited for a command
        self.idle = idle  # called while pdb waits for a command, with where

    # ---------------------------------------------------------------- pdb's side (the cell's thread)
    def write(self, text: str) -> int:
        """What pdb printed, kept for the answer to the command that made it.

        Args:
            text: what pdb printed.
        """
        with self.cond:
            self.text.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def readline(self) -> str:
        """The next command (pdb asks for it): what pdb printed since the last one answers that one."""
        with self.cond:
            self.prompting = True
            self.cond.notify_all()
        try:
            while True:
                with self.cond:
                    if self.command is not None:
                        line, self.command, self.prompting = self.command, None, False
                        return line + "\n"
                    self.cond.wait(POLL_S)
                self.idle(self.where)
        except KeyboardInterrupt:  # the cell was interrupted (another rank failed, --timeout, the stop button)
            with self.cond:
                self.prompting, self.interrupted = False, True
            return "q\n"

    def stopping(self, where: str) -> int:
        """pdb stops (again): the stop's number.

        Args:
            where: the stop's line as the user knows it (``where``).
        """
        with self.cond:
            self.stop += 1
            self.stopped, self.where, self.quit, self.interrupted = True, where, False, False
            self.cond.notify_all()
            return self.stop

    def going_on(self, quit: bool) -> None:
        """pdb leaves its stop: the program goes on, or pdb quit.

        Args:
            quit: whether pdb quit (else it continues the program).
        """
        with self.cond:
            self.stopped, self.prompting, self.quit = False, False, quit
            self.cond.notify_all()

    # ------------------------------------------------------------ the kernel's side (the control thread)
    def exchange(self, stop: int, command: str | None) -> dict[str, Any]:
        """Hand ``command`` to pdb at stop ``stop`` (None: nothing, the answer of what runs) and wait for the
        answer: {output, stop (where pdb is now), done (it went on), quit, busy (no answer yet: ask again),
        stale (that stop is over)}.

        Args:
            stop: the stop the command is for (``stopping``'s number).
            command: the pdb command; None asks for the answer of what runs.
        """
        with self.cond:
            if stop != self.stop or not self.stopped:
                return {"stale": True, "done": True, "stop": self.stop, "output": "", "quit": self.quit}
            if command is not None:
                self.command, self.prompting = command, False
                self.cond.notify_all()
            deadline, linger = time.monotonic() + ANSWER_S, None
            while not (self.stopped and self.prompting):
                now = time.monotonic()
                if not self.stopped:  # gone on: a `next` may stop again at once
                    linger = linger or now + LINGER_S
                    if now >= linger:
                        break
                elif now >= deadline:
                    return {"busy": True, "done": False, "stop": self.stop, "output": "", "quit": False}
                self.cond.wait((deadline if self.stopped else linger) - now)
            output, self.text = "".join(self.text), []
            return {"output": output, "stop": self.stop, "done": not self.stopped, "quit": self.quit,
                    "busy": False}


def _make_pdb(console: Console, rank: int) -> Any:
    from IPython.core.debugger import Pdb

    from ..runtime.core import events

    class RankPdb(Pdb):
        """IPython's pdb reading ``console``; each stop told to the kernel; commands that would read the
        rank's own stdin refused."""

        def __init__(self) -> None:
            super().__init__(stdin=console, stdout=console, nosigint=True)
            self.use_rawinput = False
            self.prompt = ""

        first_file: str | None = None  # until the first stop: the file of the line breakpoint() was called on

        def set_trace(self, frame: Any = None, **kwargs: Any) -> None:
            # The first stop is the next line of that file: IPython runs each top-level statement of a cell
            # as a code object of its own, so the line after an `if ...: breakpoint()` is in another frame;
            # neither that statement's return nor the next one's call is a stop, nor anything of other files.
            self.first_file = frame.f_code.co_filename if frame is not None else None
            super().set_trace(frame, **kwargs)

        def stop_here(self, frame: Any) -> bool:
            return (self.first_file is None or frame.f_code.co_filename == self.first_file) and super().stop_here(frame)

        def user_call(self, frame: Any, argument_list: Any) -> None:
            if self.first_file is None:
                super().user_call(frame, argument_list)

        def user_return(self, frame: Any, return_value: Any) -> None:
            if self.first_file is None or frame.f_code.co_name != "<module>":
                super().user_return(frame, return_value)

        def interaction(self, frame: Any, tb_or_exc: Any) -> None:
            self.first_file = None
            at = where(frame) if frame is not None else "?"
            stop = console.stopping(at)
            events.emit(EventKind.BREAKPOINT, f"rank {rank} stopped at {at}", stop=stop, where=at)
            try:
                with contextlib.redirect_stdout(console):  # (what `!print(x)` prints is an answer too)
                    super().interaction(frame, tb_or_exc)
            finally:
                console.going_on(self.quitting)
            if console.interrupted:
                raise KeyboardInterrupt

        def onecmd(self, line: str) -> Any:
            refused = refusal(line, "a rank's debugger")
            if refused:
                self.message(refused)
                return False
            return super().onecmd(line)

    return RankPdb()


class _Engine:
    console: Console | None = None
    rank = 0


def install(rank: int) -> None:
    """Make ``breakpoint()`` stop this rank in pdb driven from the notebook, and serve the kernel's
    ``hvd_debug_request`` on the engine's control channel (once per engine).

    Args:
        rank: this engine's rank, told to the kernel with each stop.
    """
    from IPython import get_ipython

    from ..runtime.core.negotiation import answer_from_debugger

    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None or _Engine.console is not None:
        return
    console = _Engine.console = Console(idle=answer_from_debugger)
    _Engine.rank = rank

    def handle(stream: Any, ident: Any, parent: dict[str, Any]) -> None:  # (the control thread)
        content = parent.get("content") or {}
        reply = console.exchange(int(content.get("stop", 0)), content.get("command"))
        kernel.session.send(stream, "hvd_debug_reply", reply, parent, ident=ident)

    kernel.control_handlers["hvd_debug_request"] = handle
    sys.breakpointhook = hook


def broken() -> bool:
    """Whether this rank's collectives were left half-way (``runtime.core.debugger.broken``)."""
    from ..runtime.core import debugger

    return debugger.broken()


def renew() -> None:
    """Fresh collectives on this rank (collective: on every rank; ``runtime.core.debugger.renew``)."""
    from ..runtime.core import debugger

    debugger.renew()


def hook(*args: Any, frame: FrameType | None = None, **kwargs: Any) -> None:
    """``sys.breakpointhook`` of an engine: pdb at the caller's line (``frame``), driven from the notebook.
    ``PYTHONBREAKPOINT=0`` turns it off, as Python's own hook.

    Args:
        *args: ``breakpoint()``'s arguments (ignored, as pdb's own hook does).
        frame: where to stop; the caller's frame where None.
        **kwargs: ``breakpoint()``'s keyword arguments (ignored).
    """
    if os.environ.get("PYTHONBREAKPOINT") == "0" or _Engine.console is None:
        return
    stop(_Engine.console, _Engine.rank, frame or sys._getframe(1))


def stop(console: Console, rank: int, frame: FrameType) -> None:
    """pdb at ``frame``'s next line, reading ``console``.

    Args:
        console: the rank's pdb console.
        rank: this engine's rank.
        frame: the frame pdb stops in.
    """
    _make_pdb(console, rank).set_trace(frame)


hook.takes_frame = True  # type: ignore[attr-defined]
