"""The rank's side of ``%hvd debug`` in this process: pdb on the last failed cell's traceback, one command at a
time, its output handed back; commands that would read this process's own stdin are refused. And of
``breakpoint()``: pdb stopped in another thread (as in a rank's cell), driven as the control channel drives it."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from hvd_notebook.engine import breakpoints, debugging


def _fail() -> None:
    def scaled(x: int) -> int:
        secret = x * 7  # noqa: F841 (read by the debugger)
        raise ValueError("gives up")

    try:
        scaled(6)
    except ValueError:
        sys.last_type, sys.last_value, sys.last_traceback = sys.exc_info()


def test_pdb_on_the_last_traceback_one_command_at_a_time(ip, monkeypatch):
    monkeypatch.delattr(sys, "last_traceback", raising=False)
    assert debugging.begin() is None  # no failed cell here
    _fail()
    where = debugging.begin()
    assert "secret = x * 7" in where or "raise ValueError" in where, where
    assert debugging.step("p secret") == ("42\n", False)
    assert debugging.step("p x + 1") == ("7\n", False)
    out, done = debugging.step("interact")
    assert "not available in %hvd debug" in out and not done
    assert debugging.step("q")[1] is True
    out, done = debugging.step("p secret")
    assert done and "no debugging session" in out


@pytest.mark.parametrize("command", ["c", "continue"])
def test_continuing_ends_the_session(ip, command):
    _fail()
    debugging.begin()
    assert debugging.step(command)[1] is True
    assert debugging._Session.debugger is None


# ------------------------------------------------------------------ breakpoint() on a rank (engine/breakpoints.py)
def _stop_in_a_thread(console: breakpoints.Console) -> tuple[threading.Thread, dict]:
    """A thread that stops at a breakpoint in ``cell`` (as a rank's cell would), driven through ``console``."""
    outcome: dict = {}

    def cell() -> None:
        secret = 6 * 7
        breakpoints.stop(console, 1, sys._getframe())
        after = secret + 1
        outcome["after"] = after

    def run() -> None:
        try:
            cell()
        except BaseException as exc:  # (what the rank's cell would raise)
            outcome["raised"] = type(exc).__name__

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while console.stop == 0 or not console.prompting:
        assert time.monotonic() < deadline, "pdb did not stop"
        time.sleep(0.01)
    return thread, outcome


def test_a_breakpoint_driven_one_command_at_a_time(ip):
    console = breakpoints.Console()
    thread, outcome = _stop_in_a_thread(console)
    stop = console.stop
    first = console.exchange(stop, None)
    assert "after = secret + 1" in first["output"] and not first["done"], first
    assert console.exchange(stop, "p secret")["output"] == "42\n"
    assert "not available in a rank's debugger" in console.exchange(stop, "interact")["output"]
    step = console.exchange(stop, "n")  # pdb goes on and stops again: the same answer, a new stop
    assert step["stop"] == stop + 1 and not step["done"] and "outcome[\"after\"] = after" in step["output"], step
    assert console.exchange(stop, "p 1")["stale"]  # (the old stop is over)
    assert console.exchange(stop + 1, "p after")["output"] == "43\n"
    end = console.exchange(stop + 1, "c")
    assert end["done"] and not end["quit"], end
    thread.join(5)
    assert outcome == {"after": 43}
    assert console.exchange(stop + 1, None)["stale"]


def test_quitting_a_breakpoint_raises_bdbquit_in_the_cell(ip):
    console = breakpoints.Console()
    thread, outcome = _stop_in_a_thread(console)
    end = console.exchange(console.stop, "q")
    assert end["done"] and end["quit"], end
    thread.join(5)
    assert outcome == {"raised": "BdbQuit"}


def test_a_waiting_rank_answers_stall_queries_between_commands(ip):
    seen = []
    console = breakpoints.Console(idle=seen.append)
    thread, _ = _stop_in_a_thread(console)
    time.sleep(3 * breakpoints.POLL_S)
    assert seen and seen[-1].endswith(", in cell()"), seen  # where it stopped, with each query answered
    console.exchange(console.stop, "c")
    thread.join(5)
