"""``python -m hvd_notebook.engine.script_main train.py ...``: how ``hvd-notebook run`` runs a
Python script on each rank.

The script runs as ``python train.py`` would run it. A rank that fails (an uncaught exception,
or ``sys.exit`` with a non-zero code) prints why and ends at once with that code, without
MPI_Finalize: finalizing would wait for the other ranks, which wait for it in a collective,
and the world would hang. The launcher then sees the rank's exit code, names it, and ends
the others. A rank that succeeds ends as usual.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback

INTERRUPTED = 128 + 2  # the exit code of a process ended by SIGINT, as shells report it
USAGE = "usage: python -m hvd_notebook.engine.script_main (SCRIPT | -m MODULE | -c CODE) [ARGS...]"


def run(argv: list[str]) -> None:
    """Run the script, module (``-m``) or code (``-c``) that ``argv`` names, as ``__main__``.

    Args:
        argv: ``SCRIPT ARGS...``, ``-m MODULE ARGS...`` or ``-c CODE ARGS...``.
    """
    if not argv or (argv[0] in ("-m", "-c") and len(argv) < 2):
        raise SystemExit(USAGE)
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    elif argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
        exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as python sets it for a script
        runpy.run_path(argv[0], run_name="__main__")


def _user_traceback(exc: BaseException) -> traceback.TracebackException:
    """The exception without the frames of this module and of runpy, which say nothing to the user."""
    tb = exc.__traceback__
    while tb is not None and (tb.tb_frame.f_code.co_filename in (__file__, runpy.__file__)
                              or "runpy" in tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    return traceback.TracebackException(type(exc), exc, tb)


def exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit(code)`` asks for, as the interpreter reads it (a message: 1).

    Args:
        exc: the ``SystemExit`` the script raised.
    """
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1


def whole_lines() -> None:
    """Under ``PYTHONUNBUFFERED`` (or ``python -u``) ``print`` writes its text and its newline
    apart, and the launcher, which merges every rank's output, could put another rank's line
    between them: each line goes out in one write instead, as soon as it ends, as before."""
    for stream in (sys.stdout, sys.stderr):
        if getattr(stream, "write_through", False):
            stream.reconfigure(write_through=False, line_buffering=True)


def _end_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main() -> None:
    """Run the script; a failure ends this process at once with the failure's code."""
    from ..runtime.core import topology

    rank, size = topology.initialize_mpi()  # before the script: a failed MPI_Init has then run none of its code
    from . import stacks

    stacks.register(rank, size)  # hvd-notebook stacks
    whole_lines()
    try:
        run(sys.argv[1:])
    except SystemExit as exc:
        code = exit_code(exc)
        if code:
            _end_now(code)
    except BaseException as exc:
        print("".join(_user_traceback(exc).format()), end="", file=sys.stderr)
        if isinstance(exc, KeyboardInterrupt):
            # the launcher ending this rank because another one failed: end as usual, so that the
            # launcher (which follows up with SIGQUIT) reports that rank, not this one
            raise SystemExit(INTERRUPTED) from None
        _end_now(1)


if __name__ == "__main__":
    main()
